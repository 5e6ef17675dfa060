"""Qwen2 / Qwen2.5 decoder (Qwen Team, "Qwen2 Technical Report", arXiv:2407.10671; Qwen2.5,
arXiv:2412.15115).

Serves HF architecture ``Qwen2ForCausalLM`` (``model_type`` ``qwen2``). It is the Llama block
(`attnserve.models.llama`: pre-norm RMSNorm, grouped-query attention, SwiGLU, RoPE) with:

* a bias on the q, k and v projections (none on o): held as the bias of the fused
  ``qkv_proj`` (this rank's heads of each part under tensor parallelism, as the weight rows);
* tied input/output embeddings in the small sizes (Qwen2.5-0.5B/1.5B/3B:
  ``tie_word_embeddings``; 7B and up have an ``lm_head``);
* an optional sliding window as HF defines it: only with ``use_sliding_window``, on the
  layers ``config.layer_types`` marks ``sliding_attention`` -- transformers builds that list
  as the layers ``i >= max_window_layers`` -- each attending to the last ``sliding_window``
  tokens including itself (``RadixAttention(sliding_window_size=sliding_window - 1)``).
  The released checkpoints leave ``use_sliding_window`` false.

RoPE scaling (``rope_scaling``, e.g. YaRN in the long-context Qwen2.5 configs) goes through
`get_rope`, which refuses a type it does not implement. Weights use HF names; q/k/v (weights
and biases) and gate/up are fused as in Llama; the body, LM head and loading are
`attnserve.models.base`'s.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.models.layers.rotary import RotaryEmbedding
from attnserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from attnserve.models.mistral import require_silu


def qwen2_window(config: Any, layer_id: int) -> int:
    """`RadixAttention` window of one layer: ``sliding_window - 1`` on a sliding layer, else -1.

    A layer slides only when ``use_sliding_window`` is true and ``sliding_window`` is set;
    which layers is ``config.layer_types`` when present, else (configs not built by
    transformers >= 5) the layers ``layer_id >= max_window_layers`` (transformers'
    ``Qwen2Config`` rule).
    """
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", False) or not window:
        return -1
    types = getattr(config, "layer_types", None)
    if types:
        sliding = types[layer_id] == "sliding_attention"
    else:
        sliding = layer_id >= int(getattr(config, "max_window_layers", 0) or 0)
    return int(window) - 1 if sliding else -1


class Qwen2Attention(LlamaAttention):
    """Llama's attention with a biased fused ``qkv_proj`` (``[q | k | v]`` rows and bias, this
    rank's heads of each) and an unbiased ``o_proj`` (HF ``Qwen2Attention``)."""

    qkv_bias = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with `Qwen2Attention` (windowed by `qwen2_window`) and a
    bias-free MLP."""

    def _make_attention(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                        tp: Optional[TPGroup]) -> nn.Module:
        return Qwen2Attention(config, layer_id, rotary_emb, dtype, sliding_window_size=qwen2_window(config, layer_id),
                              tp=tp)

    def _make_mlp(self, config: Any, layer_id: int, dtype: torch.dtype, tp: Optional[TPGroup]) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, False, dtype, tp)


class Qwen2Model(LlamaModel):
    """Embedding, `Qwen2DecoderLayer` stack and final norm (HF prefix ``model.``)."""

    decoder_layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM for the engine.

    Args:
        config: HF ``Qwen2Config``-like object: the `LlamaForCausalLM` fields plus
            ``use_sliding_window`` / ``sliding_window`` / ``max_window_layers`` /
            ``layer_types`` and ``tie_word_embeddings``.
        dtype: parameter dtype (parameters uninitialised until loaded; norms are ones).
        tp: this rank's group (heads, their q/k/v bias and MLP rows split as in Llama).

    Raises:
        ValueError: ``hidden_act`` other than ``silu``; a rope scaling `get_rope` does not
            implement (named in the message).
    """

    model_cls = Qwen2Model

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        require_silu(config, "Qwen2")
        super().__init__(config, dtype, tp)


EntryClass = Qwen2ForCausalLM
