"""Fused MoE on Triton: permutation, grouped gate-up GEMM with SiLU-and-mul, grouped down GEMM, top-k sum.

`fused_experts_triton` has the contract of ``native.fused_experts_native`` (see
``moe_interface``): ``hidden_states [T, H]``, ``w13 [E, 2I, H]`` (rows ``[0, I)`` gate,
``[I, 2I)`` up), ``w2 [E, H, I]``, ``topk_weights`` float32 ``[T, top_k]``, ``topk_ids``
int32 ``[T, top_k]`` -> ``[T, H]`` in the hidden dtype, with

    out[t] = sum_j topk_weights[t, j] * (silu(x_t W_g^T) * (x_t W_u^T)) W_2^T   (experts topk_ids[t, j]).

gpt-oss experts (HF ``GptOssExperts``; arXiv:2508.10925) add per-expert biases ``w13_bias``
``[E, 2I]`` / ``w2_bias`` ``[E, H]`` to the two products (float32, in the GEMM epilogues,
after any FP8 scale; ``b_d`` before the routed weight, so it is weighted with the rest of
its expert's output) and replace SiLU-and-mul by ``swigluoai`` (``native.swiglu_oai``).
Both are compile-time flags of the kernel (``HAS_BIAS``, ``ACTIVATION``): the plain SiLU
launch passes neither and compiles the kernel it always did.

Steps (the design of SGLang / vLLM ``fused_moe``, read for facts; our own code):

1. `moe_align_block_size` lists the ``S = T * top_k`` slots grouped by expert, each
   expert's run padded to ``BLOCK_SIZE_M``; ``expert_ids`` gives each block's expert.
   A single token (``T == 1``, decode at batch 1) skips it: its ``top_k`` experts are
   distinct, so each slot is its own block (``SLOT_BLOCKS``) and ``topk_ids`` itself is
   the block-to-expert map -- one launch fewer (Qwen3-30B-A3B shape, batch 1, H100:
   38.6 -> 33.3 µs a layer call, 2026-11-26).
2. `fused_moe_kernel`, gated (gate-up): one program per (M block, column band); it loads
   its block's expert id, gathers the activation rows ``slot // top_k`` and multiplies
   them by ``BLOCK_SIZE_N`` rows of that expert's ``w13`` -- ``BLOCK_SIZE_N / 2`` gate rows
   and the matching up rows, in one ``tl.dot``. The epilogue splits the float32
   accumulator into gate and up halves (reshape / permute / split, as the epilogue
   sub-tiling of Triton's persistent-matmul tutorial) and writes ``silu(g) * u``
   ``[S, I]`` once, rounded to the storage dtype (no ``[S, 2I]`` intermediate).
3. `fused_moe_kernel`, plain (down): rows of that intermediate (slot order) times the
   expert's ``w2``; the epilogue multiplies by the routed weight in float32 and writes
   ``[S, H]`` (top_k = 1: straight into the output).
4. the top-k rows of each token are summed (``torch.sum`` over a ``[T, top_k, H]`` view;
   ATen accumulates 16-bit inputs in float32 and rounds once).

Blocks at or past ``num_tokens_post_padded`` exit at once; padded rows (sentinel ``S``)
load nothing and store nothing. Weight rows past ``N`` are read wrapped (``% N``, always
in bounds, no predicate on the weight stream) and never stored. Offsets are int64.
Accumulation is float32; float32 weights use IEEE dots (no TF32). No host sync, static
shapes, nothing but allocations and launches: CUDA-graph capturable.

FP8 experts (W8A16, issue 37): ``w13`` / ``w2`` may be float8_e4m3fn with float32 scales
(``x ~= q * s``). The kernel loads the e4m3 tile, widens it to the activation dtype (exact:
every e4m3 value is a bfloat16 / float16 value) and multiplies by the scale: per output
channel (``W_SCALE == 1``, ``[E, rows]``) once in the epilogue, before SiLU-and-mul and the
routed weight; per ``128 x 128`` block (``W_SCALE == 2``, ``[E, row blocks, K blocks]``;
DeepSeek-V3's ``weight_scale_inv``) on each K step's partial product, the K tile lying in
one scale block (``BLOCK_K <= 128``). For the gated GEMM the scale rows of gate and up are separate runs (gate blocks
``[0, cdiv(I, 128))``, up blocks after), so ``I`` need not be a multiple of 128.

W8A8 (`fp8_w8a8`: large batches, where the experts are compute bound): both GEMMs' inputs
are quantised to e4m3 first (per token, or per ``1 x 128`` group with block scales), the
dots are e4m3 x e4m3 with float32 accumulation (each K step's product added to the float32
accumulator), and the activation scale joins the weight scale: per token x per channel in
the epilogue, or ``a_scale[m, kb] * w_scale[n block, kb]`` per 128-wide K step. Smaller
batches stay W8A16 (the weight stream is the cost there).

Launch parameters come from `tuned_configs` (tables per shape and device chosen by
``benchmarks/moe_tune.py``; a rule of thumb otherwise). On the CPU the kernels run under
the Triton interpreter (``TRITON_INTERPRET=1``); there ``tl.dot`` gets float32 operands
(``DOT_UPCAST``: the interpreter's dot mishandles 16-bit operands).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Tuple

import torch
import triton
import triton.language as tl

from attnserve.models.layers.moe.align import moe_align_block_size
from attnserve.models.layers.moe.fp8_w8a8 import quantize_moe_activation, use_fp8_w8a8
from attnserve.models.layers.moe.native import SWIGLU_ALPHA, SWIGLU_LIMIT, check_activation, check_biases
from attnserve.models.layers.moe.tuned_configs import FusedMoEConfig, MoEGemmConfig, get_fused_moe_config
from attnserve.triton_env import triton_interpreting

__all__ = ["fused_experts_triton", "fused_moe_kernel", "invoke_fused_moe_kernel"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = torch.float8_e4m3fn
#: weight scale layouts of the kernel (``W_SCALE``)
W_SCALE_NONE, W_SCALE_CHANNEL, W_SCALE_BLOCK = 0, 1, 2


@triton.jit
def _silu(g):
    """``g * sigmoid(g)`` from ``exp(-|g|)`` (in ``(0, 1]``: no overflow), float32."""
    e = tl.exp(-tl.abs(g))
    return g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _swiglu_oai(g, u, alpha: tl.constexpr, limit: tl.constexpr):
    """gpt-oss's clamped SwiGLU, float32: ``(clamp(u, -limit, limit) + 1) * g' sigmoid(alpha g')``,
    ``g' = min(g, limit)`` (``native.swiglu_oai``); the sigmoid from ``exp(-|alpha g'|)``."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    z = g * alpha
    e = tl.exp(-tl.abs(z))
    return (u + 1.0) * (g * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)))


