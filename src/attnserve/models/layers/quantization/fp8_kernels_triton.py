"""Triton kernels of the FP8 linear methods (import `fp8_kernels`, not this module).

* `_act_quant_kernel`: dynamic activation quantisation, one program per (row, group):
  ``s = max(amax(|x|), eps) / 448``, ``q = clamp(x / s)`` (a division, as the reference) as e4m3. A group is a whole row
  (per-token scales) or a ``1 x GROUP`` run of it (DeepSeek-V3's activation groups); the
  row is walked in ``BLOCK`` chunks twice (amax, then quantise), so any ``K`` works.
* `_add_rmsnorm_quant_kernel` / `_silu_mul_quant_kernel`: the producers of the FP8 linears'
  inputs (fused add-RMSNorm; SiLU-and-mul) with the per-token quantisation fused, so the
  16-bit activation is never written and read back (a launch and ``M x K x 4`` bytes saved);
  the first can also apply `_scale_rows_cols_kernel`'s scaling to its input (a folded
  ``o_proj`` / ``down_proj`` output, `fused_inputs.ScaledProduct`).
* `_scale_rows_cols_kernel`: ``y = x * (rs[row] * cs[col])`` for an unscaled FP8 product ``x``
  (a tensor-wise ``_scaled_mm`` with unit scales), rounded once to ``y``'s dtype.
* `_scaled_fp8_gemm_kernel`: ``C = (A_q * s_a) @ (B_q * s_b)^T`` for e4m3 ``A [M, K]`` and
  ``B [N, K]`` (``nn.Linear`` layout). The ``K`` loop steps ``BLOCK_K`` (= the scale group
  along ``K``, 128) at a time; each step's ``tl.dot`` (float32 accumulate) is multiplied by
  the step's activation scale per row and weight scale per column before it is added, so
  one kernel serves block scales (``B`` scales ``[cdiv(N, 128), cdiv(K, 128)]``), per
  channel (group 1 along ``N``, stride 0 along ``K``) and per tensor (strides 0). Edge tiles
  (``M``, ``N`` or ``K`` not multiples of the tile) are masked to zero. Programs are
  ordered in groups of ``GROUP_M`` row tiles (the Triton matmul tutorial's L2 swizzle).

Under the interpreter (``UPCAST``) the operands of ``tl.dot`` are converted to float32
first (the interpreter has no FP8 dot). Ideas (not code) from the Triton matmul tutorial
and DeepSeek-V3's published block-scaling scheme; the code is our own.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: torch dtype name -> Triton dtype (the constexpr ``OUT_DTYPE`` of `_silu_mul_quant_kernel`)
TL_DTYPES = {"bfloat16": tl.bfloat16, "float16": tl.float16, "float32": tl.float32}


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                      GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    """Grid ``(M, cdiv(K, GROUP))``: row ``pid0``'s group ``pid1`` -> ``q`` and ``s[row, group]``."""
    row = tl.program_id(0)
    grp = tl.program_id(1)
    start = grp * GROUP
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, GROUP, BLOCK):
        cols = start + k0 + offs
        mask = (cols < K) & (k0 + offs < GROUP)
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), EPS) / FP8_MAX
    for k0 in range(0, GROUP, BLOCK):
        cols = start + k0 + offs
        mask = (cols < K) & (k0 + offs < GROUP)
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + grp, scale)


