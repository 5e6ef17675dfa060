"""Qwen3 dense decoder (Qwen Team, "Qwen3 Technical Report", arXiv:2505.09388).

Serves HF architecture ``Qwen3ForCausalLM`` (``model_type`` ``qwen3``). It is the Llama
block (`attnserve.models.llama`: pre-norm, grouped-query attention, SwiGLU, RoPE) plus
QK-norm: an RMSNorm over each query and key head (weights ``[head_dim]``, shared by the
heads) applied after the projections and before RoPE, with no q/k/v bias (Qwen2 had one)
and ``head_dim`` taken from the config (128 in the released models, not
``hidden_size / num_attention_heads``). Layers whose ``config.layer_types`` entry is
``sliding_attention`` (only with ``use_sliding_window``) attend to the last
``sliding_window`` tokens (``RadixAttention(sliding_window_size=sliding_window - 1)``).

Weights use HF names, q/k/v and gate/up fused as in Llama, whose ``load_weights``,
``forward`` and ``compute_logits`` are reused.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.forward_batch import ForwardBatch
from attnserve.models.layers.norm import RMSNorm
from attnserve.models.layers.rotary import RotaryEmbedding
from attnserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    rope_then_attention,
)


def _window(config: Any, layer_id: int) -> int:
    """`RadixAttention` window of one layer: ``sliding_window - 1`` or -1 (full)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", False) is False or not types:
        return -1
    return int(window) - 1 if types[layer_id] == "sliding_attention" else -1


class Qwen3Attention(LlamaAttention):
    """Fused QKV projection, per-head q/k RMSNorm, RoPE, paged attention, output projection.

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``;
    q is ``[T, Hq * head_dim]``, k and v ``[T, Hkv * head_dim]``.
    """

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        super().__init__(config, layer_id, rotary_emb, dtype, sliding_window_size=_window(config, layer_id), tp=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(-1, self.kv_size)
        return self.o_proj(rope_then_attention(self.rotary_emb, self.attn, positions, q, k, v, forward_batch))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with `Qwen3Attention` (``forward`` is Llama's)."""

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        nn.Module.__init__(self)  # not LlamaDecoderLayer.__init__: it would build a LlamaAttention
        eps = config.rms_norm_eps
        self.self_attn = Qwen3Attention(config, layer_id, rotary_emb, dtype, tp=tp)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, dtype, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)


class Qwen3Model(LlamaModel):
    """Embedding, `Qwen3DecoderLayer` stack and final norm (HF prefix ``model.``)."""

    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM for the engine.

    Args:
        config: HF ``Qwen3Config``-like object: the `LlamaForCausalLM` fields plus
            ``head_dim`` (required in practice: 128 for Qwen3-0.6B whose hidden is 1024 with
            16 heads), ``use_sliding_window`` / ``sliding_window`` / ``layer_types``.
        dtype: parameter dtype (parameters uninitialised until loaded; norms are ones).

    The KV cache holds ``num_key_value_heads`` heads of ``head_dim`` per layer.
    """

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: Optional[TPGroup] = None):
        nn.Module.__init__(self)  # LlamaForCausalLM.__init__ would build a Llama body
        self.config = config
        self.dtype = dtype
        self.tp = tp or TPGroup.single()
        self.model = Qwen3Model(config, dtype, self.tp)
        self._init_lm_head(config, dtype, tie_default=False)

    @staticmethod
    def _param(params: Dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"checkpoint tensor {source!r} matches no parameter of Qwen3ForCausalLM")
        return params[target]


EntryClass = Qwen3ForCausalLM
