"""Stage 1 of the paged MLA decode as a Triton kernel (grouped heads, split sequence).

One program owns ``BLOCK_H`` query heads of one request and one split of its sequence,
loads each ``BLOCK_N``-token latent tile once for all its heads, and computes both products
with ``tl.dot`` (the c_kv tile is the key of the first dot and the value of the second); it
writes the split's normalised partial output and log-sum-exp (merged by `mla_common`'s
stage 2), or the output itself when the request has one split. Three launches of the one
kernel: pointer gathers (``"triton"``), TMA descriptor boxes for the mask-free full tiles
(``"tma"``, `MLADecodeConfig.kv_load`, where `mla_tma_applicable` holds), and the fp8 pairs
path below (``"triton_pairs"``).

FP8 cache (`MLA_FP8_DTYPES`): two paths. The byte path: the tiles (pointer gathers or TMA
boxes of 1-byte elements) are converted to the queries' dtype after the load (``CAST_KV``),
the scores' scale carries the cache's kv_scale and the split's output is multiplied by it
(``SCALE_OUT``). Measured on an H100 (Triton 3.6, 2026-11-24, bs 32 x 4K / 16K, 128 heads,
page 64): 228 / 824 us (e4m3) and 208 / 735 us (e5m2) with the default tiles, vs 153 / 547
us for this kernel on a bf16 cache; 16 heads bs 128 x 4K: 417 us (e4m3) / 349 us (e5m2) vs
231 us in bf16. From the sm_90 TTGIR: with TMA (wgmma, 128 heads) the fp8 box goes to shared
memory, back to registers for the conversion and to shared memory again as bf16,
single-buffered; with pointer loads (mma v2, 16 heads) Triton moves the conversion after
the shared-memory round trip and converts the tile twice, once per dot, reading the PV
operand transposed from an 8-bit buffer. The pairs path (``KV_PAIRS``,
`MLADecodeConfig.kv_pairs`, `mla_kv_pairs_applicable`; pointer loads) reads the pool as
int16 pairs of adjacent columns, loads each tile into registers one iteration ahead,
converts it once in registers to fp16 even / odd columns (`decode_attention._fp8_pairs_to_f16`)
and runs fp16 dots on the two halves: H100 (2026-11-25, e4m3, page 64) 16 heads bs 128 x 4K
207 us (16 / 128 / 8 warps) against 410 us for the byte path and 225 us for bf16 in the same
run, 32 heads bs 64 x 8K 284 us (32 / 64 / 8); slower than the fp8 seesaw kernel at 16 to 128 heads
(benchmarks/NOTES.md session 12), so the dispatcher takes it only where that kernel does
not apply. Its per-token cost (~90 cycles a token and SM, the same for e4m3 and e5m2)
comes from 16-row mma.sync tiles: every warp re-reads the 16 x 576 queries from shared
memory for each tile, and one program per SM (bs 128, 1 split) leaves the barrier-separated
phases of a tile (convert and store, QK, two cross-warp reductions, PV) unhidden.

Variant: non-default fields of `MLADecodeConfig` (TMA descriptor loads, peeled tail) switch
stage 1 to its ``PEEL`` loop: the same math, grid and split / merge scheme, with mask-free
full tiles fetched differently (see the dataclass). Note on the many-heads shape, from the
sm_90 code Triton emits for it: the QK dot's result feeds the PV dot, so Triton lays QK out
with all warps along M ([num_warps, 1]); with ``block_h`` 64 and 8 warps both warpgroups
compute the same 64 x ``block_n`` scores (m64n32k16 wgmmas reading q from shared memory
each time) while PV splits the 512 columns between them. That redundant, shared-memory-bound
QK (by a rough estimate 3/4 of the tensor-core time per tile) is a limit the variant does
not remove (nor did a persistent grid, a head loop, lazy rescaling or the loop pipelining
knobs, measured and dropped: benchmarks/NOTES.md "MLA decode"). The FlashMLA-like split
of the tile across warpgroups, which needs explicit layouts, is `mla_decode_gluon`
(``MLADecodeConfig.stage1 = "gluon"``), and the warp-specialized `mla_decode_seesaw` (each
warpgroup a whole block's scores; the many-heads default on sm_90, ``stage1 = "seesaw"``);
a transposed Triton formulation (tokens on the MMA M dimension) was tried and was slower
(255 registers with spills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.triton_ops.decode_attention import _fp8_pairs_to_f16, _saturate_to_f16
from attnserve.attention.triton_ops.mla_common import (
    MLA_FP8_DTYPES,
    MLADecodeConfig,
    MLAStage1Args,
    _program_item,
    _split_bounds,
)

__all__ = ["mla_kv_pairs_applicable", "mla_tma_applicable", "tma_descriptors", "launch_triton_stage1"]

# the dots' operand dtype (the queries'): what an fp8 KV tile is converted to after its load
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _tile_widths(d_c: int, d_r: int) -> tuple:
    """``(BLOCK_C, BLOCK_R)``: the latent and rope widths padded to powers of two (rope >= 16)."""
    return triton.next_power_of_2(d_c), max(16, triton.next_power_of_2(d_r))


def mla_tma_applicable(kv_rows: torch.Tensor, kv_lora_rank: int, page_size: int, block_n: int) -> bool:
    """Whether the TMA variant can load full tiles of ``kv_rows`` ([num_slots, D] view):
    a tile must be ``block_n`` whole rows of one page and every box start 16-byte aligned."""
    elt = kv_rows.element_size()
    return (
        page_size % block_n == 0
        and kv_rows.dim() == 2
        and kv_rows.stride(1) == 1
        and (kv_rows.stride(0) * elt) % 16 == 0
        and (kv_lora_rank * elt) % 16 == 0
        and kv_rows.data_ptr() % 16 == 0
        and kv_rows.shape[0] < 2**31
    )


def tma_descriptors(kv_rows: torch.Tensor, d_c: int, d_r: int, block_n: int) -> tuple:
    """Host TMA descriptors ``(desc_c, desc_r)`` of the pool rows ``kv_rows`` ``[num_slots,
    d_c + d_r]``: ``[block_n, BLOCK_C]`` c_kv boxes and ``[block_n, BLOCK_R]`` k_pe boxes
    (columns past ``d_c`` / ``d_r`` read as zeros). Passed by value: CUDA-graph capturable."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_c, block_r = _tile_widths(d_c, d_r)
    n = kv_rows.shape[0]
    return (TensorDescriptor(kv_rows, [n, d_c], [kv_rows.stride(0), 1], [block_n, block_c]),
            TensorDescriptor(kv_rows[:, d_c:], [n, d_r], [kv_rows.stride(0), 1], [block_n, block_r]))


