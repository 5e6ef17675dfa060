"""Launchers of the FP8 Triton kernels (`fp8_kernels_triton`), with PyTorch fallbacks.

* `quantize_activation` -- dynamic e4m3 quantisation of ``x [M, K]``, per token or per
  ``1 x group`` run (one launch; no host synchronisation, CUDA-graph capturable);
* `fused_add_rmsnorm_quant_fp8`, `silu_and_mul_quant_fp8` -- the producers of an FP8
  linear's input with the per-token quantisation fused (CUDA / interpreter only);
* `scale_rows_cols` -- an unscaled FP8 product times its token and channel scales (the
  epilogue of a tensor-wise ``_scaled_mm`` run with unit scales);
* `scaled_fp8_gemm` -- ``(A_q * s_a) @ (B_q * s_b)^T`` with per-token or per-group
  activation scales and per-tensor, per-channel or 128 x 128 block weight scales.

Triton is imported lazily, only when a kernel is launched (CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``); CPU tensors otherwise take the PyTorch reference of `fp8_utils`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from attnserve.models.layers.quantization.fp8_utils import (
    BLOCK_SIZE,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    SCALE_MIN,
    cdiv,
    dequantize,
    quantize_per_group,
    quantize_per_row,
)
from attnserve.triton_env import triton_interpreting

#: widest ``I`` (columns of ``silu(gate) * up``) that `silu_and_mul_quant_fp8` quantises in one
#: pass with the row in registers (Llama-3-8B's 14,336 fits; Llama-3-70B's 28,672 takes two)
SILU_QUANT_ONE_PASS_MAX = 16384


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and triton_interpreting())


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def quantize_activation(x: torch.Tensor, group: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic e4m3 quantisation of activations.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, unit stride along ``K``.
        group: None: one scale per row (token); else one per ``1 x group`` run of a row.

    Returns:
        ``(q, s)``: e4m3 ``q [M, K]`` and float32 ``s`` ``[M, 1]`` (per token) or
        ``[M, cdiv(K, group)]``, with ``x ~= q * s``.

    Raises:
        ValueError: ``x`` not 2-D or ``group < 1``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_activation: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if group is not None and group < 1:
        raise ValueError(f"quantize_activation: group must be >= 1, got {group}")
    m, k = x.shape
    if not _use_triton(x):
        if group is None:
            q, s = quantize_per_row(x)
            return q, s.unsqueeze(1)
        return quantize_per_group(x, group)
    if x.stride(1) != 1:
        x = x.contiguous()
    g = k if group is None else group
    n_groups = cdiv(k, g)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    from attnserve.models.layers.quantization import fp8_kernels_triton as kt

    block = min(_next_pow2(g), 4096)
    kt._act_quant_kernel[(m, n_groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), GROUP=g, BLOCK=block,
                                        FP8_MAX=FP8_E4M3_MAX, EPS=SCALE_MIN * FP8_E4M3_MAX,
                                        num_warps=4 if block <= 1024 else 8)
    return q, s


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile sizes of `scaled_fp8_gemm` (``block_k`` is the scale group along ``K``)."""

    block_m: int
    block_n: int
    block_k: int = BLOCK_SIZE
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def fp8_gemm_config(m: int, n: int, k: int) -> Fp8GemmConfig:
    """Default tiles: 16 x 64 for decode-sized ``M <= 16``, 64 x 64 up to 64 rows, else
    128 x 128 with 8 warps (not tuned beyond a first H100 check)."""
    if m <= 16:
        return Fp8GemmConfig(16, 64, num_warps=4, num_stages=4)
    if m <= 64:
        return Fp8GemmConfig(64, 64, num_warps=4, num_stages=4)
    return Fp8GemmConfig(128, 128, num_warps=8, num_stages=3)


