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

from typing import Any, Dict, Iterable, Optional, Set, Tuple

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.models.layers.moe.routing import routing_config_from_hf
from attnserve.models.layers.moe.sparse_block import (
    SparseMoeBlock,
    check_experts_complete,
    is_expert_param,
    route_expert_tensors,
)
from attnserve.models.layers.norm import RMSNorm
from attnserve.models.layers.rotary import RotaryEmbedding
from attnserve.models.llama import LlamaDecoderLayer, LlamaMLP
from attnserve.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3Model


def qwen3_moe_layer_is_sparse(config: Any, layer_id: int) -> bool:
    """HF's rule: experts unless the layer is in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` stride."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and int(config.num_experts) > 0 and (layer_id + 1) % step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Pre-norm block: `Qwen3Attention`, then a `SparseMoeBlock` or a dense MLP
    (``forward`` is Llama's)."""

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        nn.Module.__init__(self)
        eps = config.rms_norm_eps
        self.self_attn = Qwen3Attention(config, layer_id, rotary_emb, dtype, tp=tp)
        if qwen3_moe_layer_is_sparse(config, layer_id):
            self.mlp = SparseMoeBlock(config.hidden_size, int(config.num_experts), int(config.moe_intermediate_size),
                                      routing_config_from_hf(config), dtype, tp)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, dtype, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)


class Qwen3MoeModel(Qwen3Model):
    """Embedding, `Qwen3MoeDecoderLayer` stack and final norm (HF prefix ``model.``)."""

    decoder_layer_cls = Qwen3MoeDecoderLayer


class MoECausalLMMixin:
    """``load_weights`` for Llama-family models with `SparseMoeBlock` layers: expert tensors
    go to their `FusedMoE` (`route_expert_tensors`), everything else through the dense
    loader; missing expert tensors are named (`check_experts_complete`)."""

    #: name missing expert tensors w1/w3/w2 (Mixtral) rather than gate/up/down_proj
    mixtral_expert_names: bool = False

    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """As `LlamaForCausalLM.load_weights`, plus per-expert HF tensors.

        Raises:
            KeyError: a tensor that matches no parameter (or experts in a dense layer).
            ValueError: a shape mismatch, parameters left unset, or a missing expert tensor.
        """
        experts: Set[Tuple[str, int, str]] = set()
        loaded = super().load_weights(route_expert_tensors(self, weights, experts))  # type: ignore[misc]
        check_experts_complete(self, experts, self.mixtral_expert_names)  # type: ignore[arg-type]
        return loaded | {n for n, _ in self.named_parameters() if is_expert_param(n)}  # type: ignore[attr-defined]

    def _check_complete(self, params: Dict[str, nn.Parameter], loaded: Set[str]) -> None:
        dense = {n: p for n, p in params.items() if not is_expert_param(n)}
        super()._check_complete(dense, loaded)  # type: ignore[misc]


class Qwen3MoeForCausalLM(MoECausalLMMixin, Qwen3ForCausalLM):
    """Qwen3-MoE causal LM for the engine.

    Args:
        config: HF ``Qwen3MoeConfig``-like: the `Qwen3ForCausalLM` fields plus
            ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
            ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``.
        dtype: parameter dtype (uninitialised until loaded).
        tp: this rank's group; every expert's intermediate rows are split over its ranks.

    Raises:
        ValueError: a ``--tp-size`` that does not divide ``moe_intermediate_size``.
    """

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        nn.Module.__init__(self)
        self.config = config
        self.dtype = dtype
        self.tp = tp or TPGroup.single()
        self.model = Qwen3MoeModel(config, dtype, self.tp)
        self._init_lm_head(config, dtype, tie_default=False)


EntryClass = Qwen3MoeForCausalLM