def mla_kv_pairs_applicable(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor) -> bool:
    """Whether the Triton stage 1 can read the fp8 rows ``kv_rows`` ([num_slots, D_C + D_R],
    `MLA_FP8_DTYPES`) as int16 pairs of adjacent columns (``KV_PAIRS``): a CUDA device of
    compute capability >= 8.9 (``cvt.rn.f16x2.e4m3x2``), fp16/bf16 queries, ``D_C`` and
    ``D_R`` powers of two >= 32 (no padded columns; each dot's K >= 16 pairs), and an even
    row stride and base address (each pair one aligned int16). Not under the interpreter
    (no inline asm there); the caller checks that."""
    if kv_rows.dtype not in MLA_FP8_DTYPES or q_nope.dtype not in (torch.float16, torch.bfloat16):
        return False
    if kv_rows.device.type != "cuda" or torch.cuda.get_device_capability(kv_rows.device) < (8, 9):
        return False
    d_c, d_r = q_nope.shape[2], q_pe.shape[2]
    return (
        all(d >= 32 and d & (d - 1) == 0 for d in (d_c, d_r))
        and kv_rows.dim() == 2 and kv_rows.stride(1) == 1 and kv_rows.stride(0) % 2 == 0 and kv_rows.data_ptr() % 2 == 0
    )


