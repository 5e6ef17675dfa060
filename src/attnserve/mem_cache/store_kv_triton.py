"""Triton kernel behind `attnserve.mem_cache.store_kv` (import that module, not this one).

Imports ``triton`` at the top; `store_kv` imports it lazily so CPU-only installs without
Triton never load it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_heads_to_slot(src_ptr, tok, src_stride_t, src_stride_h, dst_ptr, slot, dst_stride_s, dst_stride_h,
                       heads, head_mask, head_dim, BLOCK_D: tl.constexpr):
    """Copy heads ``heads`` (int64 ``[BLOCK_H]``, ``head_mask`` valid) of token ``tok`` of
    ``src`` into row ``slot`` of the cache ``dst``, converting to ``dst``'s dtype through
    float32 (round-to-nearest-even, like ``Tensor.to``). Also used by the fused RoPE +
    KV-store kernel (`attnserve.models.layers.fused_kernels_triton`)."""
    d = tl.arange(0, BLOCK_D)
    m = head_mask[:, None] & (d < head_dim)[None, :]
    x = tl.load(src_ptr + tok * src_stride_t + heads[:, None] * src_stride_h + d[None, :], mask=m, other=0.0)
    tl.store(dst_ptr + slot * dst_stride_s + heads[:, None] * dst_stride_h + d[None, :],
             x.to(tl.float32).to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def quant_heads_to_slot(src_ptr, tok, src_stride_t, src_stride_h, dst_ptr, slot, dst_stride_s, dst_stride_h,
                        heads, head_mask, head_dim, inv_scale, max_val, BLOCK_D: tl.constexpr):
    """`copy_heads_to_slot` into an FP8 cache: ``clamp(x * inv_scale, -max_val, max_val)``
    in float32, then the cast (`attnserve.mem_cache.kv_quant.quantize_kv`)."""
    d = tl.arange(0, BLOCK_D)
    m = head_mask[:, None] & (d < head_dim)[None, :]
    x = tl.load(src_ptr + tok * src_stride_t + heads[:, None] * src_stride_h + d[None, :], mask=m, other=0.0)
    y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -max_val), max_val)
    tl.store(dst_ptr + slot * dst_stride_s + heads[:, None] * dst_stride_h + d[None, :],
             y.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _store_kv_kernel(
    loc_ptr,
    k_ptr,
    v_ptr,
    k_buf_ptr,
    v_buf_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    kb_stride_s,
    kb_stride_h,
    vb_stride_s,
    vb_stride_h,
    num_heads,
    head_dim_k,
    head_dim_v,
    k_inv_scale,
    v_inv_scale,
    max_val,
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: copy heads ``[hb*BLOCK_H, +BLOCK_H)`` of token t's K and
    V rows into row ``loc[t]`` of the K and V buffers, converting to the buffers' dtype
    (through float32, i.e. round-to-nearest-even like ``Tensor.to``)."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    heads = heads.to(tl.int64)
    slot = tl.load(loc_ptr + tok).to(tl.int64)

    if QUANT:  # FP8 cache: scaled and saturated
        quant_heads_to_slot(k_ptr, tok, k_stride_t, k_stride_h, k_buf_ptr, slot, kb_stride_s, kb_stride_h, heads,
                            head_mask, head_dim_k, k_inv_scale, max_val, BLOCK_DK)
        quant_heads_to_slot(v_ptr, tok, v_stride_t, v_stride_h, v_buf_ptr, slot, vb_stride_s, vb_stride_h, heads,
                            head_mask, head_dim_v, v_inv_scale, max_val, BLOCK_DV)
    else:
        copy_heads_to_slot(k_ptr, tok, k_stride_t, k_stride_h, k_buf_ptr, slot, kb_stride_s, kb_stride_h, heads,
                           head_mask, head_dim_k, BLOCK_DK)
        copy_heads_to_slot(v_ptr, tok, v_stride_t, v_stride_h, v_buf_ptr, slot, vb_stride_s, vb_stride_h, heads,
                           head_mask, head_dim_v, BLOCK_DV)
