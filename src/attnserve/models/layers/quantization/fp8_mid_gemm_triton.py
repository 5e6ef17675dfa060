"""Triton kernel behind `fp8_mid_gemm` (import that module, not this one).

``y = (x * s_x) @ (W_q * s_w)^T (+ b)`` for ``16 < M <= 256`` rows and an e4m3 weight
``W_q [N, K]`` (``nn.Linear`` layout), in the swapped form of `mid_gemm_triton` (whose
loads, split-K workspace helpers and epilogue it reuses): a program computes the transposed
tile ``acc [BLOCK_N, M] = W_q[n0:n0+BLOCK_N, :] @ x^T`` with the weight tile as the
tensor-core ``M`` operand and the activation rows (one or two power-of-two pieces
``BLOCK_M1 (+ BLOCK_M2)``) as its ``N`` operand, so every weight byte is read once per
call and 16..256 rows need no padding to 64.

Two operand modes (constexpr ``W8A8``):

* **W8A16** (``W8A8`` False): ``x`` is 16-bit; the e4m3 weight tile is widened to ``x``'s
  dtype in registers (exact: e4m3 values are bf16/fp16 values) and multiplied by a 16-bit
  ``tl.dot``; no activation quantisation.
* **W8A8**: ``x`` is e4m3 with a float32 per-token scale ``s_x [M]``; e4m3 x e4m3
  ``tl.dot``. On sm_90 Triton accumulates FP8 products with the tensor core's reduced
  precision by default (``max_num_imprecise_acc`` 2**30); here each ``K`` step's partial
  sum is promoted into the float32 accumulator (``max_num_imprecise_acc = BLOCK_K``), the
  scheme of DeepSeek-V3's report (arXiv:2412.19437, section 3.3.2), so the error stays that
  of ``BLOCK_K / 32`` imprecise tensor-core steps per ``K`` step.

The products are summed unscaled; the epilogue multiplies by the weight scale (per output
row: ``WS_PER_TENSOR`` False, or one scalar) and, W8A8, the per-token scale, then adds the
bias, applies the gate (``GATED``: ``act(gate) * up``) and rounds once to the output dtype.
``SPLIT_K > 1`` splits the ``K`` steps of a column block over that many programs, which add
their float32 tiles into a zeroed workspace with atomics; the last to arrive (a per-block
counter) scales and stores (no second kernel), and leaves the buffer as it found it: it
stores zeros over the workspace slice it read and resets its counter (`_split_k_restore`),
so one zeroed buffer serves every later launch on the stream (`split_k_workspace`). Under
the interpreter ``UPCAST`` converts the dot operands to float32 (it has no FP8 or reliable
bf16 ``tl.dot``; the products are exact in float32 either way). Ideas (not code) from the Triton matmul tutorials, swap-AB
GEMMs (TensorRT-LLM, CUTLASS) and split-K reductions; the code is our own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.models.layers.mid_gemm_triton import (_epilogue, _load_w, _load_x, _pdl_first_weights,
                                                     _split_k_publish, _split_k_range, _split_k_read)
from attnserve.pdl_triton import gdc_launch_dependents


@triton.jit
def _dot_acc(w_tile, x_tile, acc, W8A8: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + w_tile [BN, BK] @ x_tile[BM, BK]^T`` (float32)."""
    if UPCAST:
        return tl.dot(w_tile.to(tl.float32), tl.trans(x_tile.to(tl.float32)), acc, input_precision="ieee",
                      out_dtype=tl.float32)
    if W8A8:
        return tl.dot(w_tile, tl.trans(x_tile), acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
    return tl.dot(w_tile.to(x_tile.dtype), tl.trans(x_tile), acc, out_dtype=tl.float32)


@triton.jit
def _fp8_k_step(acc1, acc2, u1, u2, w, wu, x_ptr, stride_xm, k0, M, K, BLOCK_K: tl.constexpr, BLOCK_M1: tl.constexpr,
                BLOCK_M2: tl.constexpr, HAS_M2: tl.constexpr, W8A8: tl.constexpr, UPCAST: tl.constexpr,
                GATED: tl.constexpr):
    """One ``K`` step from column ``k0``: the weight tile ``w`` (and, GATED, the up tile ``wu``)
    times the activation pieces, added into the float32 accumulators."""
    x1 = _load_x(x_ptr, stride_xm, 0, k0, M, K, BLOCK_M1, BLOCK_K)
    acc1 = _dot_acc(w, x1, acc1, W8A8, BLOCK_K, UPCAST)
    if GATED:
        u1 = _dot_acc(wu, x1, u1, W8A8, BLOCK_K, UPCAST)
    if HAS_M2:
        x2 = _load_x(x_ptr, stride_xm, BLOCK_M1, k0, M, K, BLOCK_M2, BLOCK_K)
        acc2 = _dot_acc(w, x2, acc2, W8A8, BLOCK_K, UPCAST)
        if GATED:
            u2 = _dot_acc(wu, x2, u2, W8A8, BLOCK_K, UPCAST)
    return acc1, acc2, u1, u2


@triton.jit
def _scaled(acc, ws_ptr, xs_ptr, stride_xs, row0, rows_end, m0, M, W8A8: tl.constexpr,
            WS_PER_TENSOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M]`` times the weight scale of rows ``row0 ..`` (and, W8A8, the
    token scales of rows ``m0 ..``)."""
    if WS_PER_TENSOR:
        acc = acc * tl.load(ws_ptr)
    else:
        rows = row0 + tl.arange(0, BLOCK_N)
        acc = acc * tl.load(ws_ptr + rows, mask=rows < rows_end, other=0.0)[:, None]
    if W8A8:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        acc = acc * tl.load(xs_ptr + offs_m * stride_xs, mask=offs_m < M, other=0.0)[None, :]
    return acc


@triton.jit
def _finish(acc1, acc2, u1, u2, ws_ptr, xs_ptr, b_ptr, y_ptr, stride_xs, stride_ym, n0, M, N,
            BLOCK_N: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_M2: tl.constexpr, HAS_M2: tl.constexpr,
            W8A8: tl.constexpr, WS_PER_TENSOR: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
            ACT: tl.constexpr):
    acc1 = _scaled(acc1, ws_ptr, xs_ptr, stride_xs, n0, N, 0, M, W8A8, WS_PER_TENSOR, BLOCK_N, BLOCK_M1)
    if GATED:
        u1 = _scaled(u1, ws_ptr, xs_ptr, stride_xs, N + n0, 2 * N, 0, M, W8A8, WS_PER_TENSOR, BLOCK_N, BLOCK_M1)
    if HAS_M2:
        acc2 = _scaled(acc2, ws_ptr, xs_ptr, stride_xs, n0, N, BLOCK_M1, M, W8A8, WS_PER_TENSOR, BLOCK_N, BLOCK_M2)
        if GATED:
            u2 = _scaled(u2, ws_ptr, xs_ptr, stride_xs, N + n0, 2 * N, BLOCK_M1, M, W8A8, WS_PER_TENSOR, BLOCK_N,
                         BLOCK_M2)
    _epilogue(acc1, acc2, u1, u2, b_ptr, y_ptr, stride_ym, n0, M, N, BLOCK_N, BLOCK_M1, BLOCK_M2, HAS_M2,
              HAS_BIAS, GATED, ACT)


@triton.jit
def _ws_zero(wk_ptr, col0, ncols, m0, M, ws_cols, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store zeros at ``wk[m0 + j, col0 + i]`` for ``i < ncols``, ``m0 + j < M``: the block's
    own columns only (a partial last block's neighbouring columns belong to another block,
    whose sums may not be read yet)."""
    offs_c = tl.arange(0, BLOCK_N)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    ptrs = wk_ptr + offs_m[None, :] * ws_cols + (col0 + offs_c)[:, None]
    zeros = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    tl.store(ptrs, zeros, mask=(offs_m < M)[None, :] & (offs_c < ncols)[:, None])


@triton.jit
def _split_k_restore(wk_ptr, cnt_ptr, pid_n, n0, M, N, ws_cols, BLOCK_N: tl.constexpr, BLOCK_M1: tl.constexpr,
                     BLOCK_M2: tl.constexpr, HAS_M2: tl.constexpr, GATED: tl.constexpr):
    """After `_split_k_read` by the block's last program: zero the sums it read (its valid
    columns, gate and up halves, ``M`` rows) and its counter, so the workspace is all zero
    again when the kernel ends. The barrier orders every thread's reads of the slice before
    any thread's zeros (the CTA's threads read and write it in different layouts). The other
    programs of the block added and counted before this one's acquire; none touches the
    slice or the counter after."""
    tl.debug_barrier()
    ncols = tl.minimum(n0 + BLOCK_N, N) - n0
    _ws_zero(wk_ptr, n0, ncols, 0, M, ws_cols, BLOCK_N, BLOCK_M1)
    if GATED:
        _ws_zero(wk_ptr, N + n0, ncols, 0, M, ws_cols, BLOCK_N, BLOCK_M1)
    if HAS_M2:
        _ws_zero(wk_ptr, n0, ncols, BLOCK_M1, M, ws_cols, BLOCK_N, BLOCK_M2)
        if GATED:
            _ws_zero(wk_ptr, N + n0, ncols, BLOCK_M1, M, ws_cols, BLOCK_N, BLOCK_M2)
    tl.store(cnt_ptr + pid_n, 0)


@triton.jit(do_not_specialize=["M"])
def _fp8_mid_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, w_desc, ws_ptr, b_ptr, y_ptr, wk_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_xs, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_M2: tl.constexpr,
    HAS_M2: tl.constexpr, SPLIT_K: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
    W8A8: tl.constexpr, WS_PER_TENSOR: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    ACT: tl.constexpr, USE_PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0,
    INTERPRET: tl.constexpr = False,
):
    """Grid ``(cdiv(N, BLOCK_N) * SPLIT_K,)``; ``y [M, N]`` (gated: ``w`` ``[2N, K]``).

    ``x [M, K]`` (16-bit, or e4m3 when W8A8) rows ``stride_xm`` apart, unit stride along
    ``K``; ``xs`` float32 token scales ``stride_xs`` apart (read when W8A8); ``w`` contiguous
    e4m3 ``[N or 2N, K]`` (``w_desc``: its TMA descriptor with ``[BLOCK_N, BLOCK_K]`` boxes
    when USE_TMA); ``ws`` float32 weight scales, one per weight row or (WS_PER_TENSOR) one;
    ``b`` ``[N or 2N]`` read when HAS_BIAS; ``y`` rows ``stride_ym`` apart. Requires ``M <=
    BLOCK_M1 + BLOCK_M2 * HAS_M2`` (``BLOCK_M2 >= 16`` even without HAS_M2). SPLIT_K > 1:
    ``wk`` float32 zeros ``[M, N or 2N]`` and ``cnt`` int32 zeros ``[cdiv(N, BLOCK_N)]``,
    both all zero again when the kernel ends.

    USE_PDL (programmatic dependent launch, `attnserve.pdl`; any SPLIT_K): the program lets
    the next kernel launch, loads its first ``K`` step's weight tile(s), hints the L2 to
    fetch the next ``PREFETCH_LINES`` 128-byte lines of each of its weight rows (0: none),
    then waits for the kernel before it and only then reads ``x``, ``xs``, the workspace or
    the counters, or writes anything. A program whose split-K range is empty multiplies the
    masked (zero) first tile, adding exact zeros. INTERPRET (the Triton interpreter): the
    same steps without the wait, the launch signal and the prefetches.
    """
    if USE_PDL:
        if not INTERPRET:
            gdc_launch_dependents()
    pid_n, k_lo, k_hi = _split_k_range(tl.program_id(0), K, SPLIT_K, BLOCK_K)
    n0 = pid_n * BLOCK_N
    w_rows = 2 * N if GATED else N
    acc1 = tl.zeros((BLOCK_N, BLOCK_M1), dtype=tl.float32)
    u1 = tl.zeros((BLOCK_N, BLOCK_M1), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M2), dtype=tl.float32)
    u2 = tl.zeros((BLOCK_N, BLOCK_M2), dtype=tl.float32)
    k_start = k_lo
    if USE_PDL:
        # before the wait only weight bytes: the first step's tile(s) and the L2 hints
        w0, wu0 = _pdl_first_weights(w_ptr, w_desc, n0, k_lo, N, K, BLOCK_N, BLOCK_K, USE_TMA, GATED, PREFETCH_LINES,
                                     128, INTERPRET)
        acc1, acc2, u1, u2 = _fp8_k_step(acc1, acc2, u1, u2, w0, wu0, x_ptr, stride_xm, k_lo, M, K, BLOCK_K,
                                         BLOCK_M1, BLOCK_M2, HAS_M2, W8A8, UPCAST, GATED)
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_hi, BLOCK_K):
        w = _load_w(w_ptr, w_desc, n0, k0, N, K, BLOCK_N, BLOCK_K, USE_TMA)
        wu = w
        if GATED:
            wu = _load_w(w_ptr, w_desc, N + n0, k0, w_rows, K, BLOCK_N, BLOCK_K, USE_TMA)
        acc1, acc2, u1, u2 = _fp8_k_step(acc1, acc2, u1, u2, w, wu, x_ptr, stride_xm, k0, M, K, BLOCK_K, BLOCK_M1,
                                         BLOCK_M2, HAS_M2, W8A8, UPCAST, GATED)
    if SPLIT_K == 1:
        _finish(acc1, acc2, u1, u2, ws_ptr, xs_ptr, b_ptr, y_ptr, stride_xs, stride_ym, n0, M, N, BLOCK_N,
                BLOCK_M1, BLOCK_M2, HAS_M2, W8A8, WS_PER_TENSOR, HAS_BIAS, GATED, ACT)
    else:
        # the last of the SPLIT_K programs of this column block to arrive finishes it
        if _split_k_publish(wk_ptr, cnt_ptr, pid_n, acc1, acc2, u1, u2, n0, M, N, w_rows, BLOCK_N, BLOCK_M1,
                            BLOCK_M2, HAS_M2, GATED, SPLIT_K):
            acc1, acc2, u1, u2 = _split_k_read(wk_ptr, acc1, acc2, u1, u2, n0, M, N, w_rows, BLOCK_N, BLOCK_M1,
                                               BLOCK_M2, HAS_M2, GATED)
            _split_k_restore(wk_ptr, cnt_ptr, pid_n, n0, M, N, w_rows, BLOCK_N, BLOCK_M1, BLOCK_M2, HAS_M2, GATED)
            _finish(acc1, acc2, u1, u2, ws_ptr, xs_ptr, b_ptr, y_ptr, stride_xs, stride_ym, n0, M, N, BLOCK_N,
                    BLOCK_M1, BLOCK_M2, HAS_M2, W8A8, WS_PER_TENSOR, HAS_BIAS, GATED, ACT)