def launch_triton_stage1(args: MLAStage1Args, grid: tuple, constexprs: dict, cfg: MLADecodeConfig, *, use_tma: bool,
                         interpret: bool, out_scale: float = 1.0, kv_pairs: bool = False) -> None:
    """Launch `_mla_decode_stage1` over ``args`` (descriptors from `tma_descriptors` when
    ``use_tma``, else placeholders). ``constexprs``: the values every stage-1 kernel takes
    (dims, ``BLOCK_N``, ``PAGE_SIZE``, split mode, launch options). The dots take
    ``input_precision="ieee"`` for fp32 inputs and under the interpreter (which also casts
    the operands to fp32), else ``"tf32"`` (no effect on 16-bit operands).

    An fp8 pool (``args.kv`` of `MLA_FP8_DTYPES`) has each loaded tile converted to the
    dots' dtype (the queries', fp32 under the interpreter; exact for both formats) before
    ``tl.dot``. ``out_scale`` != 1.0 multiplies each split's normalised output (before the
    merge, or the output itself for a one-split request) by it: the cache's ``kv_scale``
    (the scores' share of it is folded into ``args.sm_scale_log2`` by the caller). At 1.0
    (the default) neither the conversion nor the multiply is compiled in for a 16-bit pool.

    ``kv_pairs`` (an fp8 pool where `mla_kv_pairs_applicable` holds; pointer loads only,
    ``use_tma`` False): the pool is passed viewed as int16 and stage 1 runs its ``KV_PAIRS``
    path (tiles converted to fp16 in registers, fp16 dots; see the kernel)."""
    block_c, block_r = _tile_widths(args.q_nope.shape[2], args.q_pe.shape[2])
    fp32_dot = interpret or args.q_nope.dtype == torch.float32
    kv_fp8 = args.kv.dtype in MLA_FP8_DTYPES
    e5m2 = kv_pairs and args.kv.dtype == torch.float8_e5m2
    if kv_pairs:  # two fp8 values of adjacent columns per int16 element; strides in int16 units
        args = args._replace(kv=args.kv.view(torch.int16), stride_kv_t=args.stride_kv_t // 2)
    _mla_decode_stage1[grid](
        *args, out_scale=float(out_scale), BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_H=cfg.block_h, DOT_FP32=interpret,
        DOT_PRECISION="ieee" if fp32_dot else "tf32", PEEL=cfg.is_variant, USE_TMA=use_tma and not kv_pairs,
        CAST_KV=(interpret or kv_fp8) and not kv_pairs,
        DOT_DTYPE=tl.float32 if interpret else _TL_DTYPES[args.q_nope.dtype],
        SCALE_OUT=float(out_scale) != 1.0, KV_PAIRS=kv_pairs, E5M2=e5m2, **constexprs,
    )


@triton.jit
def _load_q(QNope, QPe, b, offs_h, mask_h, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
               D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
               DOT_FP32: tl.constexpr):
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    qn = tl.load(QNope + b * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_c[None, :],
                 mask=mask_h[:, None] & (offs_c < D_C)[None, :], other=0.0)
    qp = tl.load(QPe + b * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_r[None, :],
                 mask=mask_h[:, None] & (offs_r < D_R)[None, :], other=0.0)
    if DOT_FP32:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)
    return qn, qp