def _weight_scale_layout(b_s: torch.Tensor, n: int, k: int, block_k: int) -> Tuple[int, int, int]:
    """``(GROUP_N, stride_bs_n, stride_bs_k)`` of a weight scale tensor."""
    if b_s.numel() == 1:
        return 1, 0, 0
    if b_s.dim() == 1 or (b_s.dim() == 2 and b_s.shape[1] == 1 and b_s.shape[0] == n):
        if b_s.shape[0] != n:
            raise ValueError(f"scaled_fp8_gemm: per-channel weight scale has {b_s.shape[0]} rows, weight {n}")
        return 1, b_s.stride(0), 0
    gn = cdiv(n, b_s.shape[0])
    if b_s.dim() != 2 or b_s.shape[1] != cdiv(k, block_k) or cdiv(n, gn) != b_s.shape[0]:
        raise ValueError(f"scaled_fp8_gemm: weight scale {tuple(b_s.shape)} fits no layout of weight [{n}, {k}]")
    return BLOCK_SIZE, b_s.stride(0), b_s.stride(1)


def scaled_fp8_gemm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                    out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                    config: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """``C = (A_q * s_a) @ (B_q * s_b)^T (+ bias)``, float32 accumulation, in ``out_dtype``.

    Args:
        a_q: e4m3 ``[M, K]`` (unit stride along ``K``).
        a_s: float32 ``[M, 1]`` (per token) or ``[M, cdiv(K, 128)]`` (per ``1 x 128`` group).
        b_q: e4m3 ``[N, K]`` contiguous.
        b_s: float32 scalar (per tensor), ``[N]`` (per channel) or ``[cdiv(N, 128), cdiv(K, 128)]``.
        out_dtype: dtype of ``C``.
        bias: optional ``[N]``.
        config: tiles; default `fp8_gemm_config`.

    Returns:
        new ``[M, N]`` tensor. Without Triton (CPU, no interpreter): the dequantised float32
        product (`fp8_utils.dequantize`).

    Raises:
        ValueError: shapes that do not fit each other.
    """
    m, k = a_q.shape
    n = b_q.shape[0]
    if b_q.shape[1] != k:
        raise ValueError(f"scaled_fp8_gemm: A {tuple(a_q.shape)} and B {tuple(b_q.shape)} differ in K")
    if a_s.shape[0] != m or a_s.shape[1] not in (1, cdiv(k, BLOCK_SIZE)):
        raise ValueError(f"scaled_fp8_gemm: activation scale {tuple(a_s.shape)} does not fit A {tuple(a_q.shape)}")
    group_n, sbn, sbk = _weight_scale_layout(b_s, n, k, BLOCK_SIZE)
    if not _use_triton(a_q):
        a = dequantize(a_q, a_s, block=None if a_s.shape[1] == 1 else (1, BLOCK_SIZE))
        if group_n == BLOCK_SIZE:
            w = dequantize(b_q, b_s, block=(BLOCK_SIZE, BLOCK_SIZE))
        else:
            w = dequantize(b_q, b_s)
        out = a @ w.t()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    if a_q.stride(1) != 1:
        a_q = a_q.contiguous()
    b_q = b_q.contiguous()
    cfg = config or fp8_gemm_config(m, n, k)
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return c
    from attnserve.models.layers.quantization import fp8_kernels_triton as kt

    interpret = a_q.device.type == "cpu"
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    kt._scaled_fp8_gemm_kernel[grid](
        a_q, b_q, c, a_s, b_s, bias if bias is not None else c,
        m, n, k, a_q.stride(0), b_q.stride(0), c.stride(0),
        a_s.stride(0), 0 if a_s.shape[1] == 1 else a_s.stride(1), sbn, sbk,
        GROUP_N=group_n, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None, UPCAST=interpret,
        num_warps=cfg.num_warps, num_stages=1 if interpret else cfg.num_stages,
    )
    return c


