"""Triton kernels behind `attnserve.models.layers.skinny_gemm` (import that module, not this one).

This module imports ``triton`` at the top; `skinny_gemm` imports it lazily, only when a
launch is requested, so CPU-only installs without Triton never load it.

The kernel computes ``y = x @ W^T`` for a few rows of ``x`` (``M <= 16``) and a row-major
weight ``W [N, K]`` (``nn.Linear`` layout). The grid is one program per ``BLOCK_N`` output
columns (= weight rows); each program walks the whole of ``K`` in ``BLOCK_K`` chunks, so
every weight element is read exactly once, with loads contiguous along ``K``; there is no
split-K (no atomics, no reduction kernel). Two inner products (constexpr ``USE_DOT``):

* ``tl.dot``: the ``[BLOCK_M, BLOCK_K]`` activation tile (``BLOCK_M = 16``, rows ``>= M``
  masked to zero) times the transposed ``[BLOCK_N, BLOCK_K]`` weight tile on the tensor
  cores (float32 inputs: ``input_precision="ieee"``, matching ``F.linear`` without TF32);
* broadcast-multiply + ``tl.sum`` over ``K`` in float32 (``BLOCK_M`` = next power of two of
  ``M``; ``BLOCK_M == 1`` keeps the product 2-D), cheaper than padding 1..4 rows to 16.
  ``DEFER`` (``BLOCK_M == 1`` only): the products are summed into a ``[BLOCK_N, BLOCK_K]``
  float32 accumulator and reduced over ``K`` once, after the loop. The per-step ``tl.sum``
  spans every warp of the program, so it costs shared-memory round trips and barriers at
  each step (6 ``BAR.SYNC`` a step at 4 warps, sm_90), which hold back the next loads.

``M`` is not specialised (``do_not_specialize``): every batch size sharing a ``BLOCK_M``
runs the same compiled kernel, so decode batches 2..16 do not each trigger a compile.
Accumulation is float32; the output is converted once to ``y``'s dtype. Weight-row
offsets are formed in int64 (``N * K`` may exceed 2**31 for vocabulary projections).
Loads are converted to float32 before any arithmetic of the non-dot path, which also
keeps interpreter runs on bfloat16 exact (the interpreter handles bf16 as raw bits); for
the same reason the host sets ``DOT_UPCAST`` (float32 operands of ``tl.dot``) there.

Two loop forms (constexpr ``CARRY``): the plain loop loads a step's weight tile and then
multiplies it, so a program has a tile in flight only between its products; the carried
loop loads step ``i + 1``'s tile before step ``i``'s product (register double-buffering),
keeping one in flight all the time. A decode GEMV is a stream over the weight whose rate
is bytes in flight / latency (Little's law), so this matters where the grid alone keeps
too few bytes in flight (``N * BLOCK_K * 2`` bytes for a bf16 matrix of ``N`` rows when
every program is resident). With ``USE_PDL`` (programmatic dependent launch,
`attnserve.pdl`) a program lets the next kernel launch at once, loads its
first weight tile (carried form) and only then waits for the previous kernel to finish
before reading ``x``.

Gated (constexpr ``GATED``), it reads a fused ``gate_up`` weight ``[2I, K]`` = ``[gate rows | up rows]``:
program ``p`` accumulates gate columns ``n`` and up columns ``n + I`` for the same ``n``
and writes ``act(gate) * up`` ``[M, I]`` (SwiGLU / GeGLU, Shazeer arXiv:2002.05202; GELU
tanh form, Hendrycks & Gimpel arXiv:1606.08415), with all activation math in float32.

Ideas (not code) from the Triton matmul tutorial and the small-M GEMV kernels discussed in
SGLang / vLLM; the code is our own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.pdl_triton import gdc_launch_dependents, gdc_wait
from attnserve.triton_jit import tanh


@triton.jit
def _gate_act(g, ACT: tl.constexpr):
    """``ACT`` 0: SiLU ``g * sigmoid(g)``; 1: GELU tanh ``0.5 g (1 + tanh(sqrt(2/pi)(g + 0.044715 g^3)))``.

    The sigmoid is formed from ``exp(-|g|)`` (in ``(0, 1]``) so no intermediate overflows.
    """
    if ACT == 0:
        e = tl.exp(-tl.abs(g))
        sig = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        a = g * sig
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + tanh(z))
    return a


@triton.jit
def _tile_dot(
    x_tile, w_tile, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """``x_tile [BLOCK_M, BLOCK_K] @ w_tile[BLOCK_N, BLOCK_K]^T`` -> float32 ``[BLOCK_M, BLOCK_N]``.

    DOT_UPCAST converts the operands of ``tl.dot`` to float32 first (the host sets it only
    under the Triton interpreter, whose ``tl.dot`` misreads bfloat16 operands).
    """
    if USE_DOT:
        if DOT_UPCAST:
            part = tl.dot(x_tile.to(tl.float32), tl.trans(w_tile.to(tl.float32)), input_precision="ieee",
                          out_dtype=tl.float32)
        else:
            # an FP8 weight (`skinny_linear_fp8`) is widened to x's dtype; a no-op otherwise
            part = tl.dot(x_tile, tl.trans(w_tile.to(x_tile.dtype)), input_precision=DOT_PRECISION,
                          out_dtype=tl.float32)
    else:
        xf = x_tile.to(tl.float32)
        wf = w_tile.to(tl.float32)
        if BLOCK_M == 1:
            # [BLOCK_N, BLOCK_K] * [1, BLOCK_K] -> [BLOCK_N] -> [1, BLOCK_N]
            part = tl.sum(wf * xf, axis=1)[None, :]
        else:
            part = tl.sum(xf[:, None, :] * wf[None, :, :], axis=2)
    return part


@triton.jit
def _load_w(w_ptrs, u_ptrs, mask_n, offs_k, k0, K, GATED: tl.constexpr):
    """Weight (and, GATED, up) tile of K columns ``k0 .. k0 + BLOCK_K``; masked lanes
    (past ``N`` or ``K``) read 0 and move no bytes."""
    w_mask = mask_n[:, None] & ((offs_k + k0) < K)[None, :]
    w_tile = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
    if GATED:
        u_tile = tl.load(u_ptrs + k0, mask=w_mask, other=0.0)
    else:
        u_tile = w_tile
    return w_tile, u_tile


@triton.jit
def _prefetch_rows_l2(w_ptr, row0, k0, rows_end, K, BLOCK_N: tl.constexpr, LINES: tl.constexpr,
                      LINE_ELEMS: tl.constexpr):
    """Hint the L2 to fetch ``LINES`` 128-byte lines (``LINE_ELEMS`` elements each) of weight
    rows ``row0 .. row0 + BLOCK_N`` from column ``k0`` on (`attnserve.models.layers.l2_prefetch`).
    Rows and columns are clamped into the ``[rows_end, K]`` tensor, so every address is valid
    and repeats are harmless. Reads no activation, writes nothing, changes no value."""
    rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), rows_end - 1)
    cols = tl.minimum(k0 + tl.arange(0, LINES) * LINE_ELEMS, K - 1)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_slice_l2(w_ptr, row0, k0, N, K, BLOCK_N: tl.constexpr, LINES: tl.constexpr,
                       LINE_ELEMS: tl.constexpr, GATED: tl.constexpr):
    """`_prefetch_rows_l2` of a program's rows, and (GATED) of its up rows ``N + row0 ..``."""
    _prefetch_rows_l2(w_ptr, row0, k0, N, K, BLOCK_N, LINES, LINE_ELEMS)
    if GATED:
        _prefetch_rows_l2(w_ptr, N + row0, k0, 2 * N, K, BLOCK_N, LINES, LINE_ELEMS)


