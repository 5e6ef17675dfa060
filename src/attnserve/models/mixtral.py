"""Mixtral sparse mixture-of-experts decoder (Jiang et al., "Mixtral of Experts",
arXiv:2401.04088).

Serves HF architecture ``MixtralForCausalLM`` (``model_type`` ``mixtral``; Mixtral-8x7B:
32 layers, 8 experts of intermediate size 14336, 2 chosen per token). Attention is
Llama's (grouped-query, RoPE, no bias), over the last ``sliding_window`` tokens when the
config sets one (``RadixAttention(sliding_window_size=sliding_window - 1)``, as for Qwen3).
Every layer's feed-forward is a `SparseMoeBlock`: softmax over the router logits, top-2,
the two weights renormalised to sum to one (HF ``MixtralTopKRouter``).

HF names: ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.{e}.w1|w3|w2.weight``
(w1 = gate, w3 = up, w2 = down); the block is held here as ``mlp`` (`LlamaDecoderLayer`'s
attribute) and the names are mapped on load.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.models.layers.moe.routing import routing_config_from_hf
from attnserve.models.layers.moe.sparse_block import SparseMoeBlock
from attnserve.models.layers.rotary import RotaryEmbedding
from attnserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def _window(config: Any) -> int:
    window = getattr(config, "sliding_window", None)
    return int(window) - 1 if window else -1


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Pre-norm block: `LlamaAttention` (optionally windowed) then a `SparseMoeBlock`."""

    def _make_attention(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                        tp: Optional[TPGroup]) -> nn.Module:
        return LlamaAttention(config, layer_id, rotary_emb, dtype, sliding_window_size=_window(config), tp=tp)

    def _make_mlp(self, config: Any, layer_id: int, dtype: torch.dtype, tp: Optional[TPGroup]) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, int(config.num_local_experts), int(config.intermediate_size),
                              routing_config_from_hf(config), dtype, tp)


class MixtralModel(LlamaModel):
    """Embedding, `MixtralDecoderLayer` stack and final norm (HF prefix ``model.``)."""

    decoder_layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM for the engine.

    Args:
        config: HF ``MixtralConfig``-like: the `LlamaForCausalLM` fields plus
            ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` (each
            expert's) and ``sliding_window`` (None: full attention).
        dtype: parameter dtype (uninitialised until loaded).
        tp: this rank's group; every expert's intermediate rows are split over its ranks.

    Raises:
        ValueError: a ``--tp-size`` that does not divide ``intermediate_size``.
    """

    model_cls = MixtralModel
    #: HF Mixtral names the block ``block_sparse_moe``; it is held here as ``mlp``
    weight_name_replacements = ((".block_sparse_moe.", ".mlp."),)
    mixtral_expert_names = True


EntryClass = MixtralForCausalLM