def fused_add_rmsnorm_quant_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                weight_offset: float = 0.0, row_scale: Optional[torch.Tensor] = None,
                                col_scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` in place, then `quantize_activation` of ``rmsnorm(residual)``, in
    one launch (`fused_kernels.fused_add_rmsnorm` followed by `quantize_activation`, with
    the same roundings: the sum and the normalised row are rounded to ``residual``'s dtype
    before they are used).

    Args:
        x, residual: ``[M, N]`` float16/bfloat16/float32 of one dtype, unit stride along
            ``N``; ``residual`` is overwritten.
        weight: ``[N]`` norm weight; ``eps``, ``weight_offset`` as `fused_kernels.rmsnorm`.
        row_scale, col_scale: given together (float32, ``M`` and ``N`` values), ``x`` is an
            unscaled FP8 product of any float dtype (a tensor-wise ``_scaled_mm`` with unit
            scales) and is taken as `scale_rows_cols` ``(x, row_scale, col_scale,
            residual.dtype)``, bit for bit, without that launch.

    Returns:
        ``(q [M, N] e4m3, s [M, 1] float32)``.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit (or only one of the scales),
            or a device without Triton (CPU outside the interpreter).
    """
    has_scales = row_scale is not None or col_scale is not None
    if (x.dim() != 2 or x.shape != residual.shape or (x.dtype != residual.dtype and not has_scales)
            or weight.shape != (x.shape[1],)):
        raise ValueError(f"fused_add_rmsnorm_quant_fp8: x {tuple(x.shape)} {x.dtype}, residual "
                         f"{tuple(residual.shape)} {residual.dtype}, weight {tuple(weight.shape)}: need 2-D x and "
                         "residual of one shape and dtype and a [N] weight")
    if has_scales and (row_scale is None or col_scale is None or row_scale.numel() != x.shape[0]
                       or col_scale.numel() != x.shape[1] or row_scale.dtype != torch.float32
                       or col_scale.dtype != torch.float32):
        raise ValueError(f"fused_add_rmsnorm_quant_fp8: row_scale / col_scale must be given together as float32 "
                         f"with {x.shape[0]} and {x.shape[1]} values")
    if x.stride(1) != 1 or residual.stride(1) != 1 or not _use_triton(x):
        raise ValueError("fused_add_rmsnorm_quant_fp8: needs unit stride along N and CUDA (or TRITON_INTERPRET=1)")
    m, n = x.shape
    q = torch.empty((m, n), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    from attnserve.models.layers.quantization import fp8_kernels_triton as kt

    block = _next_pow2(n)
    rs = row_scale.reshape(-1).contiguous() if has_scales else s  # a placeholder pointer when unused
    cs = col_scale.reshape(-1).contiguous() if has_scales else s
    kt._add_rmsnorm_quant_kernel[(m,)](x, residual, weight.contiguous(), q, s, n, x.stride(0), residual.stride(0),
                                       q.stride(0), float(eps), float(weight_offset), rs, cs, BLOCK=block,
                                       FP8_MAX=FP8_E4M3_MAX, EPS=SCALE_MIN * FP8_E4M3_MAX, HAS_SCALES=has_scales,
                                       num_warps=max(1, min(16, block // 512)))  # the unfused norm's warps
    return q, s


def silu_and_mul_quant_fp8(x: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                           row_scale: Optional[torch.Tensor] = None, col_scale: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation` of ``silu(gate) * up`` for ``x [M, 2I]`` = ``[gate | up]``, in
    one launch; the product is rounded to ``out_dtype`` (default ``x``'s) first, as
    `fused_kernels.silu_and_mul` stores it.

    ``row_scale`` (float32, ``M`` values, e.g. ``[M, 1]``) and ``col_scale`` (float32 ``[2I]``),
    given together, say that ``x`` is an unscaled FP8 product (``q_x @ q_w^T`` from a
    tensor-wise ``_scaled_mm`` with unit scales): its entry ``(m, j)`` is multiplied by
    ``row_scale[m] * col_scale[j]`` (float32) before the SiLU-and-mul, which is where a
    row-wise-scaled GEMM would have applied them.

    Returns:
        ``(q [M, I] e4m3, s [M, 1] float32)``.

    Raises:
        ValueError: ``x`` not 2-D with an even number of columns and unit column stride,
            a device without Triton, or only one of the scales / scales of the wrong size.
    """
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1 or not _use_triton(x):
        raise ValueError(f"silu_and_mul_quant_fp8: x {tuple(x.shape)} strides {x.stride()} on {x.device}: need "
                         "2-D [M, 2I] with unit column stride on CUDA (or TRITON_INTERPRET=1)")
    has_scales = row_scale is not None or col_scale is not None
    if has_scales and (row_scale is None or col_scale is None or row_scale.numel() != x.shape[0]
                       or col_scale.numel() != x.shape[1] or row_scale.dtype != torch.float32
                       or col_scale.dtype != torch.float32):
        raise ValueError(f"silu_and_mul_quant_fp8: row_scale / col_scale must be given together as float32 with "
                         f"{x.shape[0]} and {x.shape[1]} values, got "
                         f"{None if row_scale is None else (tuple(row_scale.shape), row_scale.dtype)} / "
                         f"{None if col_scale is None else (tuple(col_scale.shape), col_scale.dtype)}")
    m, i = x.shape[0], x.shape[1] // 2
    q = torch.empty((m, i), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    from attnserve.models.layers.quantization import fp8_kernels_triton as kt

    # Rows up to SILU_QUANT_ONE_PASS_MAX wide stay in registers (one read of x; 16 warps hold
    # 16,384 float32 values as 32 a thread); wider rows take two passes in 4,096 chunks.
    one_pass = i <= SILU_QUANT_ONE_PASS_MAX
    block = _next_pow2(i) if one_pass else 4096
    out_name = str(out_dtype or x.dtype).rsplit(".", 1)[-1]
    rs = row_scale.reshape(-1).contiguous() if has_scales else s  # a placeholder pointer when unused
    cs = col_scale.reshape(-1).contiguous() if has_scales else s
    kt._silu_mul_quant_kernel[(m,)](x, q, s, i, x.stride(0), q.stride(0), rs, cs, OUT_DTYPE=kt.TL_DTYPES[out_name],
                                    BLOCK=block, FP8_MAX=FP8_E4M3_MAX, EPS=SCALE_MIN * FP8_E4M3_MAX,
                                    ONE_PASS=one_pass, HAS_SCALES=has_scales,
                                    num_warps=max(4, min(16, block // 512)) if one_pass else 8)
    return q, s


#: columns per program of `scale_rows_cols`
SCALE_ROWS_COLS_BLOCK = 1024


def scale_rows_cols(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """``x * (row_scale[m] * col_scale[n])`` for an unscaled FP8 product ``x [M, N]`` (float32
    or 16-bit, e.g. ``q_x @ q_w^T`` from a tensor-wise ``_scaled_mm`` with unit scales), in
    float32 and rounded once to ``out_dtype``: what a row-wise-scaled GEMM returns. One
    launch on CUDA (or under ``TRITON_INTERPRET=1``), PyTorch elsewhere.

    Args:
        x: ``[M, N]`` with unit column stride.
        row_scale: float32, ``M`` values (e.g. ``[M, 1]`` per-token scales).
        col_scale: float32, ``N`` values (per-channel weight scales).
        out_dtype: dtype of the result.

    Returns:
        ``[M, N]`` in ``out_dtype``, contiguous.

    Raises:
        ValueError: ``x`` not 2-D with unit column stride, or scales of the wrong size or dtype.
    """
    if x.dim() != 2 or (x.numel() and x.stride(1) != 1):
        raise ValueError(f"scale_rows_cols: x {tuple(x.shape)} strides {x.stride()}: need 2-D with unit column stride")
    m, n = x.shape
    if (row_scale.numel() != m or col_scale.numel() != n or row_scale.dtype != torch.float32
            or col_scale.dtype != torch.float32):
        raise ValueError(f"scale_rows_cols: need float32 row_scale of {m} and col_scale of {n} values, got "
                         f"{tuple(row_scale.shape)} {row_scale.dtype} / {tuple(col_scale.shape)} {col_scale.dtype}")
    if not _use_triton(x):
        return (x.float() * (row_scale.reshape(m, 1) * col_scale.reshape(1, n))).to(out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    from attnserve.models.layers.quantization import fp8_kernels_triton as kt

    kt._scale_rows_cols_kernel[(m, cdiv(n, SCALE_ROWS_COLS_BLOCK))](
        x, row_scale.reshape(-1).contiguous(), col_scale.reshape(-1).contiguous(), y, n, x.stride(0), y.stride(0),
        BLOCK_N=SCALE_ROWS_COLS_BLOCK, num_warps=4)
    return y