@triton.jit
def _load_kv_ptr(KV, table, n0, end, stride_kv_t,
                    D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, CAST_KV: tl.constexpr,
                    DOT_DTYPE: tl.constexpr):
    """One [BLOCK_N, BLOCK_C] c_kv and [BLOCK_N, BLOCK_R] k_pe tile through pointers,
    converted to DOT_DTYPE when CAST_KV (an fp8 pool, or fp32 under the interpreter).

    MASKED=False: every token n0 .. n0 + BLOCK_N - 1 is valid (no row mask at all)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_n = offs_n < end
    if PAGE_SIZE % BLOCK_N == 0:
        # the tile is BLOCK_N consecutive rows of one page (n0 is a multiple of BLOCK_N)
        if MASKED:  # n0 may be past the end (a prefetch): no table entry to read then
            page = tl.load(table + n0 // PAGE_SIZE, mask=n0 < end, other=0).to(tl.int64)
        else:
            page = tl.load(table + n0 // PAGE_SIZE).to(tl.int64)
        slot = page * PAGE_SIZE + (n0 % PAGE_SIZE) + tl.arange(0, BLOCK_N)
    else:
        if MASKED:
            page = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        else:
            page = tl.load(table + offs_n // PAGE_SIZE).to(tl.int64)
        slot = page * PAGE_SIZE + (offs_n % PAGE_SIZE)
    row = KV + slot * stride_kv_t
    if MASKED:
        if BLOCK_C == D_C:
            ckv = tl.load(row[:, None] + offs_c[None, :], mask=mask_n[:, None], other=0.0)
        else:
            ckv = tl.load(row[:, None] + offs_c[None, :], mask=mask_n[:, None] & (offs_c < D_C)[None, :], other=0.0)
        if BLOCK_R == D_R:
            kpe = tl.load(row[:, None] + D_C + offs_r[None, :], mask=mask_n[:, None], other=0.0)
        else:
            kpe = tl.load(row[:, None] + D_C + offs_r[None, :], mask=mask_n[:, None] & (offs_r < D_R)[None, :],
                          other=0.0)
    else:
        if BLOCK_C == D_C:
            ckv = tl.load(row[:, None] + offs_c[None, :])
        else:
            ckv = tl.load(row[:, None] + offs_c[None, :], mask=(offs_c < D_C)[None, :], other=0.0)
        if BLOCK_R == D_R:
            kpe = tl.load(row[:, None] + D_C + offs_r[None, :])
        else:
            kpe = tl.load(row[:, None] + D_C + offs_r[None, :], mask=(offs_r < D_R)[None, :], other=0.0)
    if CAST_KV:
        ckv = ckv.to(DOT_DTYPE)
        kpe = kpe.to(DOT_DTYPE)
    return ckv, kpe


@triton.jit
def _load_kv_tma(desc_c, desc_r, table, n0, PAGE_SIZE: tl.constexpr, CAST_KV: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A full tile through the TMA descriptors (needs PAGE_SIZE % BLOCK_N == 0): rows
    page * PAGE_SIZE + n0 % PAGE_SIZE .. + BLOCK_N of the pool; columns past D_C / D_R of
    the descriptors' shapes are zero-filled by the hardware. Converted as `_load_kv_ptr`."""
    page = tl.load(table + n0 // PAGE_SIZE)
    row0 = page * PAGE_SIZE + n0 % PAGE_SIZE
    ckv = desc_c.load([row0, 0])
    kpe = desc_r.load([row0, 0])
    if CAST_KV:
        ckv = ckv.to(DOT_DTYPE)
        kpe = kpe.to(DOT_DTYPE)
    return ckv, kpe


@triton.jit
def _softmax_update(qk, m_i, l_i, offs_n, end, sm_scale_log2, MASKED: tl.constexpr):
    """Online-softmax bookkeeping of one tile's raw scores ``qk`` [BLOCK_H, BLOCK_N]:
    ``(m_new, l_new, alpha, p)`` (log2 domain; ``alpha`` rescales the accumulators)."""
    s = qk * sm_scale_log2
    if MASKED:
        s = tl.where((offs_n < end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _online_softmax_step(qn, qp, ckv, kpe, m_i, l_i, acc, offs_n, end, sm_scale_log2,
               MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax step of one KV tile for a head tile."""
    qk = tl.dot(qn, tl.trans(ckv), input_precision=DOT_PRECISION)
    qk = tl.dot(qp, tl.trans(kpe), acc=qk, input_precision=DOT_PRECISION)
    m_new, l_i, alpha, p = _softmax_update(qk, m_i, l_i, offs_n, end, sm_scale_log2, MASKED)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(ckv.dtype), ckv, acc=acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _q_pairs_f16(q, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """A query tile [BLOCK_H, BLOCK_D] as fp16 ``(even columns, odd columns)``, each
    [BLOCK_H, BLOCK_D / 2]; bf16 values are clamped to fp16's range (+-65504) first."""
    q = _saturate_to_f16(q)
    return tl.split(tl.reshape(q, [BLOCK_H, BLOCK_D // 2, 2]))


@triton.jit
def _pairs_softmax_step(qn_e, qn_o, qp_e, qp_o, ckv, kpe, m_i, l_i, acc_e, acc_o, offs_n, end, sm_scale_log2,
                        MASKED: tl.constexpr, E5M2: tl.constexpr):
    """`_online_softmax_step` for int16-pair tiles of an fp8 pool (``KV_PAIRS``): ``ckv`` /
    ``kpe`` are [BLOCK_N, D / 2] int16 (byte 0: column 2c, byte 1: column 2c + 1), converted
    in registers to fp16 even / odd columns by `_fp8_pairs_to_f16` (exact for e4m3 and
    e5m2); the scores are the sum of four fp16 dots (c_kv and k_pe, even and odd columns,
    with the matching fp16 query halves ``qn_e`` ... ``qp_o``) and the output keeps even and
    odd columns in ``acc_e`` / ``acc_o`` ([BLOCK_H, D_C / 2] fp32). P is rounded to fp16."""
    c_e, c_o = _fp8_pairs_to_f16(ckv, E5M2)
    r_e, r_o = _fp8_pairs_to_f16(kpe, E5M2)
    qk = tl.dot(qn_e, tl.trans(c_e))
    qk = tl.dot(qn_o, tl.trans(c_o), acc=qk)
    qk = tl.dot(qp_e, tl.trans(r_e), acc=qk)
    qk = tl.dot(qp_o, tl.trans(r_o), acc=qk)
    m_new, l_i, alpha, p = _softmax_update(qk, m_i, l_i, offs_n, end, sm_scale_log2, MASKED)
    p16 = p.to(tl.float16)
    acc_e = tl.dot(p16, c_e, acc=acc_e * alpha[:, None])
    acc_o = tl.dot(p16, c_o, acc=acc_o * alpha[:, None])
    return m_new, l_i, acc_e, acc_o


# ints equal to 1 would otherwise become constexprs (Triton specialization)
@triton.jit(do_not_specialize=["num_heads", "num_splits_scalar"])
def _mla_decode_stage1(
    QNope, QPe, KV, DescC, DescR, BlockTable, SeqLens, NumSplits, Work,
    OPart, LsePart, O, Lse,
    sm_scale_log2, num_heads, num_splits_scalar,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_kv_t, stride_bt_b,
    stride_op_b, stride_op_h, stride_op_s, stride_lp_b, stride_lp_h,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    out_scale,
    D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr, PER_REQ_SPLITS: tl.constexpr, HAS_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, PEEL: tl.constexpr, USE_TMA: tl.constexpr,
    WORK_ITEMS: tl.constexpr, CAST_KV: tl.constexpr, DOT_DTYPE: tl.constexpr, SCALE_OUT: tl.constexpr,
    KV_PAIRS: tl.constexpr = False, E5M2: tl.constexpr = False,
):
    """Grid (head tiles, MAX_KV_SPLITS, bs), or (head tiles, W) over a work list
    (WORK_ITEMS, `_program_item`); the head tile is the fastest axis, so the head tiles of
    one (request, split) run together and share each KV tile through L2.

    PEEL=False: every tile of a split is loaded through pointers with a row mask (the
    original kernel). PEEL=True: the split's full ``BLOCK_N`` tiles run mask-free, through
    the host descriptors DescC / DescR when USE_TMA (else pointers; DescC / DescR are
    unused placeholders then), and at most one masked pointer tail tile follows.

    CAST_KV: KV tiles are converted to DOT_DTYPE after the load (an fp8 pool; fp32 under
    the interpreter). SCALE_OUT: the normalised output is multiplied by ``out_scale`` (the
    fp8 cache's kv_scale; the scores' share is in ``sm_scale_log2``); the lse is not.

    KV_PAIRS (an fp8 pool, `mla_kv_pairs_applicable`; pointer loads, PEEL / USE_TMA False):
    ``KV`` / ``stride_kv_t`` address the pool viewed as int16, two fp8 values of adjacent
    columns per element (E5M2: e5m2 values, else e4m3). Every tile is loaded with the row
    mask into registers one iteration ahead (the next tile's loads are in flight during
    this tile's dots; num_stages has no effect), converted once to fp16 even / odd columns
    and stored to shared memory as fp16 for both dots (`_pairs_softmax_step`); the queries
    are converted to fp16 once (bf16 clamped to +-65504) and split the same way."""
    pid_h = tl.program_id(0)
    b, split_id = _program_item(Work, tl.program_id(1), tl.program_id(2), MAX_KV_SPLITS, WORK_ITEMS)

    kv_len, per_split, n_eff = _split_bounds(SeqLens, NumSplits, b, num_splits_scalar, MAX_KV_SPLITS, BLOCK_N,
                                             PER_REQ_SPLITS)
    start = split_id * per_split
    end = tl.minimum(start + per_split, kv_len)

    if start < end:
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_heads
        offs_c = tl.arange(0, BLOCK_C)
        mask_c = offs_c < D_C
        qn, qp = _load_q(QNope, QPe, b, offs_h, mask_h, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
                            D_C, D_R, BLOCK_C, BLOCK_R, DOT_FP32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        table = BlockTable + b * stride_bt_b
        if KV_PAIRS:
            # pair columns: D_C / 2 of c_kv, then D_R / 2 of k_pe (BLOCK_C == D_C, BLOCK_R == D_R)
            qn_e, qn_o = _q_pairs_f16(qn, BLOCK_H, BLOCK_C)
            qp_e, qp_o = _q_pairs_f16(qp, BLOCK_H, BLOCK_R)
            acc_e = tl.zeros([BLOCK_H, BLOCK_C // 2], dtype=tl.float32)
            acc_o = tl.zeros([BLOCK_H, BLOCK_C // 2], dtype=tl.float32)
            # the next tile's loads are issued before this tile's dots (registers, in flight
            # during the step); a tile past the split's end is fully masked (no memory access)
            ckv, kpe = _load_kv_ptr(KV, table, start, end, stride_kv_t, D_C // 2, D_R // 2, BLOCK_C // 2,
                                    BLOCK_R // 2, BLOCK_N, PAGE_SIZE, True, False, DOT_DTYPE)
            for n0 in range(start, end, BLOCK_N):
                ckv_nx, kpe_nx = _load_kv_ptr(KV, table, n0 + BLOCK_N, end, stride_kv_t, D_C // 2, D_R // 2,
                                              BLOCK_C // 2, BLOCK_R // 2, BLOCK_N, PAGE_SIZE, True, False, DOT_DTYPE)
                m_i, l_i, acc_e, acc_o = _pairs_softmax_step(qn_e, qn_o, qp_e, qp_o, ckv, kpe, m_i, l_i, acc_e, acc_o,
                                                             n0 + tl.arange(0, BLOCK_N), end, sm_scale_log2, True,
                                                             E5M2)
                ckv, kpe = ckv_nx, kpe_nx
            acc = tl.reshape(tl.join(acc_e, acc_o), [BLOCK_H, BLOCK_C])  # columns 2c, 2c + 1 back in order
        elif PEEL:
            # full tiles, no masks; then at most one partial tail tile
            full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
            for n0 in tl.range(start, full_end, BLOCK_N):
                if USE_TMA:
                    ckv, kpe = _load_kv_tma(DescC, DescR, table, n0, PAGE_SIZE, CAST_KV, DOT_DTYPE)
                else:
                    ckv, kpe = _load_kv_ptr(KV, table, n0, end, stride_kv_t, D_C, D_R, BLOCK_C, BLOCK_R,
                                            BLOCK_N, PAGE_SIZE, False, CAST_KV, DOT_DTYPE)
                m_i, l_i, acc = _online_softmax_step(qn, qp, ckv, kpe, m_i, l_i, acc, n0, end, sm_scale_log2,
                                                     False, DOT_PRECISION)
            if full_end < end:
                ckv, kpe = _load_kv_ptr(KV, table, full_end, end, stride_kv_t, D_C, D_R, BLOCK_C, BLOCK_R,
                                        BLOCK_N, PAGE_SIZE, True, CAST_KV, DOT_DTYPE)
                m_i, l_i, acc = _online_softmax_step(qn, qp, ckv, kpe, m_i, l_i, acc,
                                                     full_end + tl.arange(0, BLOCK_N), end, sm_scale_log2,
                                                     True, DOT_PRECISION)
        else:
            for n0 in range(start, end, BLOCK_N):
                ckv, kpe = _load_kv_ptr(KV, table, n0, end, stride_kv_t, D_C, D_R, BLOCK_C, BLOCK_R,
                                        BLOCK_N, PAGE_SIZE, True, CAST_KV, DOT_DTYPE)
                m_i, l_i, acc = _online_softmax_step(qn, qp, ckv, kpe, m_i, l_i, acc, n0 + tl.arange(0, BLOCK_N),
                                                     end, sm_scale_log2, True, DOT_PRECISION)

        out = acc / l_i[:, None]
        if SCALE_OUT:
            out = out * out_scale
        lse2 = m_i + tl.log2(l_i)
        mask_hc = mask_h[:, None] & mask_c[None, :]
        if n_eff == 1:
            tl.store(O + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_c[None, :],
                     out.to(O.dtype.element_ty), mask=mask_hc)
            if HAS_LSE:
                tl.store(Lse + b * stride_lse_b + offs_h * stride_lse_h, lse2 / 1.4426950408889634, mask=mask_h)
        else:
            tl.store(OPart + b * stride_op_b + offs_h[:, None] * stride_op_h + split_id * stride_op_s
                     + offs_c[None, :], out, mask=mask_hc)
            tl.store(LsePart + b * stride_lp_b + offs_h * stride_lp_h + split_id, lse2, mask=mask_h)
