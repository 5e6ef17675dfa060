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

``M`` is not specialised (``do_not_specialize``): every batch size sharing a ``BLOCK_M``
runs the same compiled kernel, so decode batches 2..16 do not each trigger a compile.
Accumulation is float32; the output is converted once to ``y``'s dtype. Weight-row
offsets are formed in int64 (``N * K`` may exceed 2**31 for vocabulary projections).
Loads are converted to float32 before any arithmetic of the non-dot path, which also
keeps interpreter runs on bfloat16 exact (the interpreter handles bf16 as raw bits); for
the same reason the host sets ``DOT_UPCAST`` (float32 operands of ``tl.dot``) there.

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
            part = tl.dot(x_tile, tl.trans(w_tile), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    else:
        xf = x_tile.to(tl.float32)
        wf = w_tile.to(tl.float32)
        if BLOCK_M == 1:
            # [BLOCK_N, BLOCK_K] * [1, BLOCK_K] -> [BLOCK_N] -> [1, BLOCK_N]
            part = tl.sum(wf * xf, axis=1)[None, :]
        else:
            part = tl.sum(xf[:, None, :] * wf[None, :, :], axis=2)
    return part


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
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
):
    """Grid ``(cdiv(N, BLOCK_N),)``; ``y`` is ``[M, N]``.

    Plain (GATED False): ``y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n])``, ``w`` ``[N, K]``,
    ``b`` ``[N]``. Gated: ``y[m, n] = act(g[m, n]) * u[m, n]`` with ``g = x @ w[:N]^T
    (+ b[:N])`` and ``u = x @ w[N:]^T (+ b[N:])``: ``w`` ``[2N, K]`` (gate rows then up
    rows), ``b`` ``[2N]``; ``ACT`` 0 SiLU, 1 GELU (tanh form), unused when not GATED.

    ``x`` ``[M, K]`` rows ``stride_xm`` apart (unit stride along K); ``w`` contiguous; ``b``
    read only when HAS_BIAS; ``y`` rows ``stride_ym`` apart, unit column stride. Requires
    ``M <= BLOCK_M``.
    """
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    rows = offs_n.to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]
    u_ptrs = w_ptr + (rows + N)[:, None] * K + offs_k[None, :]  # up rows (GATED only)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (offs_k + k0) < K
        x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & k_mask[None, :], other=0.0)
        w_mask = mask_n[:, None] & k_mask[None, :]
        w_tile = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if GATED:
            u_tile = tl.load(u_ptrs, mask=w_mask, other=0.0)
        acc += _tile_dot(x_tile, w_tile, BLOCK_M, USE_DOT, DOT_PRECISION, DOT_UPCAST)
        if GATED:
            acc_u += _tile_dot(x_tile, u_tile, BLOCK_M, USE_DOT, DOT_PRECISION, DOT_UPCAST)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = _gate_act(acc, ACT) * acc_u
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