@triton.jit
def _step(acc, acc_u, x_tile, w_tile, u_tile, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
          DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, GATED: tl.constexpr, DEFER: tl.constexpr):
    """One ``K`` step into the accumulators: DEFER, elementwise float32 products into
    ``[BLOCK_N, BLOCK_K]`` (``x_tile`` ``[BLOCK_N, BLOCK_K]``, the one x row repeated); else `_tile_dot` into ``[BLOCK_M, BLOCK_N]``."""
    if DEFER:
        xf = x_tile.to(tl.float32)
        acc += w_tile.to(tl.float32) * xf
        if GATED:
            acc_u += u_tile.to(tl.float32) * xf
    else:
        acc += _tile_dot(x_tile, w_tile, BLOCK_M, USE_DOT, DOT_PRECISION, DOT_UPCAST)
        if GATED:
            acc_u += _tile_dot(x_tile, u_tile, BLOCK_M, USE_DOT, DOT_PRECISION, DOT_UPCAST)
    return acc, acc_u


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    CARRY: tl.constexpr = False,
    DEFER: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    HAS_SCALE: tl.constexpr = False,
    PREFETCH_LINES: tl.constexpr = 0,
    LINE_ELEMS: tl.constexpr = 64,
):
    """Grid ``(cdiv(N, BLOCK_N),)``; ``y`` is ``[M, N]``.

    Plain (GATED False): ``y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n])``, ``w`` ``[N, K]``,
    ``b`` ``[N]``. Gated: ``y[m, n] = act(g[m, n]) * u[m, n]`` with ``g = x @ w[:N]^T
    (+ b[:N])`` and ``u = x @ w[N:]^T (+ b[N:])``: ``w`` ``[2N, K]`` (gate rows then up
    rows), ``b`` ``[2N]``; ``ACT`` 0 SiLU, 1 GELU (tanh form), unused when not GATED.

    ``x`` ``[M, K]`` rows ``stride_xm`` apart (unit stride along K); ``w`` contiguous; ``b``
    read only when HAS_BIAS; ``y`` rows ``stride_ym`` apart, unit column stride. Requires
    ``M <= BLOCK_M``; DEFER requires ``BLOCK_M == 1`` and not USE_DOT.

    CARRY: the weight tile of step ``i + 1`` is loaded before step ``i``'s product (held in
    registers across the loop), so every program keeps a tile in flight while it
    multiplies. DEFER: see the module doc. USE_PDL (programmatic dependent launch,
    `attnserve.pdl`): the program first lets the next kernel launch, then
    (CARRY) loads its first weight tile, then waits for the previous kernel before it reads
    ``x``; nothing activation-dependent is read and nothing is written before the wait.
    PREFETCH_LINES (> 0 only with USE_PDL): before the wait the program also hints the L2 to
    fetch that many lines (``LINE_ELEMS`` elements each) of each of its weight rows, from the
    column after its first tile (`attnserve.models.layers.l2_prefetch`); no value changes.
    """
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if DEFER:
        # x (one row) loaded in the weight tile's shape and layout: each lane reads the x
        # values its weight values meet (L1 hits), with no per-step layout conversion
        # through shared memory (a [1, BLOCK_K] tile broadcast over the rows needs one)
        x_ptrs = x_ptr + tl.zeros((BLOCK_N, 1), dtype=tl.int32) + offs_k[None, :]
        x_rows = mask_n
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x_rows = mask_m
    rows = offs_n.to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]
    u_ptrs = w_ptr + (rows + N)[:, None] * K + offs_k[None, :]  # up rows (GATED only)
    if DEFER:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if CARRY:
        w_tile, u_tile = _load_w(w_ptrs, u_ptrs, mask_n, offs_k, 0, K, GATED)
        if USE_PDL:
            if PREFETCH_LINES > 0:
                _prefetch_slice_l2(w_ptr, pid * BLOCK_N, BLOCK_K, N, K, BLOCK_N, PREFETCH_LINES, LINE_ELEMS, GATED)
            gdc_wait()
        for k0 in range(0, K, BLOCK_K):
            k_mask = (offs_k + k0) < K
            x_tile = tl.load(x_ptrs + k0, mask=x_rows[:, None] & k_mask[None, :], other=0.0)
            # the next step's tile (all lanes masked past K: no bytes) before this product
            w_next, u_next = _load_w(w_ptrs, u_ptrs, mask_n, offs_k, k0 + BLOCK_K, K, GATED)
            acc, acc_u = _step(acc, acc_u, x_tile, w_tile, u_tile, BLOCK_M, USE_DOT, DOT_PRECISION, DOT_UPCAST,
                               GATED, DEFER)
            w_tile = w_next
            u_tile = u_next
    else:
        if USE_PDL:
            if PREFETCH_LINES > 0:
                _prefetch_slice_l2(w_ptr, pid * BLOCK_N, 0, N, K, BLOCK_N, PREFETCH_LINES, LINE_ELEMS, GATED)
            gdc_wait()
        for k0 in range(0, K, BLOCK_K):
            k_mask = (offs_k + k0) < K
            x_tile = tl.load(x_ptrs, mask=x_rows[:, None] & k_mask[None, :], other=0.0)
            w_mask = mask_n[:, None] & k_mask[None, :]
            w_tile = tl.load(w_ptrs, mask=w_mask, other=0.0)
            u_tile = w_tile
            if GATED:
                u_tile = tl.load(u_ptrs, mask=w_mask, other=0.0)
                u_ptrs += BLOCK_K
            acc, acc_u = _step(acc, acc_u, x_tile, w_tile, u_tile, BLOCK_M, USE_DOT, DOT_PRECISION, DOT_UPCAST,
                               GATED, DEFER)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if DEFER:
        out = tl.sum(acc, axis=1)[None, :]
        out_u = tl.sum(acc_u, axis=1)[None, :]
    else:
        out = acc
        out_u = acc_u
    if HAS_SCALE:
        out *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        if GATED:
            out_u *= tl.load(s_ptr + N + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            out_u += tl.load(b_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        out = _gate_act(out, ACT) * out_u
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
