"""Mistral decoder (Jiang et al., "Mistral 7B", arXiv:2310.06825).

Serves HF architecture ``MistralForCausalLM`` (``model_type`` ``mistral``): Mistral-7B
v0.1-v0.3, Mistral-Nemo (``head_dim`` 128 with hidden 5120 / 32 heads) and other checkpoints
of that architecture. The block is Llama's (`attnserve.models.llama`: pre-norm RMSNorm,
grouped-query attention, SwiGLU, RoPE, no biases); the one difference is the optional
sliding window: with ``config.sliding_window`` set (4096 in v0.1, null from v0.2 on) every
layer attends to the last ``sliding_window`` tokens including itself, HF's mask
``q - sliding_window < k <= q``, i.e. ``RadixAttention(sliding_window_size=sliding_window - 1)``.
HF's Mistral applies the window to every layer even when a config lists ``layer_types``
(it warns and points to Ministral), and so does this class.

Weights use HF names, q/k/v and gate/up fused as in Llama; the body, LM head and loading are
`attnserve.models.base`'s. Mistral GGUF files are llama.cpp ``llama`` files (q/k rows
permuted for RoPE; `attnserve.model_loader.gguf`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.models.layers.rotary import RotaryEmbedding
from attnserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


def mistral_window(config: Any) -> int:
    """`RadixAttention` window of every layer: ``sliding_window - 1``, or -1 (full) when the
    config has none (None or 0)."""
    window = getattr(config, "sliding_window", None)
    return int(window) - 1 if window else -1


def require_silu(config: Any, family: str) -> None:
    """Refuse a config whose MLP activation is not SiLU (the fused gate/up kernels compute
    SwiGLU only).

    Raises:
        ValueError: ``hidden_act`` set to anything but ``"silu"``, naming it.
    """
    act = getattr(config, "hidden_act", None) or "silu"
    if act != "silu":
        raise ValueError(f"{family}: hidden_act={act!r} is not supported (only 'silu')")


class MistralDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block whose attention is windowed by ``config.sliding_window``
    (`mistral_window`), with a bias-free MLP."""

    def _make_attention(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                        tp: Optional[TPGroup]) -> nn.Module:
        return LlamaAttention(config, layer_id, rotary_emb, dtype, sliding_window_size=mistral_window(config), tp=tp)

    def _make_mlp(self, config: Any, layer_id: int, dtype: torch.dtype, tp: Optional[TPGroup]) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, False, dtype, tp)


class MistralModel(LlamaModel):
    """Embedding, `MistralDecoderLayer` stack and final norm (HF prefix ``model.``)."""

    decoder_layer_cls = MistralDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM for the engine.

    Args:
        config: HF ``MistralConfig``-like object: the `LlamaForCausalLM` fields plus
            ``sliding_window`` (tokens; None or 0: full attention) and ``head_dim``
            (default ``hidden_size // num_attention_heads``).
        dtype: parameter dtype (parameters uninitialised until loaded; norms are ones).
        tp: this rank's group (heads and MLP rows split as in Llama).

    Raises:
        ValueError: ``hidden_act`` other than ``silu``; a rope scaling `get_rope` does not
            implement (named in the message).
    """

    model_cls = MistralModel

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        require_silu(config, "Mistral")
        super().__init__(config, dtype, tp)


EntryClass = MistralForCausalLM
