"""Gemma 2 decoder (Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size",
arXiv:2408.00118).

Serves HF architecture ``Gemma2ForCausalLM`` (``model_type`` ``gemma2``). Built from Gemma 3's
pieces (`attnserve.models.gemma3`): the ``x * (1 + w)`` RMSNorms, four per block (before and
after attention, before and after the feed-forward), the GeGLU feed-forward, the embedding
scaled by ``sqrt(hidden_size)`` rounded to the model dtype, tied output embeddings and the
final-logit soft-cap ``c * tanh(logits / c)`` (``final_logit_softcapping``, 30 in the
releases). What differs from Gemma 3:

* attention-logit soft-capping: scores ``s = q.k * query_pre_attn_scalar ** -0.5`` become
  ``cap * tanh(s / cap)`` before the softmax (``attn_logit_softcapping``, 50 in the
  releases), done by the attention backends through `RadixAttention`'s ``logit_cap``;
* no QK-norm, and one RoPE table (``rope_theta``, 1e4) for every layer;
* local and global layers in turn: ``config.layer_types``, or for configs without it layer
  ``i`` local iff ``i`` is even (transformers' ``Gemma2Config`` default; llama.cpp's swa
  pattern 2); local layers see the last ``sliding_window`` (4096) tokens including
  themselves (``RadixAttention(sliding_window_size=sliding_window - 1)``).

Weights use HF names, q/k/v and gate/up fused as in Llama; the body, LM head and loading are
`attnserve.models.base`'s.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.models.base import attention_head_dim
from attnserve.models.gemma3 import FULL, SLIDING, Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3TextModel
from attnserve.models.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from attnserve.models.llama import LlamaAttention


def gemma2_layer_types(config: Any) -> List[str]:
    """``"sliding_attention"`` / ``"full_attention"`` per layer: ``config.layer_types`` when
    present, else local on even layers (0, 2, ...) and global on odd ones.

    Raises:
        ValueError: ``layer_types`` of the wrong length.
    """
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != n:
            raise ValueError(f"config.layer_types has {len(types)} entries for {n} layers")
        return list(types)
    return [SLIDING if i % 2 == 0 else FULL for i in range(n)]


class Gemma2Attention(LlamaAttention):
    """Grouped-query attention with Gemma 2's softmax scale (``query_pre_attn_scalar ** -0.5``),
    attention-logit soft-cap and, on local layers, the sliding window; ``forward`` is
    Llama's (fused QKV, RoPE, `RadixAttention`, output projection).

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``.
    """

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        window = int(config.sliding_window) - 1 if layer_type == SLIDING and config.sliding_window else -1
        scalar = getattr(config, "query_pre_attn_scalar", None) or attention_head_dim(config)
        super().__init__(config, layer_id, rotary_emb, dtype, sliding_window_size=window, tp=tp,
                         scaling=float(scalar) ** -0.5,
                         logit_cap=float(getattr(config, "attn_logit_softcapping", None) or 0.0))


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's four-norm block and GeGLU feed-forward with `Gemma2Attention`."""

    attention_cls = Gemma2Attention


class Gemma2Model(Gemma3TextModel):
    """Scaled embedding, `Gemma2DecoderLayer` stack and final norm (HF prefix ``model.``), one
    RoPE table (``self.rotary_emb``) for both layer types."""

    decoder_layer_cls = Gemma2DecoderLayer

    def _init_rope(self, config: Any, dtype: torch.dtype) -> None:
        self.layer_types = gemma2_layer_types(config)
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        self.rotary_emb = get_rope(attention_head_dim(config), int(getattr(config, "max_position_embeddings", 8192)),
                                   rope_parameters_from_config(config))

    def _make_layer(self, config: Any, layer_id: int, dtype: torch.dtype, tp: TPGroup) -> nn.Module:
        return self.decoder_layer_cls(config, layer_id, self.layer_types[layer_id], self.rotary_emb, dtype, tp)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 causal LM for the engine.

    Args:
        config: HF ``Gemma2Config``-like object: ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``, ``rms_norm_eps``, ``sliding_window``, ``layer_types``,
            ``rope_theta``, ``query_pre_attn_scalar``, ``attn_logit_softcapping``,
            ``final_logit_softcapping``, ``hidden_activation``, ``attention_bias``,
            ``max_position_embeddings``, ``vocab_size``, ``tie_word_embeddings``.
        dtype: parameter dtype (uninitialised until loaded; ``dummy_norm_fill`` = 0 as for
            Gemma 3's ``1 + w`` norms).
        tp: this rank's group (heads and MLP rows split as in Llama).

    Raises:
        ValueError: a bidirectional-attention config (not a causal LM), an unsupported
            activation or rope type (named in the message).
    """

    model_cls = Gemma2Model
    family = "Gemma 2"
    ignores_attn_logit_softcapping = False


EntryClass = Gemma2ForCausalLM