@triton.jit
def _scaled_fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_bn, stride_cm,
    stride_as_m, stride_as_k, stride_bs_n, stride_bs_k,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)``; ``C [M, N]`` in ``c``'s dtype.

    Scales: activation ``as[m * stride_as_m + kb * stride_as_k]``, weight
    ``bs[(n // GROUP_N) * stride_bs_n + kb * stride_bs_k]`` for K step ``kb`` (float32).
    ``A``, ``B`` unit stride along ``K``; ``bias`` ``[N]`` read only when HAS_BIAS.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + offs_m * stride_as_m
    bs_ptrs = bs_ptr + (offs_n // GROUP_N) * stride_bs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & mask_n[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_as_k, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bs_k, mask=mask_n, other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b, out_dtype=tl.float32)
        acc += part * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _add_rmsnorm_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, N, stride_x, stride_r, stride_q, eps, w_offset,
                              rs_ptr, cs_ptr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                              HAS_SCALES: tl.constexpr = False):
    """Grid ``(M,)``, the whole row in registers (``BLOCK >= N``): ``r += x`` (rounded to
    ``r``'s dtype, stored), ``y = r / sqrt(mean(r^2) + eps) * (w + w_offset)`` rounded to
    ``r``'s dtype (as the unfused norm stores it), then ``y``'s per-token e4m3 ``q`` and
    scale ``s[row]`` as `_act_quant_kernel`.

    HAS_SCALES: ``x`` is an unscaled FP8 product; it is first scaled and rounded as
    `_scale_rows_cols_kernel` stores it, ``(x * (rs[row] * cs[col]))`` in float32 rounded to
    ``r``'s dtype, so the result is that kernel's followed by this one's, bit for bit."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALES:
        scale = tl.load(rs_ptr + row) * tl.load(cs_ptr + offs, mask=mask, other=0.0)
        x = (x * scale).to(r_ptr.dtype.element_ty).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * stride_r + offs, h, mask=mask)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + w_offset
    y = (hf * inv * w).to(r_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), EPS) / FP8_MAX
    q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _silu_mul(g, u):
    """``g * sigmoid(g) * u`` with the sigmoid from ``exp(-|g|)`` (the unfused kernel's form)."""
    e = tl.exp(-tl.abs(g))
    return g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * u


@triton.jit
def _load_gate_up(x_row, rs_ptr, cs_ptr, row, cols, mask, I, HAS_SCALES: tl.constexpr):
    """The gate and up values of row ``x_row`` at ``cols`` as float32, times ``rs[row] *
    cs[col]`` / ``rs[row] * cs[I + col]`` with HAS_SCALES (`_silu_mul_quant_kernel`)."""
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALES:
        rs = tl.load(rs_ptr + row)
        g = g * (rs * tl.load(cs_ptr + cols, mask=mask, other=0.0))
        u = u * (rs * tl.load(cs_ptr + I + cols, mask=mask, other=0.0))
    return g, u


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, I, stride_x, stride_q, rs_ptr, cs_ptr, OUT_DTYPE: tl.constexpr,
                           BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                           ONE_PASS: tl.constexpr = False, HAS_SCALES: tl.constexpr = False):
    """Grid ``(M,)``: ``y = silu(g) * u`` of ``x [M, 2I]`` = ``[g | u]`` (float32 math,
    rounded to ``OUT_DTYPE`` as the unfused kernel stores it), then per-token e4m3 ``q
    [M, I]`` and ``s[row]``.

    HAS_SCALES: ``x`` is an unscaled FP8 product; ``g`` and ``u`` are first multiplied by
    the row's ``rs[row]`` and their columns' ``cs[col]`` / ``cs[I + col]`` (float32).

    ONE_PASS (requires ``BLOCK >= I``): the whole row's ``y`` stays in registers between
    its amax and its quantisation, so ``x`` is read once and ``y`` computed once. Otherwise
    two passes over the row in ``BLOCK`` chunks (amax, then quantise; the second re-reads
    the row, which is in cache, and recomputes ``y``)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    if ONE_PASS:
        mask = offs < I
        g, u = _load_gate_up(x_row, rs_ptr, cs_ptr, row, offs, mask, I, HAS_SCALES)
        y = _silu_mul(g, u).to(OUT_DTYPE).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), EPS) / FP8_MAX
        q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
        return
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK):
        cols = k0 + offs
        mask = cols < I
        g, u = _load_gate_up(x_row, rs_ptr, cs_ptr, row, cols, mask, I, HAS_SCALES)
        y = _silu_mul(g, u).to(OUT_DTYPE).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(y))
    scale = tl.maximum(tl.max(amax, axis=0), EPS) / FP8_MAX
    for k0 in range(0, I, BLOCK):
        cols = k0 + offs
        mask = cols < I
        g, u = _load_gate_up(x_row, rs_ptr, cs_ptr, row, cols, mask, I, HAS_SCALES)
        y = _silu_mul(g, u).to(OUT_DTYPE).to(tl.float32)
        q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _scale_rows_cols_kernel(x_ptr, rs_ptr, cs_ptr, y_ptr, N, stride_x, stride_y, BLOCK_N: tl.constexpr):
    """Grid ``(M, cdiv(N, BLOCK_N))``: ``y[row, cols] = x[row, cols] * (rs[row] * cs[cols])``
    in float32, stored in ``y``'s dtype (`fp8_kernels.scale_rows_cols`)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(rs_ptr + row) * tl.load(cs_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + cols, (x * scale).to(y_ptr.dtype.element_ty), mask=mask)
