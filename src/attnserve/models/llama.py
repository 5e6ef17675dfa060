"""Llama decoder (Touvron et al., arXiv:2302.13971; Llama 2/3 with grouped-query attention).

Also serves SmolLM2 and other checkpoints of HF architecture ``LlamaForCausalLM``.
Parameter names follow HF's, except that q/k/v are fused into ``qkv_proj`` and gate/up
into ``gate_up_proj`` (`CausalLM.load_weights` maps HF names onto the fused shards).
Attention itself is `RadixAttention`, computed by the step's attention backend. The body,
LM head, logits and loading are the shared ones of `attnserve.models.base`; the blocks
here (`LlamaAttention`, `LlamaMLP`, `LlamaDecoderLayer`) are reused by the Llama-like
families.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from attnserve.attention.radix_attention import RadixAttention
from attnserve.distributed.group import TPGroup
from attnserve.distributed.partition import kv_head_range, q_head_range
from attnserve.forward_batch import ForwardBatch
from attnserve.models.base import CausalLM, DecoderModel, attention_head_dim
from attnserve.models.layers.norm import RMSNorm
from attnserve.models.layers.parallel import ColumnParallelLinear, RowParallelLinear, even_parts
from attnserve.models.layers.rotary import RotaryEmbedding


def rope_then_attention(rotary_emb: RotaryEmbedding, attn: RadixAttention, positions: torch.Tensor,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
                        qk_norm: Optional[Tuple[RMSNorm, RMSNorm]] = None) -> torch.Tensor:
    """RoPE on ``q`` ``[T, Hq*D]`` / ``k`` ``[T, Hkv*D]``, then paged attention -> ``[T, Hq*Dv]``.

    Where the KV pool allows it (`RadixAttention.kv_store_target`), the rotation kernel also
    writes the new K (rotated) and V into the cache, one launch instead of two, and the
    backend is told not to store them again (``save_kv_cache=False``). ``qk_norm``
    ``(q_norm, k_norm)``: the per-head norms are applied in the same launch (only where
    ``rotary_emb.qk_norm_fusable(q, k)``; `attnserve.models.qwen3.Qwen3Attention`).
    """
    target = attn.kv_store_target(forward_batch, v)
    if qk_norm is not None:
        q_norm, k_norm = qk_norm
        q, k = rotary_emb.forward(positions, q, k, kv_store=target, q_norm_weight=q_norm.weight,
                                  k_norm_weight=k_norm.weight, eps=q_norm.variance_epsilon,
                                  weight_offset=q_norm.fused_weight_offset)
        return attn.forward(q, k, v, forward_batch, save_kv_cache=target is None)
    q, k = rotary_emb.forward(positions, q, k, kv_store=target)
    return attn.forward(q, k, v, forward_batch, save_kv_cache=target is None)


def parallel_qkv_o(config: Any, head_dim: int, bias: bool, dtype: torch.dtype, tp: TPGroup,
                   qkv_bias: Optional[bool] = None):
    """``(qkv_proj, o_proj, local q heads, local KV heads)`` of a GQA block under ``tp``:
    QKV column-parallel by heads (KV heads replicated when fewer than ranks), O row-parallel.
    ``bias`` is O's, and QKV's unless ``qkv_bias`` is given."""
    total_q = config.num_attention_heads
    q_rng = q_head_range(total_q, tp.size, tp.rank)
    kv_rng = kv_head_range(getattr(config, "num_key_value_heads", None) or total_q, tp.size, tp.rank)
    qkv = ColumnParallelLinear(config.hidden_size, [(q_rng, head_dim), (kv_rng, head_dim), (kv_rng, head_dim)],
                               bias=bias if qkv_bias is None else qkv_bias, dtype=dtype)
    o = RowParallelLinear([(q_rng, head_dim)], config.hidden_size, tp, bias=bias, dtype=dtype)
    return qkv, o, q_rng.count, kv_rng.count


class LlamaAttention(nn.Module):
    """Self-attention block: fused QKV projection, RoPE, paged attention, output projection.

    Under tensor parallelism (``tp``) the block holds this rank's heads
    (``num_heads`` / ``num_kv_heads`` are the local counts) and its output is all-reduced.

    ``scaling`` (default ``head_dim ** -0.5``), ``logit_cap`` and ``sliding_window_size``
    go to `RadixAttention`. The projections are biased by ``config.attention_bias``; a
    variant sets ``qkv_bias`` to fix the q/k/v bias alone (Qwen2: q/k/v biased, o not).

    Shapes: ``positions`` int64 ``[T]``, ``hidden_states`` ``[T, hidden]`` -> ``[T, hidden]``.
    """

    qkv_bias: Optional[bool] = None
    #: the row-parallel layer whose output ``forward`` returns unchanged (its all-reduce may
    #: move into the next norm: `allreduce_fusion`); a subclass whose ``forward`` changes
    #: that output sets None
    output_projection: Optional[str] = "o_proj"

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window_size: int = -1, tp: Optional[TPGroup] = None, scaling: Optional[float] = None,
                 logit_cap: float = 0.0):
        super().__init__()
        tp = tp or TPGroup.single()
        self.head_dim = attention_head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj, self.o_proj, self.num_heads, self.num_kv_heads = parallel_qkv_o(
            config, self.head_dim, bias, dtype, tp, self.qkv_bias)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if scaling is None else scaling,
            num_kv_heads=self.num_kv_heads,
            layer_id=layer_id,
            logit_cap=logit_cap,
            sliding_window_size=sliding_window_size,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj.forward(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj.forward(rope_then_attention(self.rotary_emb, self.attn, positions, q, k, v, forward_batch))


def parallel_gate_up_down(hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                          tp: TPGroup):
    """``(gate_up_proj, down_proj)`` of a gated MLP under ``tp``: gate|up column-parallel
    (each rank's rows of both halves), down row-parallel."""
    parts = even_parts(intermediate_size, tp)
    gate_up = ColumnParallelLinear(hidden_size, parts * 2, bias=bias, dtype=dtype)
    down = RowParallelLinear(parts, hidden_size, tp, bias=bias, dtype=dtype)
    return gate_up, down


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with fused ``gate_up_proj``
    (this rank's intermediate rows under ``tp``; the output is all-reduced)."""

    #: as `LlamaAttention.output_projection`
    output_projection: Optional[str] = "down_proj"

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        super().__init__()
        self.gate_up_proj, self.down_proj = parallel_gate_up_down(hidden_size, intermediate_size, bias, dtype,
                                                                  tp or TPGroup.single())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up projection and SiLU-and-mul: one kernel for decode-sized CUDA batches
        return self.down_proj.forward(self.gate_up_proj.forward_gated(x, "silu"))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block; carries the residual stream separately (see `RMSNorm`).

    Variants override `_make_attention` / `_make_mlp` (the norms and ``forward`` stay), or
    build ``self_attn``, ``mlp``, ``input_layernorm`` and ``post_attention_layernorm``
    themselves.

    Under tensor parallelism `allreduce_fusion.link_allreduce_fusion` may set
    ``attn_output_partial`` (``o_proj`` returns partial sums; ``post_attention_layernorm``
    sums them), ``mlp_output_partial`` (the returned block output is partial) and
    ``input_partial`` (the incoming one is: ``input_layernorm`` sums it), with ``fusion_tp``.
    """

    attn_output_partial = False
    mlp_output_partial = False
    input_partial = False
    fusion_tp: Optional[TPGroup] = None

    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 tp: Optional[TPGroup] = None):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = self._make_attention(config, layer_id, rotary_emb, dtype, tp)
        self.mlp = self._make_mlp(config, layer_id, dtype, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)

    def _make_attention(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                        tp: Optional[TPGroup]) -> nn.Module:
        return LlamaAttention(config, layer_id, rotary_emb, dtype, tp=tp)

    def _make_mlp(self, config: Any, layer_id: int, dtype: torch.dtype, tp: Optional[TPGroup]) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), dtype,
                        tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(block output, residual stream)``, both ``[T, hidden]``; their sum is the
        layer's output in HF's formulation."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        elif self.input_partial:
            hidden_states, residual = self.input_layernorm.forward_all_reduce(hidden_states, residual,
                                                                              self.fusion_tp)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        hidden_states = self.self_attn.forward(positions, hidden_states, forward_batch)
        if self.attn_output_partial:
            hidden_states, residual = self.post_attention_layernorm.forward_all_reduce(hidden_states, residual,
                                                                                       self.fusion_tp)
        else:
            hidden_states, residual = self.post_attention_layernorm.forward(hidden_states, residual)
        return self.mlp.forward(hidden_states), residual


class LlamaModel(DecoderModel):
    """Embedding, decoder layers and final norm (HF prefix ``model.``), one RoPE table
    shared by every layer. Subclasses change the block by setting ``decoder_layer_cls``."""

    decoder_layer_cls: Any = LlamaDecoderLayer


class LlamaForCausalLM(CausalLM):
    """Llama causal LM for the engine (`CausalLM` around a `LlamaModel`).

    Args:
        config: HF ``LlamaConfig``-like object: ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` (default ``hidden_size // num_attention_heads``), ``rms_norm_eps``,
            ``rope_parameters`` or ``rope_theta``/``rope_scaling``,
            ``max_position_embeddings`` (RoPE table length), ``vocab_size``,
            ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``.
        dtype: parameter dtype (see `CausalLM`).
        tp: this rank's `TPGroup` (see `CausalLM`).

    The KV cache holds ``num_key_value_heads`` heads of ``head_dim`` per layer (this rank's
    heads under ``tp``).
    """

    model_cls = LlamaModel


EntryClass = LlamaForCausalLM
