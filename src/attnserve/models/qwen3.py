"""Qwen3 dense decoder (Qwen Team, "Qwen3 Technical Report", arXiv:2505.09388).

Serves HF architecture ``Qwen3ForCausalLM`` (``model_type`` ``qwen3``). It is the Llama
block (`attnserve.models.llama`: pre-norm, grouped-query attention, SwiGLU, RoPE) plus
QK-norm: an RMSNorm over each query and key head (weights ``[head_dim]``, shared by the
heads) applied after the projections and before RoPE, with no q/k/v bias (Qwen2 had one)
and ``head_dim`` taken from the config (128 in the released models, not
``hidden_size / num_attention_heads``). Layers whose ``config.layer_types`` entry is
``sliding_attention`` (only with ``use_sliding_window``) attend to the last
``sliding_window`` tokens (``RadixAttention(sliding_window_size=sliding_window - 1)``).

Weights use HF names, q/k/v and gate/up fused as in Llama; the body, LM head and loading
are `attnserve.models.base`'s.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.env_options import env_flag
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


def qk_norm_rope_fusion_enabled() -> bool:
    """``ATTNSERVE_QK_NORM_ROPE_FUSION`` (default on; ``0`` / ``false`` / ``no`` / ``off``
    turns it off): whether QK-normed attention blocks built from now on fold their per-head
    q/k RMSNorm into the RoPE launch (read when a block is built)."""
    return env_flag("ATTNSERVE_QK_NORM_ROPE_FUSION")


def qk_norms_fusable(q_norm: nn.Module, k_norm: nn.Module) -> bool:
    """Whether two per-head norm modules can run inside the RoPE kernel: both `RMSNorm`s of
    the ``x_hat * (w + offset)`` form (``fused_weight_offset`` not None) with the same offset
    and epsilon (the kernel takes one of each)."""
    return (isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm)
            and q_norm.fused_weight_offset is not None
            and q_norm.fused_weight_offset == k_norm.fused_weight_offset
            and q_norm.variance_epsilon == k_norm.variance_epsilon)


def _fp8_kv_pool(forward_batch: Optional[ForwardBatch]) -> bool:
    """Whether the step's KV pool stores one byte per element (an FP8 cache)."""
    dtype = getattr(getattr(forward_batch, "token_to_kv_pool", None), "dtype", None)
    return dtype is not None and dtype.itemsize == 1


class Qwen3Attention(LlamaAttention):
    """Fused QKV projection, per-head q/k norm (``qk_norm_cls``), RoPE, paged attention,
    output projection.

    On the fused CUDA path the q/k norms run inside the RoPE (+ KV store) launch
    (`qk_norm_in_rope`; bit-identical to norm-then-rope, ``ATTNSERVE_QK_NORM_ROPE_FUSION=0``
    turns it off); otherwise the norm modules run first, then the rotation.

    ``sliding_window_size`` None: Qwen3's per-layer window (`_window`); ``scaling`` and
    ``logit_cap`` as in `LlamaAttention`.

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``;
    q is ``[T, Hq * head_dim]``, k and v ``[T, Hkv * head_dim]``.
    """

    qk_norm_cls: Any = RMSNorm

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None, sliding_window_size: Optional[int] = None,
                 scaling: Optional[float] = None, logit_cap: float = 0.0):
        window = _window(config, layer_id) if sliding_window_size is None else sliding_window_size
        super().__init__(config, layer_id, rotary_emb, dtype, sliding_window_size=window, tp=tp, scaling=scaling,
                         logit_cap=logit_cap)
        self.q_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.qk_norm_rope_fusion = qk_norm_rope_fusion_enabled() and qk_norms_fusable(self.q_norm, self.k_norm)

    def qk_norm_in_rope(self, q: torch.Tensor, k: torch.Tensor, forward_batch: Optional[ForwardBatch]) -> bool:
        """Whether this step's q/k norms run inside the RoPE launch: the fusion is on
        (`qk_norm_rope_fusion`), both norms and the rotation take their fused paths, the
        rotation kernel takes these views (`RotaryEmbedding.qk_norm_fusable`), and the KV
        pool is not FP8: the fused variant with the FP8 store differed from norm-then-rope in
        ~0.02% of q / k values on an H100 (rounding order; tests/gpu/test_fused_kernels_gpu.py),
        so FP8 caches keep the separate norms and the result of the separate kernels."""
        return (self.qk_norm_rope_fusion and self.q_norm.use_fused and self.k_norm.use_fused
                and self.rotary_emb.qk_norm_fusable(q, k) and not _fp8_kv_pool(forward_batch))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.forward(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_in_rope(q, k, forward_batch):  # norm + rotate (+ KV store) in one launch, q and k in place
            return self.o_proj.forward(rope_then_attention(self.rotary_emb, self.attn, positions, q, k, v,
                                                           forward_batch, qk_norm=(self.q_norm, self.k_norm)))
        q = self.q_norm.forward(q.reshape(-1, self.num_heads, self.head_dim)).reshape(-1, self.q_size)
        k = self.k_norm.forward(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(-1, self.kv_size)
        return self.o_proj.forward(rope_then_attention(self.rotary_emb, self.attn, positions, q, k, v, forward_batch))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with `Qwen3Attention` and a bias-free MLP."""

    def _make_attention(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                        tp: Optional[TPGroup]) -> nn.Module:
        return Qwen3Attention(config, layer_id, rotary_emb, dtype, tp=tp)

    def _make_mlp(self, config: Any, layer_id: int, dtype: torch.dtype, tp: Optional[TPGroup]) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, False, dtype, tp)


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

    model_cls = Qwen3Model


EntryClass = Qwen3ForCausalLM
