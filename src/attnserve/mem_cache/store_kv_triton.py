"""Triton kernel behind `attnserve.mem_cache.store_kv` (import that module, not this one).

Imports ``triton`` at the top; `store_kv` imports it lazily so CPU-only installs without
Triton never load it.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: copy heads ``[hb*BLOCK_H, +BLOCK_H)`` of token t's K and
    V rows into row ``loc[t]`` of the K and V buffers, converting to the buffers' dtype
    (through float32, i.e. round-to-nearest-even like ``Tensor.to``)."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    heads = heads.to(tl.int64)
    slot = tl.load(loc_ptr + tok).to(tl.int64)

    dk = tl.arange(0, BLOCK_DK)
    mk = head_mask[:, None] & (dk < head_dim_k)[None, :]
    kv = tl.load(k_ptr + tok * k_stride_t + heads[:, None] * k_stride_h + dk[None, :], mask=mk, other=0.0)
    kv = kv.to(tl.float32).to(k_buf_ptr.dtype.element_ty)
    tl.store(k_buf_ptr + slot * kb_stride_s + heads[:, None] * kb_stride_h + dk[None, :], kv, mask=mk)

    dv = tl.arange(0, BLOCK_DV)
    mv = head_mask[:, None] & (dv < head_dim_v)[None, :]
    vv = tl.load(v_ptr + tok * v_stride_t + heads[:, None] * v_stride_h + dv[None, :], mask=mv, other=0.0)
    vv = vv.to(tl.float32).to(v_buf_ptr.dtype.element_ty)
    tl.store(v_buf_ptr + slot * vb_stride_s + heads[:, None] * vb_stride_h + dv[None, :], vv, mask=mv)