@triton.jit(do_not_specialize=["num_m_blocks", "num_valid_tokens", "group_m", "num_experts"])
def fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_m_blocks, num_valid_tokens, top_k, group_m, num_experts,
    stride_am, stride_be, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SLOT_BLOCKS: tl.constexpr = False,
    b_scale_ptr=None, stride_bse=0, stride_bsn=0, stride_bsk=0,
    W_SCALE: tl.constexpr = 0, SCALE_BLOCK: tl.constexpr = 128,
    a_scale_ptr=None, stride_asm=0, stride_ask=0, A_SCALE: tl.constexpr = 0, FAST_ACCUM: tl.constexpr = False,
    bias_ptr=None, HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = 0,
    SWIGLU_ALPHA: tl.constexpr = 1.702, SWIGLU_LIMIT: tl.constexpr = 7.0,
):
    """Grouped GEMM over the aligned slots. Grid ``(num_m_blocks * cdiv(N, OUT_N),)``.

    ``a`` ``[*, K]`` (row stride ``stride_am``, unit K stride): row ``slot // top_k`` feeds
    slot ``slot``. ``b`` ``[E, rows, K]`` contiguous in K (``stride_be``, ``stride_bn``).
    GATED: ``rows = 2N`` (gate rows then up rows), ``OUT_N = BLOCK_N / 2`` and
    ``c[slot, n] = silu(a_s . b[e, n]) * (a_s . b[e, N + n])``; else ``rows = N``,
    ``OUT_N = BLOCK_N`` and ``c[slot, n] = a_s . b[e, n]``, times
    ``topk_weights[slot]`` (float) when MUL_ROUTED_WEIGHT. ``c`` ``[S, N]`` row stride
    ``stride_cm``. EVEN_K: ``K % BLOCK_K == 0`` (no K masks).

    SLOT_BLOCKS (no alignment): block ``m`` is slot ``m`` alone (row 0 of the tile; the
    other rows are padding), ``expert_ids`` is the flat ``topk_ids`` and
    ``num_m_blocks = S``; ``sorted_token_ids`` / ``num_tokens_post_padded`` are not read.
    Ids outside ``[0, num_experts)`` write nothing.

    W_SCALE (FP8 ``b``, widened to ``a``'s dtype): 1 -- ``b_scale[e, row]`` (strides
    ``stride_bse``, ``stride_bsn``) multiplies the accumulator in the epilogue; 2 --
    ``b_scale[e, row block, k block]`` (``SCALE_BLOCK``-wide blocks, strides ``stride_bse``,
    ``stride_bsn``, ``stride_bsk``; gated: gate row blocks then ``cdiv(N, SCALE_BLOCK)`` up
    row blocks) multiplies each K step's product; needs ``SCALE_BLOCK % BLOCK_K == 0``.

    A_SCALE (W8A8: ``a`` e4m3 too, ``tl.dot`` of e4m3 x e4m3 with float32 accumulation):
    1 -- per-row scales ``a_scale[row]`` (``stride_asm``; with ``W_SCALE == 1``), multiplied
    with the channel scale in the epilogue; each K step's product is added to the float32
    accumulator (promotion every ``BLOCK_K``), or, FAST_ACCUM, accumulated inside the MMA
    (Hopper's reduced-precision FP8 accumulation, as cuBLAS's ``fast_accum``); 2 -- per
    ``1 x SCALE_BLOCK`` group ``a_scale[row, k block]`` (``stride_asm``, ``stride_ask``;
    with ``W_SCALE == 2``), ``a_scale[m, kb] * b_scale[n block, kb]`` on each K step.
    ``row`` is the row of ``a`` the slot reads (``slot // top_k`` gated, else ``slot``).

    HAS_BIAS: ``bias[e, row]`` (contiguous ``[E, rows]``, any float dtype) is added to the
    float32 accumulator after the scales, before the activation (gated) or the routed
    weight (plain). ACTIVATION (gated): 0 -- ``silu(g) * u``; 1 -- ``swigluoai``,
    `_swiglu_oai` with SWIGLU_ALPHA / SWIGLU_LIMIT (gpt-oss).
    """
    OUT_N: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    BIAS_ROWS: tl.constexpr = 2 if GATED else 1  # bias rows per output column
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, OUT_N)
    # grouped order: group_m consecutive M blocks share each column band (L2 reuse)
    num_pid_in_group = group_m * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * group_m
    group_size_m = tl.minimum(num_m_blocks - first_pid_m, group_m)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    if not SLOT_BLOCKS:
        num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
        if pid_m * BLOCK_M >= num_tokens_post_padded:
            return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if SLOT_BLOCKS:
        if (expert < 0) | (expert >= num_experts):
            return
        offs_token = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_valid_tokens)
    else:
        offs_token = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    token_mask = offs_token < num_valid_tokens
    if GATED:
        a_rows = offs_token // top_k
    else:
        a_rows = offs_token
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    j = tl.arange(0, BLOCK_N)
    if GATED:
        col = pid_n * OUT_N + (j % OUT_N)
        w_row = (col % N) + (j // OUT_N) * N  # first half gate rows, second half the matching up rows
    else:
        w_row = (pid_n * BLOCK_N + j) % N
    b_ptrs = b_ptr + expert * stride_be + w_row.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    if W_SCALE == 2:
        if GATED:
            s_row = (col % N) // SCALE_BLOCK + (j // OUT_N) * tl.cdiv(N, SCALE_BLOCK)
        else:
            s_row = w_row // SCALE_BLOCK
        s_ptrs = b_scale_ptr + expert * stride_bse + s_row.to(tl.int64) * stride_bsn
    if A_SCALE != 0:
        as_ptrs = a_scale_ptr + a_rows.to(tl.int64) * stride_asm

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k < K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if A_SCALE != 0:  # W8A8: e4m3 x e4m3
            if DOT_UPCAST:
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            elif FAST_ACCUM:  # the launcher sets it only for A_SCALE == 1 off the interpreter
                acc = tl.dot(a, b, acc)
            else:
                part = tl.dot(a, b, out_dtype=tl.float32)
            if A_SCALE == 2:
                kb = (kk * BLOCK_K) // SCALE_BLOCK
                a_s = tl.load(as_ptrs + kb * stride_ask, mask=token_mask, other=0.0)
                s_blk = tl.load(s_ptrs + kb * stride_bsk)
                acc += part * a_s[:, None] * s_blk[None, :]
            elif not FAST_ACCUM:
                acc += part
        else:  # 16-bit activations (W8A16 or unquantised)
            if W_SCALE != 0:
                b = b.to(a_ptr.dtype.element_ty)  # e4m3 -> 16-bit: exact
            if W_SCALE == 2:
                if DOT_UPCAST:
                    part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(a, b, input_precision=DOT_PRECISION)
                s_blk = tl.load(s_ptrs + ((kk * BLOCK_K) // SCALE_BLOCK) * stride_bsk)
                acc += part * s_blk[None, :]
            elif DOT_UPCAST:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if W_SCALE == 1:
        s_ch = tl.load(b_scale_ptr + expert * stride_bse + w_row.to(tl.int64) * stride_bsn)
        if A_SCALE == 1:
            a_s = tl.load(as_ptrs, mask=token_mask, other=0.0)
            acc = acc * a_s[:, None] * s_ch[None, :]
        else:
            acc = acc * s_ch[None, :]
    if HAS_BIAS:  # one bias per weight row (in bounds: w_row wraps)
        acc += tl.load(bias_ptr + expert * (BIAS_ROWS * N) + w_row.to(tl.int64)).to(tl.float32)[None, :]
    offs_cn = pid_n * OUT_N + tl.arange(0, OUT_N)
    if GATED:
        gu = tl.permute(tl.reshape(acc, (BLOCK_M, 2, OUT_N)), (0, 2, 1))
        g, u = tl.split(gu)
        if ACTIVATION == 1:
            out = _swiglu_oai(g, u, SWIGLU_ALPHA, SWIGLU_LIMIT)
        else:
            out = _silu(g) * u
    else:
        out = acc
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)
        out = out * w.to(tl.float32)[:, None]
    c_ptrs = c_ptr + offs_token.to(tl.int64)[:, None] * stride_cm + offs_cn[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & (offs_cn < N)[None, :])


def invoke_fused_moe_kernel(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    num_valid_tokens: int,
    block_m: int,
    gemm: MoEGemmConfig,
    gated: bool,
    slot_blocks: bool = False,
    w_scale: Optional[torch.Tensor] = None,
    scale_block: Optional[int] = None,
    a_scale: Optional[torch.Tensor] = None,
    fast_accum: bool = False,
    bias: Optional[torch.Tensor] = None,
    activation: str = "silu",
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
) -> None:
    """Launch `fused_moe_kernel` once (no checks; `fused_experts_triton` validates).

    Args:
        a: activations ``[rows, K]``, unit column stride; slot ``s`` reads row ``s // top_k``.
        w: ``[E, 2N, K]`` (gated: gate rows then up rows) or ``[E, N, K]``, contiguous.
        c: output ``[num_valid_tokens, N]``, unit column stride, a's dtype.
        topk_weights: flat float ``[num_valid_tokens]`` routed weights multiplied in the
            epilogue, or None.
        sorted_token_ids, expert_ids, num_tokens_post_padded: `moe_align_block_size`'s
            outputs for ``block_m``.
        top_k: slots per activation row (1 when ``a`` is already in slot order).
        num_valid_tokens: ``S``, the sentinel of ``sorted_token_ids``.
        block_m: the M tile (the alignment's block size).
        gemm: the rest of the launch parameters.
        gated: gate-up with SiLU-and-mul (``N = w.shape[1] / 2``) or plain.
        slot_blocks: no alignment: one block per slot, ``expert_ids`` = the flat int32
            ``topk_ids`` (``sorted_token_ids`` and ``num_tokens_post_padded`` unused).
        w_scale: float32 scales of an e4m3 ``w``: ``[E, rows]`` per channel, or
            ``[E, row blocks, K blocks]`` with ``scale_block`` (``gemm.block_k`` must divide it).
        scale_block: the block edge of block scales (128), None for per-channel scales.
        a_scale: W8A8 (``a`` e4m3, with ``w_scale``): float32 ``[rows, 1]`` per row of ``a``
            (per-channel ``w_scale``) or ``[rows, cdiv(K, scale_block)]`` per 1 x 128 group
            (block ``w_scale``).
        fast_accum: W8A8 per-row scales: accumulate inside the FP8 MMA over the whole K
            (faster on sm 90, reduced precision) instead of adding each K step's product
            to the float32 accumulator. Ignored otherwise and under the interpreter.
        bias: contiguous ``[E, rows]`` (``w``'s rows: gated, gate then up) added to the
            product, or None.
        activation: gated only: ``"silu"`` or ``"swigluoai"`` (with ``swiglu_alpha`` /
            ``swiglu_limit``, compiled in as constants).
    """
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    out_n = gemm.block_n // 2 if gated else gemm.block_n
    num_m_blocks = expert_ids.numel()
    grid = (num_m_blocks * triton.cdiv(n, out_n),)
    interpret = a.device.type == "cpu"
    if w_scale is None:
        w_mode, scale_args = W_SCALE_NONE, (None, 0, 0, 0)
    elif scale_block is None:
        w_mode, scale_args = W_SCALE_CHANNEL, (w_scale, w_scale.stride(0), w_scale.stride(1), 0)
    else:
        w_mode, scale_args = W_SCALE_BLOCK, (w_scale,) + tuple(w_scale.stride())
    if a_scale is None:
        a_mode, a_args = 0, (None, 0, 0)
    else:
        a_mode = 1 if scale_block is None else 2
        a_args = (a_scale, a_scale.stride(0), a_scale.stride(1) if a_mode == 2 else 0)
    fused_moe_kernel[grid](
        a, w, c, topk_weights if topk_weights is not None else c, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_m_blocks, num_valid_tokens, top_k, gemm.group_m, w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        BLOCK_M=block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k,
        GATED=bool(gated), MUL_ROUTED_WEIGHT=topk_weights is not None, EVEN_K=k % gemm.block_k == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", DOT_UPCAST=interpret,
        SLOT_BLOCKS=bool(slot_blocks), b_scale_ptr=scale_args[0], stride_bse=scale_args[1],
        stride_bsn=scale_args[2], stride_bsk=scale_args[3], W_SCALE=w_mode, SCALE_BLOCK=scale_block or 128,
        a_scale_ptr=a_args[0], stride_asm=a_args[1], stride_ask=a_args[2], A_SCALE=a_mode,
        FAST_ACCUM=bool(fast_accum) and a_mode == 1 and not interpret,
        num_warps=gemm.num_warps, num_stages=gemm.num_stages,
        **_epilogue_args(bias, activation, swiglu_alpha, swiglu_limit),
    )


def _epilogue_args(bias: Optional[torch.Tensor], activation: str, alpha: float, limit: float) -> dict:
    """The kernel's bias / activation arguments; none for the plain SiLU variant, so its
    launch (and compiled kernel) is the one it was before biases existed."""
    args = {} if bias is None else {"bias_ptr": bias, "HAS_BIAS": True}
    if activation == "swigluoai":
        args.update(ACTIVATION=1, SWIGLU_ALPHA=float(alpha), SWIGLU_LIMIT=float(limit))
    return args


def _check_scales(w13, w2, w13_scale, w2_scale, block_shape) -> Optional[str]:
    """Why the FP8 scales do not fit ``w13`` / ``w2`` (None when they do, or when the
    weights are not FP8 and no scale is given)."""
    fp8 = (w13.dtype == _FP8, w2.dtype == _FP8)
    if not any(fp8) and w13_scale is None and w2_scale is None:
        return None
    if not all(fp8) or w13_scale is None or w2_scale is None:
        return f"FP8 experts need both weights float8_e4m3fn and both scales; got w13 {w13.dtype}, w2 {w2.dtype}, " \
               f"w13_scale {'set' if w13_scale is not None else 'None'}, w2_scale {'set' if w2_scale is not None else 'None'}"
    e, two_i, h = w13.shape
    inter = two_i // 2
    if block_shape is None:
        want13, want2 = (e, two_i), (e, h)
    else:
        if tuple(block_shape) != (128, 128):
            return f"block_shape {tuple(block_shape)}: only (128, 128) is supported"
        b = block_shape[0]
        want13, want2 = (e, 2 * triton.cdiv(inter, b), triton.cdiv(h, b)), (e, triton.cdiv(h, b), triton.cdiv(inter, b))
    for what, sc, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if tuple(sc.shape) != want or sc.dtype != torch.float32 or not sc.is_contiguous() or sc.device != w13.device:
            return f"{what} must be a contiguous float32 {list(want)} on {w13.device}; got {sc.dtype} " \
                   f"{list(sc.shape)} on {sc.device}"
    return None


def _check(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, block_shape=None,
           w13_bias=None, w2_bias=None) -> None:
    """Raise ValueError naming the first way the inputs break the contract."""
    why = None
    dev = hidden_states.device
    if not (hidden_states.is_cuda or (dev.type == "cpu" and triton_interpreting())):
        why = f"hidden_states is on {dev}; needs CUDA (or CPU under TRITON_INTERPRET=1)"
    elif hidden_states.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        why = f"need hidden_states [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden_states.shape)}, " \
              f"{tuple(w13.shape)}, {tuple(w2.shape)}"
    else:
        t, h = hidden_states.shape
        e, two_i, h13 = w13.shape
        if two_i % 2 or h13 != h or tuple(w2.shape) != (e, h, two_i // 2):
            why = f"shapes hidden_states {tuple(hidden_states.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} " \
                  f"do not match [T, H], [E, 2I, H], [E, H, I]"
        elif (why := _check_scales(w13, w2, w13_scale, w2_scale, block_shape)) is not None:
            pass
        elif hidden_states.dtype not in _DTYPES or (w13.dtype != _FP8 and (
                w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype)):
            why = f"dtypes hidden_states {hidden_states.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: need one of " \
                  f"float16/bfloat16/float32 for all three (or float8_e4m3fn weights with scales)"
        elif w13.device != dev or w2.device != dev or topk_weights.device != dev or topk_ids.device != dev:
            why = "all tensors must be on one device"
        elif not w13.is_contiguous() or not w2.is_contiguous():
            why = "w13 and w2 must be contiguous"
        elif (why := check_biases(w13, w2, w13_bias, w2_bias)) is not None:
            pass
        elif topk_ids.dim() != 2 or topk_ids.shape[0] != t or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            why = f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T={t}, top_k]"
        elif topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool or not topk_weights.dtype.is_floating_point:
            why = f"topk_ids must be integer ({topk_ids.dtype}) and topk_weights floating ({topk_weights.dtype})"
    if why is not None:
        raise ValueError(f"fused_experts_triton: {why}")


def fused_experts_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Optional[Mapping] = None,
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    block_shape: Optional[Tuple[int, int]] = None,
    fp8_w8a8: Optional[bool] = None,
    use_fast_accum: bool = False,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    activation: str = "silu",
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:
    """Routed-expert MLP of a MoE layer: alignment, gate-up, down, top-k sum (no alignment for one token).

    Args:
        hidden_states: ``[T, H]`` float16 / bfloat16 / float32, unit column stride, on CUDA
            (or the CPU under ``TRITON_INTERPRET=1``).
        w13: ``[E, 2I, H]`` contiguous, hidden's dtype: rows ``[0, I)`` gate (HF
            ``gate_proj`` / Mixtral ``w1``), ``[I, 2I)`` up (``up_proj`` / ``w3``).
        w2: ``[E, H, I]`` contiguous (``down_proj`` / ``w2``).
        topk_weights: ``[T, top_k]`` routed weights (float32; any float dtype is read as float32).
        topk_ids: ``[T, top_k]`` expert ids in ``[0, E)`` (int32; other integer dtypes are converted).
        config: launch parameters as a `FusedMoEConfig` dict (nested or flat, see
            `tuned_configs`); None: the tuned table for this shape and device, else the
            default rule. Block scales clamp ``BLOCK_SIZE_K`` to 128.
        w13_scale, w2_scale: FP8 experts (W8A16; ``w13`` and ``w2`` float8_e4m3fn, weight
            ``~= q * scale``): float32 per output channel ``[E, 2I]`` / ``[E, H]``, or with
            ``block_shape`` ``(128, 128)`` block scales ``[E, 2 cdiv(I, 128), cdiv(H, 128)]``
            (gate row blocks, then up row blocks) / ``[E, cdiv(H, 128), cdiv(I, 128)]``.
            The activations are not quantised, except on the W8A8 path (``fp8_w8a8``).
        block_shape: ``(128, 128)`` for block scales, None for per-channel scales.
        fp8_w8a8: FP8 experts only. None: W8A8 -- the inputs of both GEMMs quantised to e4m3
            (per token; per 1 x 128 group with block scales) and e4m3 x e4m3 dots -- when
            `fp8_w8a8.use_fp8_w8a8` says so (mean slots per expert >= 16, tunable), else
            W8A16; True / False force W8A8 / W8A16. The config table and default rule of
            W8A8 are their own (`tuned_configs.default_config_fp8_w8a8`).
        use_fast_accum: W8A8 with per-channel scales: accumulate inside the FP8 MMA over
            all of K (Hopper's reduced-precision accumulation) rather than promoting each
            K step to float32. Default off (as ``torch._scaled_mm``'s ``use_fast_accum``).
        w13_bias, w2_bias: per-expert biases ``[E, 2I]`` (gate then up) / ``[E, H]`` (any
            float dtype; made contiguous), added in float32 in the GEMM epilogues after the
            FP8 scales; ``w2_bias`` before the routed weight multiplies (gpt-oss).
        activation: ``"silu"`` or ``"swigluoai"`` (gpt-oss, with ``swiglu_alpha`` /
            ``swiglu_limit``: ``native.swiglu_oai``), applied where SiLU-and-mul is.

    Returns:
        new ``[T, H]`` tensor in hidden's dtype: ``sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``,
        each GEMM accumulated in float32; the gated intermediate and the per-slot outputs
        are rounded to the storage dtype once each, the top-k sum accumulates in float32.

    Raises:
        ValueError: shapes, dtypes, devices or layouts outside the above, an invalid config,
            ``fp8_w8a8=True`` without FP8 experts or on a device without FP8 tensor cores,
            an unknown activation.
    """
    _check(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape, w13_bias, w2_bias)
    check_activation(activation, swiglu_alpha, swiglu_limit)
    w13_bias = None if w13_bias is None else w13_bias.contiguous()
    w2_bias = None if w2_bias is None else w2_bias.contiguous()
    if fp8_w8a8 and w13_scale is None:
        raise ValueError("fused_experts_triton: fp8_w8a8=True needs FP8 experts (w13_scale / w2_scale)")
    if hidden_states.stride(1) != 1:
        hidden_states = hidden_states.contiguous()
    t, h = hidden_states.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    dtype, dev = hidden_states.dtype, hidden_states.device
    if t == 0 or top_k == 0:
        return torch.zeros((t, h), dtype=dtype, device=dev)
    scale_block = None if block_shape is None or w13_scale is None else int(block_shape[1])
    w8a8 = w13_scale is not None and use_fp8_w8a8(t, top_k, e, dev, fp8_w8a8)
    if config is None:
        cfg = get_fused_moe_config(t, e, inter, h, top_k, dtype, dev, quant="fp8_w8a8" if w8a8 else None,
                                   block_shape=block_shape if w8a8 and scale_block else None)
    elif isinstance(config, FusedMoEConfig):
        cfg = config
    else:
        cfg = FusedMoEConfig.from_dict(config)
    cfg.validate()
    if scale_block is not None and max(cfg.gemm1.block_k, cfg.gemm2.block_k) > scale_block:
        cfg = FusedMoEConfig(cfg.block_m, dataclasses.replace(cfg.gemm1, block_k=min(cfg.gemm1.block_k, scale_block)),
                             dataclasses.replace(cfg.gemm2, block_k=min(cfg.gemm2.block_k, scale_block)))
    s = t * top_k
    slot_blocks = t == 1  # one token: its top_k experts are distinct, so no slot shares a weight tile
    if slot_blocks:
        expert_ids = topk_ids.reshape(-1).to(torch.int32).contiguous()  # no copy for int32 [1, top_k]
        sorted_ids = ntpp = expert_ids  # not read with slot blocks
    else:
        sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, cfg.block_m, e)
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    a1, a1_scale = hidden_states, None
    if w8a8:
        a1, a1_scale = quantize_moe_activation(hidden_states, block_shape if scale_block else None)
    act = torch.empty((s, inter), dtype=dtype, device=dev)
    invoke_fused_moe_kernel(a1, w13, act, None, sorted_ids, expert_ids, ntpp, top_k, s, cfg.block_m,
                            cfg.gemm1, gated=True, slot_blocks=slot_blocks, w_scale=w13_scale, scale_block=scale_block,
                            a_scale=a1_scale, fast_accum=use_fast_accum, bias=w13_bias, activation=activation,
                            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    a2, a2_scale = act, None
    if w8a8:  # the intermediate, rounded to the storage dtype as on the W8A16 path, then quantised
        a2, a2_scale = quantize_moe_activation(act, block_shape if scale_block else None)
    per_slot = torch.empty((s, h), dtype=dtype, device=dev)
    invoke_fused_moe_kernel(a2, w2, per_slot, weights, sorted_ids, expert_ids, ntpp, 1, s, cfg.block_m,
                            cfg.gemm2, gated=False, slot_blocks=slot_blocks, w_scale=w2_scale, scale_block=scale_block,
                            a_scale=a2_scale, fast_accum=use_fast_accum, bias=w2_bias)
    if top_k == 1:
        return per_slot
    return per_slot.view(t, top_k, h).sum(dim=1)
