"""Triton kernel behind `attnserve.models.layers.mid_gemm` (import that module, not this one).

``y = x @ W^T`` for a decode batch of ``16 < M <= 256`` rows and a row-major weight
``W [N, K]`` (``nn.Linear`` layout), in the *swapped* form: a program computes the
transposed tile ``acc [BLOCK_N, M] = W[n0:n0+BLOCK_N, :] @ x^T`` on the tensor cores. The
weight tile is the wgmma ``M`` operand (64 rows a warpgroup) and the activations are its
``N`` operand, which may be as narrow as 16; so the tile height ``M`` needs no padding to
64 or 128 rows (the tensor-core work stays ~2·M·N·K, below the weight stream's time), and
the one weight tile in shared memory meets every activation row.

The activation rows are covered by one program, as one or two power-of-two pieces
``BLOCK_M1 (+ BLOCK_M2 when HAS_M2) >= M``: 144 rows are 128 + 16, 96 are 64 +
32, so padding stays small (Triton tiles are powers of two; a single 256-row tile would
nearly double the tensor-core work at M = 144, 87 µs of the gate_up projection at 688
TFLOP/s against a 78 µs weight stream). Each ``K`` step is one weight tile (TMA box or
pointer loads, constexpr ``USE_TMA``) and one or two ``tl.dot``.

``SPLIT_K > 1``: program ``(n, s)`` covers the ``s``-th of ``SPLIT_K`` equal ranges of ``K``
steps and adds its float32 tile into a zeroed workspace ``ws [M, N]`` (``[M, 2 * N]``
gated) with atomics; the last program of a column block to arrive (a per-block counter,
acquire-release) reads the sums back and runs the epilogue, so there is no second kernel.
It serves narrow ``N`` with a long ``K`` (``down``: 4096 x 14336 gives only 64 blocks of 64
rows for 132 SMs).

``USE_PDL`` (programmatic dependent launch, `attnserve.pdl`; ``SPLIT_K == 1`` only, so
nothing but ``y`` is written, after the wait): the first ``K`` step is peeled off the loop.
A program signals ``gdc_launch_dependents`` at once, loads its first weight tile(s) (and,
``PREFETCH_LINES > 0``, hints the L2 to fetch the next lines of its weight rows with
``prefetch.global.L2``), then ``gdc_wait``s for the kernel before it (which writes ``x``)
and finishes the first step; the remaining steps run the unchanged, pipelined loop. The
accumulation order is the plain kernel's, so the result is bit-identical to it.

Gated (constexpr ``GATED``, a fused ``[gate | up]`` weight ``[2N, K]``): the program
accumulates gate rows ``n`` and up rows ``N + n`` and writes ``act(gate) * up`` (SiLU or
GELU-tanh, float32 math, one rounding), replacing the act-and-mul kernel and its bytes.

Accumulation is float32; bias (float32 add) and the output conversion happen once. Under
the interpreter ``DOT_UPCAST`` converts the dot operands to float32 (its ``tl.dot``
misreads bfloat16). Ideas (not code) from the Triton matmul tutorials and the swap-AB
GEMMs of TensorRT-LLM / CUTLASS; the code is our own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.models.layers.skinny_gemm_triton import _gate_act, _prefetch_rows_l2
from attnserve.pdl_triton import gdc_launch_dependents, gdc_wait


@triton.jit
def _dot_t(w_tile, x_tile, DOT_UPCAST: tl.constexpr):
    """``w_tile [BN, BK] @ x_tile[BM, BK]^T`` -> float32 ``[BN, BM]``."""
    if DOT_UPCAST:
        return tl.dot(w_tile.to(tl.float32), tl.trans(x_tile.to(tl.float32)), input_precision="ieee",
                      out_dtype=tl.float32)
    return tl.dot(w_tile, tl.trans(x_tile), out_dtype=tl.float32)


@triton.jit
def _load_x(x_ptr, stride_xm, m0, k0, M, K, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = m0 + tl.arange(0, BLOCK)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    return tl.load(ptrs, mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _k_step(acc1, acc2, u1, u2, w, wu, x_ptr, stride_xm, k0, M, K, BLOCK_K: tl.constexpr, BLOCK_M1: tl.constexpr,
            BLOCK_M2: tl.constexpr, HAS_M2: tl.constexpr, DOT_UPCAST: tl.constexpr, GATED: tl.constexpr):
    """One ``K`` step from column ``k0`` with preloaded weight tiles (the PDL form's first
    step): ``w`` (and, GATED, the up tile ``wu``) times the activation pieces, added into
    the float32 accumulators in the main loop's order."""
    x1 = _load_x(x_ptr, stride_xm, 0, k0, M, K, BLOCK_M1, BLOCK_K)
    acc1 += _dot_t(w, x1, DOT_UPCAST)
    if GATED:
        u1 += _dot_t(wu, x1, DOT_UPCAST)
    if HAS_M2:
        x2 = _load_x(x_ptr, stride_xm, BLOCK_M1, k0, M, K, BLOCK_M2, BLOCK_K)
        acc2 += _dot_t(w, x2, DOT_UPCAST)
        if GATED:
            u2 += _dot_t(wu, x2, DOT_UPCAST)
    return acc1, acc2, u1, u2


