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

Weights use HF names; q/k/v and gate/up are fused as in Llama (`LlamaForCausalLM`'s
``load_weights`` is reused).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from attnserve.attention.radix_attention import RadixAttention
from attnserve.distributed.group import TPGroup
from attnserve.models.gemma3 import FULL, SLIDING, Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3MLP, Gemma3TextModel
from attnserve.models.layers.norm import GemmaRMSNorm
from attnserve.models.layers.parallel import VocabParallelEmbedding
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
        super().__init__(config, layer_id, rotary_emb, dtype, sliding_window_size=window, tp=tp)
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            float(scalar) ** -0.5,
            num_kv_heads=self.num_kv_heads,
            layer_id=layer_id,
            logit_cap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            sliding_window_size=window,
        )


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's four-norm block (``forward`` is Gemma 3's) with `Gemma2Attention`."""

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        nn.Module.__init__(self)  # not Gemma3DecoderLayer.__init__: its attention has QK-norm and no cap
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.layer_type = layer_type
        self.self_attn = Gemma2Attention(config, layer_id, layer_type, rotary_emb, dtype, tp)
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        self.mlp = Gemma3MLP(hidden, config.intermediate_size, activation or "gelu_pytorch_tanh", dtype, tp)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype)


class Gemma2Model(Gemma3TextModel):
    """Scaled embedding, `Gemma2DecoderLayer` stack (one RoPE table) and final norm (HF prefix
    ``model.``); ``forward`` is Gemma 3's."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: Optional[TPGroup] = None):
        nn.Module.__init__(self)  # not Gemma3TextModel.__init__: two RoPE tables, Gemma 3 layers
        tp = tp or TPGroup.single()
        self.config = config
        self.layer_types = gemma2_layer_types(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype=dtype)
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = get_rope(head_dim, int(getattr(config, "max_position_embeddings", 8192)),
                                   rope_parameters_from_config(config))
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, i, t, self.rotary_emb, dtype, tp) for i, t in enumerate(self.layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


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

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        nn.Module.__init__(self)  # Gemma3ForCausalLM.__init__ would build a Gemma 3 body
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 2 with use_bidirectional_attention is not a causal LM; not supported")
        self.config = config
        self.dtype = dtype
        self.tp = tp or TPGroup.single()
        self.model = Gemma2Model(config, dtype, self.tp)
        self._init_lm_head(config, dtype, tie_default=True)
        self.final_logit_softcapping = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    @staticmethod
    def _param(params: Dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"checkpoint tensor {source!r} matches no parameter of Gemma2ForCausalLM")
        return params[target]


EntryClass = Gemma2ForCausalLM
