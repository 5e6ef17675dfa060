"""Qwen3 mixture-of-experts decoder (Qwen Team, "Qwen3 Technical Report", arXiv:2505.09388).

Serves HF architecture ``Qwen3MoeForCausalLM`` (``model_type`` ``qwen3_moe``, e.g.
Qwen3-30B-A3B: 48 layers, 128 experts of intermediate size 768, 8 chosen per token). The
attention is Qwen3's (`attnserve.models.qwen3.Qwen3Attention`: QK-norm, no bias); the
feed-forward of layer ``i`` is a `SparseMoeBlock` (softmax router, top-``num_experts_per_tok``,
renormalised when ``norm_topk_prob``) unless ``i`` is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``, where it is a dense SwiGLU MLP of
``intermediate_size`` (HF ``Qwen3MoeDecoderLayer.__init__``).

HF names: the router is ``mlp.gate.weight``, experts ``mlp.experts.{e}.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.models.layers.moe.routing import routing_config_from_hf
from attnserve.models.layers.moe.sparse_block import SparseMoeBlock
from attnserve.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


def qwen3_moe_layer_is_sparse(config: Any, layer_id: int) -> bool:
    """HF's rule: experts unless the layer is in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` stride."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and int(config.num_experts) > 0 and (layer_id + 1) % step == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Pre-norm block: `Qwen3Attention`, then a `SparseMoeBlock` or a dense MLP."""

    def _make_mlp(self, config: Any, layer_id: int, dtype: torch.dtype, tp: Optional[TPGroup]) -> nn.Module:
        if qwen3_moe_layer_is_sparse(config, layer_id):
            return SparseMoeBlock(config.hidden_size, int(config.num_experts), int(config.moe_intermediate_size),
                                  routing_config_from_hf(config), dtype, tp)
        return super()._make_mlp(config, layer_id, dtype, tp)


class Qwen3MoeModel(Qwen3Model):
    """Embedding, `Qwen3MoeDecoderLayer` stack and final norm (HF prefix ``model.``)."""

    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE causal LM for the engine (expert tensors are loaded by `CausalLM.load_weights`).

    Args:
        config: HF ``Qwen3MoeConfig``-like: the `Qwen3ForCausalLM` fields plus
            ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
            ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``.
        dtype: parameter dtype (uninitialised until loaded).
        tp: this rank's group; every expert's intermediate rows are split over its ranks.

    Raises:
        ValueError: a ``--tp-size`` that does not divide ``moe_intermediate_size``.
    """

    model_cls = Qwen3MoeModel


EntryClass = Qwen3MoeForCausalLM
