"""Key-tile loops of the extend kernel (`extend_attention._extend_fwd_kernel`).

`_attn_run` walks one run of key tiles (masked or not) with the online softmax of
FlashAttention-2 (Dao, arXiv:2307.08691); `_runs` splits a stage into its masked and
unmasked runs. `_attn_run_desc` is the opt-in form of the unmasked new-token run chosen by
``ExtendConfig.kv_desc`` ("k", "v" or "kv": ``K_DESC`` / ``V_DESC``): those tiles are read
through host-built TMA tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``
over ``[T, Hkv * D]``) instead of a ``BLOCK_N x D`` tensor of pointers, which drops the
per-element 64-bit address arithmetic and its registers from the compute-bound loop
(Hopper's TMA; the Triton fused-attention tutorial reads K/V this way on Hopper). It computes
every tile with `_attn_run`'s operations in the same order (same bits). Only unmasked runs
use it: every row they read belongs to the request.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.triton_jit import tanh


@triton.jit
def _load_tile(ptrs, row_mask, col_mask, ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr, TO_FP32: tl.constexpr):
    if ROW_MASK:
        if COL_MASK:
            x = tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        if COL_MASK:
            x = tl.load(ptrs, mask=col_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    if TO_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _attn_run(
    acc, l_i, m_i,
    q, q_pe,
    lo, hi, n_keys,
    k_ptr, v_ptr, stride_kt, stride_vt, idx_ptr,
    q_pos, key_pos0, mask_base, mask_rows, row_valid,
    qk_scale, sm_scale, logit_cap, window,
    offs_d, offs_dpe, offs_dv,
    GATHER: tl.constexpr,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    EVEN_DK: tl.constexpr,
    EVEN_DPE: tl.constexpr,
    EVEN_DV: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online-softmax update over key tiles ``[lo, hi)`` (``lo`` a multiple of BLOCK_N) of
    one stage. Unmasked runs (MASKED=False) must only cover full, fully visible tiles.
    K/V tiles are converted to q's dtype (fp8 caches; a no-op otherwise); ``qk_scale`` /
    ``sm_scale`` are the stage's (prefix runs: including K's dequantisation scale)."""
    mask_d = offs_d < DK
    mask_dv = offs_dv < DV
    if BLOCK_DPE > 0:
        mask_dpe = offs_dpe < DK
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid_n = offs_n < n_keys
        if GATHER:
            if MASKED:
                rows = tl.load(idx_ptr + offs_n, mask=valid_n, other=0).to(tl.int64)
            else:
                rows = tl.load(idx_ptr + offs_n).to(tl.int64)
        else:  # new tokens: int32 offsets from the request's first row (base already int64)
            rows = offs_n
        k = _load_tile(k_ptr + rows[:, None] * stride_kt + offs_d[None, :], valid_n, mask_d, MASKED, not EVEN_DK, COMPUTE_FP32)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
        if BLOCK_DPE > 0:
            k_pe = _load_tile(k_ptr + rows[:, None] * stride_kt + offs_dpe[None, :], valid_n, mask_dpe, MASKED, not EVEN_DPE, COMPUTE_FP32)
            qk += tl.dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), input_precision=DOT_PREC)
        if HAS_CAP:  # capped scores, already in log2 units
            qk = logit_cap * tanh(qk * (sm_scale / logit_cap)) * 1.4426950408889634
        if MASKED:
            k_pos = key_pos0 + offs_n
            vis = valid_n[None, :]
            if HAS_MASK:
                in_rows = row_valid[:, None] & vis
                cm = tl.load(mask_base + (mask_rows[:, None] + k_pos[None, :]), mask=in_rows, other=0)
                vis = in_rows & (cm != 0)
            elif IS_CAUSAL:
                vis = vis & (k_pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                vis = vis & (k_pos[None, :] >= q_pos[:, None] - window)
            qk = tl.where(vis, qk, float("-inf"))
        # m_i starts at a finite -1e30, so a fully masked row keeps alpha = 1, p = 0.
        if HAS_CAP:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
        else:  # scale folded into the exponent (one FMA per score)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptr + rows[:, None] * stride_vt + offs_dv[None, :], valid_n, mask_dv, MASKED, not EVEN_DV, COMPUTE_FP32)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _runs(lo, a, b):
    """Split ``[lo, ...)`` into masked ``[lo, s1)``, unmasked ``[s1, s2)``, masked ``[s2, hi)``
    given the window's fully-visible start ``a`` and the end ``b`` of fully visible tiles."""
    s1 = tl.minimum(tl.maximum(a, lo), tl.maximum(b, lo))
    s2 = tl.maximum(b, s1)
    return s1, s2



@triton.jit
def _new_kv_tile(ptr, stride_t, desc, desc_row, desc_col, start, offs_c, col_mask,
                 USE_DESC: tl.constexpr, COL_MASK: tl.constexpr, TO_FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``[start, start + BLOCK_N)`` of a request's new K or V (all inside the request):
    through the TMA descriptor at ``(desc_row + start, desc_col)``, or through pointers."""
    if USE_DESC:
        x = desc.load([desc_row + start, desc_col])
        if TO_FP32:
            x = x.to(tl.float32)
    else:
        rows = start + tl.arange(0, BLOCK_N)
        x = _load_tile(ptr + rows[:, None] * stride_t + offs_c[None, :], rows, col_mask, False, COL_MASK, TO_FP32)
    return x


@triton.jit
def _softmax_pv(acc, l_i, m_i, qk, v, qk_scale, DOT_PREC: tl.constexpr):
    """One unmasked tile's online-softmax update, the same operations as `_attn_run`'s."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _attn_run_desc(
    acc, l_i, m_i, q,
    lo, hi,
    k_ptr, v_ptr, stride_kt, stride_vt,
    k_desc, v_desc, desc_row, k_col, v_col,
    qk_scale, offs_d, offs_dv,
    K_DESC: tl.constexpr,
    V_DESC: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_DK: tl.constexpr,
    EVEN_DV: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """The unmasked run ``[lo, hi)`` of the new-token stage (full, fully visible tiles; no
    logit cap, no remainder head dims) with K (``K_DESC``) and / or V (``V_DESC``) read
    through the descriptors. ``desc_row``: the request's first row (int32); ``k_col`` /
    ``v_col``: ``kv_head * DK`` / ``kv_head * DV``."""
    mask_d = offs_d < DK
    mask_dv = offs_dv < DV
    for start in range(lo, hi, BLOCK_N):
        k = _new_kv_tile(k_ptr, stride_kt, k_desc, desc_row, k_col, start, offs_d, mask_d,
                         K_DESC, not EVEN_DK, COMPUTE_FP32, BLOCK_N)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
        v = _new_kv_tile(v_ptr, stride_vt, v_desc, desc_row, v_col, start, offs_dv, mask_dv,
                         V_DESC, not EVEN_DV, COMPUTE_FP32, BLOCK_N).to(q.dtype)
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, v, qk_scale, DOT_PREC)
    return acc, l_i, m_i