@triton.jit
def _load_w(w_ptr, w_desc, row0, k0, rows_end, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            USE_TMA: tl.constexpr):
    """Weight rows ``row0 .. row0 + BLOCK_N`` (valid below ``rows_end``), columns ``k0 ..``.
    TMA: the box is zero outside the tensor; rows of the neighbouring half (gate tile past
    ``N``) may be read but only feed output columns that are never stored."""
    if USE_TMA:
        return w_desc.load([row0, k0])
    rows = row0 + tl.arange(0, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    return tl.load(ptrs, mask=(rows < rows_end)[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _pdl_first_weights(w_ptr, w_desc, n0, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_TMA: tl.constexpr, GATED: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                       LINE_ELEMS: tl.constexpr, INTERPRET: tl.constexpr):
    """The PDL form's prologue (this kernel's and `fp8_mid_gemm_triton`'s): the weight tile(s)
    of the ``K`` step at ``k0`` (gate rows ``n0 ..`` and, GATED, up rows ``N + n0 ..``; without
    GATED the second is the first), L2 hints of the next ``PREFETCH_LINES`` lines of
    ``LINE_ELEMS`` elements of those rows, then ``gdc_wait`` for the kernel before. Only
    weight bytes are read before the wait. INTERPRET: the loads alone."""
    w_rows = 2 * N if GATED else N
    w = _load_w(w_ptr, w_desc, n0, k0, N, K, BLOCK_N, BLOCK_K, USE_TMA)
    wu = w
    if GATED:
        wu = _load_w(w_ptr, w_desc, N + n0, k0, w_rows, K, BLOCK_N, BLOCK_K, USE_TMA)
    if not INTERPRET:
        if PREFETCH_LINES > 0:
            _prefetch_rows_l2(w_ptr, n0, k0 + BLOCK_K, N, K, BLOCK_N, PREFETCH_LINES, LINE_ELEMS)
            if GATED:
                _prefetch_rows_l2(w_ptr, N + n0, k0 + BLOCK_K, w_rows, K, BLOCK_N, PREFETCH_LINES, LINE_ELEMS)
        gdc_wait()
    return w, wu


@triton.jit
def _epilogue(acc1, acc2, u1, u2, b_ptr, y_ptr, stride_ym, n0, M, N, BLOCK_N: tl.constexpr,
              BLOCK_M1: tl.constexpr, BLOCK_M2: tl.constexpr, HAS_M2: tl.constexpr, HAS_BIAS: tl.constexpr,
              GATED: tl.constexpr, ACT: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        acc1 += b
        acc2 += b
        if GATED:
            bu = tl.load(b_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            u1 += bu
            u2 += bu
    if GATED:
        acc1 = _gate_act(acc1, ACT) * u1
    offs_m = tl.arange(0, BLOCK_M1)
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(ptrs, acc1.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_m < M)[None, :])
    if HAS_M2:
        if GATED:
            acc2 = _gate_act(acc2, ACT) * u2
        offs_m2 = BLOCK_M1 + tl.arange(0, BLOCK_M2)
        ptrs2 = y_ptr + offs_m2[None, :] * stride_ym + offs_n[:, None]
        tl.store(ptrs2, acc2.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_m2 < M)[None, :])


@triton.jit
def _ws_add(ws_ptr, acc, col0, m0, M, ws_cols, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Atomically add ``acc [BLOCK_N, BLOCK_M]`` into ``ws[m0 + j, col0 + i]`` (masked to ``M``
    rows; columns past the block's valid range land in the workspace's own padding)."""
    offs_c = col0 + tl.arange(0, BLOCK_N)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    ptrs = ws_ptr + offs_m[None, :] * ws_cols + offs_c[:, None]
    # relaxed: ordered before the counter's release by the CTA barrier that follows (the
    # threadfence-reduction pattern: bar.sync, then one acq_rel atomic)
    tl.atomic_add(ptrs, acc, mask=(offs_m < M)[None, :] & (offs_c < ws_cols)[:, None], sem="relaxed")


@triton.jit
def _ws_read(ws_ptr, col0, m0, M, ws_cols, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_c = col0 + tl.arange(0, BLOCK_N)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    ptrs = ws_ptr + offs_m[None, :] * ws_cols + offs_c[:, None]
    return tl.load(ptrs, mask=(offs_m < M)[None, :] & (offs_c < ws_cols)[:, None], other=0.0, volatile=True)


@triton.jit
def _split_k_range(pid, K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``(column block, k_lo, k_hi)`` of program ``pid`` of a ``(column blocks * SPLIT_K,)``
    grid: its share of whole ``BLOCK_K`` steps of ``K``."""
    pid_n = pid // SPLIT_K
    pid_k = pid % SPLIT_K
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_lo = pid_k * per * BLOCK_K
    k_hi = tl.minimum(K, (pid_k + 1) * per * BLOCK_K)
    return pid_n, k_lo, k_hi


@triton.jit
def _split_k_publish(ws_ptr, cnt_ptr, pid_n, acc1, acc2, u1, u2, n0, M, N, ws_cols, BLOCK_N: tl.constexpr,
                     BLOCK_M1: tl.constexpr, BLOCK_M2: tl.constexpr, HAS_M2: tl.constexpr, GATED: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    """Add this program's partial sums of column block ``pid_n`` (columns ``n0..``, gate and,
    GATED, up halves ``N`` apart) into the workspace, then count it in; True for the last of
    the block's ``SPLIT_K`` programs, which finishes the block (`_split_k_read`)."""
    valid = (tl.arange(0, BLOCK_N) < tl.minimum(n0 + BLOCK_N, N) - n0)[:, None]
    _ws_add(ws_ptr, tl.where(valid, acc1, 0.0), n0, 0, M, ws_cols, BLOCK_N, BLOCK_M1)
    if GATED:
        _ws_add(ws_ptr, tl.where(valid, u1, 0.0), N + n0, 0, M, ws_cols, BLOCK_N, BLOCK_M1)
    if HAS_M2:
        _ws_add(ws_ptr, tl.where(valid, acc2, 0.0), n0, BLOCK_M1, M, ws_cols, BLOCK_N, BLOCK_M2)
        if GATED:
            _ws_add(ws_ptr, tl.where(valid, u2, 0.0), N + n0, BLOCK_M1, M, ws_cols, BLOCK_N, BLOCK_M2)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
    return arrived == SPLIT_K - 1


@triton.jit
def _split_k_read(ws_ptr, acc1, acc2, u1, u2, n0, M, N, ws_cols, BLOCK_N: tl.constexpr, BLOCK_M1: tl.constexpr,
                  BLOCK_M2: tl.constexpr, HAS_M2: tl.constexpr, GATED: tl.constexpr):
    """The block's summed ``(acc1, acc2, u1, u2)`` from the workspace (the tiles a shape does
    not use are returned as given)."""
    acc1 = _ws_read(ws_ptr, n0, 0, M, ws_cols, BLOCK_N, BLOCK_M1)
    if GATED:
        u1 = _ws_read(ws_ptr, N + n0, 0, M, ws_cols, BLOCK_N, BLOCK_M1)
    if HAS_M2:
        acc2 = _ws_read(ws_ptr, n0, BLOCK_M1, M, ws_cols, BLOCK_N, BLOCK_M2)
        if GATED:
            u2 = _ws_read(ws_ptr, N + n0, BLOCK_M1, M, ws_cols, BLOCK_N, BLOCK_M2)
    return acc1, acc2, u1, u2


@triton.jit(do_not_specialize=["M"])
def _mid_gemm_kernel(
    x_ptr, w_ptr, w_desc, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_M2: tl.constexpr,
    HAS_M2: tl.constexpr, SPLIT_K: tl.constexpr, USE_TMA: tl.constexpr, DOT_UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0, INTERPRET: tl.constexpr = False,
):
    """Grid ``(cdiv(N, BLOCK_N) * SPLIT_K,)``; ``y [M, N]`` (gated: ``w`` ``[2N, K]``).

    ``x [M, K]`` rows ``stride_xm`` apart, unit stride along ``K``; ``w`` contiguous
    ``[N or 2N, K]`` (``w_desc``: its TMA descriptor with ``[BLOCK_N, BLOCK_K]`` boxes when
    USE_TMA, else unused); ``b`` ``[N or 2N]`` read when HAS_BIAS; ``y`` rows ``stride_ym``
    apart. Requires ``M <= BLOCK_M1 + BLOCK_M2 * HAS_M2`` (``BLOCK_M2 >= 16`` even when
    HAS_M2 is False: it then only sizes unused accumulators). SPLIT_K > 1: ``ws`` float32 zeros ``[M,
    N or 2N]`` and ``cnt`` int32 zeros ``[cdiv(N, BLOCK_N)]``.

    USE_PDL (programmatic dependent launch, `attnserve.pdl`; requires SPLIT_K == 1): the
    program lets the next kernel launch, loads its first ``K`` step's weight tile(s),
    issues L2 prefetches of the next ``PREFETCH_LINES`` 128-byte lines of each of its weight
    rows (0: none), then waits for the previous kernel before it reads ``x``; it writes
    nothing before the wait. INTERPRET (the Triton interpreter, which lacks the
    ``griddepcontrol`` and inline-PTX instructions): the same steps without the wait,
    the launch signal and the prefetches, which do not change any value.
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
        # SPLIT_K == 1 (`MidGemmConfig.validate`): k_lo == 0 < K, so the first step exists.
        # Before the wait only the weight (the first step's tile(s), the L2 prefetches);
        # x, which the kernel before this one writes, is read after it. The loop below
        # (the remaining steps) is the plain one, pipelined as usual.
        w, wu = _pdl_first_weights(w_ptr, w_desc, n0, k_lo, N, K, BLOCK_N, BLOCK_K, USE_TMA, GATED, PREFETCH_LINES,
                                   64, INTERPRET)
        acc1, acc2, u1, u2 = _k_step(acc1, acc2, u1, u2, w, wu, x_ptr, stride_xm, k_lo, M, K, BLOCK_K, BLOCK_M1,
                                     BLOCK_M2, HAS_M2, DOT_UPCAST, GATED)
        k_start = k_lo + BLOCK_K
    # (the plain kernel's loop, as it was before the PDL form: the order of its loads is kept)
    for k0 in range(k_start, k_hi, BLOCK_K):
        w = _load_w(w_ptr, w_desc, n0, k0, N, K, BLOCK_N, BLOCK_K, USE_TMA)
        x1 = _load_x(x_ptr, stride_xm, 0, k0, M, K, BLOCK_M1, BLOCK_K)
        acc1 += _dot_t(w, x1, DOT_UPCAST)
        if GATED:
            wu = _load_w(w_ptr, w_desc, N + n0, k0, w_rows, K, BLOCK_N, BLOCK_K, USE_TMA)
            u1 += _dot_t(wu, x1, DOT_UPCAST)
        if HAS_M2:
            x2 = _load_x(x_ptr, stride_xm, BLOCK_M1, k0, M, K, BLOCK_M2, BLOCK_K)
            acc2 += _dot_t(w, x2, DOT_UPCAST)
            if GATED:
                u2 += _dot_t(wu, x2, DOT_UPCAST)
    if SPLIT_K == 1:
        _epilogue(acc1, acc2, u1, u2, b_ptr, y_ptr, stride_ym, n0, M, N, BLOCK_N, BLOCK_M1, BLOCK_M2, HAS_M2,
                  HAS_BIAS, GATED, ACT)
    else:
        # the last of the SPLIT_K programs of this column block to arrive finishes it
        if _split_k_publish(ws_ptr, cnt_ptr, pid_n, acc1, acc2, u1, u2, n0, M, N, w_rows, BLOCK_N, BLOCK_M1,
                            BLOCK_M2, HAS_M2, GATED, SPLIT_K):
            acc1, acc2, u1, u2 = _split_k_read(ws_ptr, acc1, acc2, u1, u2, n0, M, N, w_rows, BLOCK_N, BLOCK_M1,
                                               BLOCK_M2, HAS_M2, GATED)
            _epilogue(acc1, acc2, u1, u2, b_ptr, y_ptr, stride_ym, n0, M, N, BLOCK_N, BLOCK_M1, BLOCK_M2, HAS_M2,
                      HAS_BIAS, GATED, ACT)
