"""MLA decode stage 1 for many heads on Hopper: warp-specialized "seesaw" Gluon kernel.

Same math, grid, split scheme, workspace and outputs as ``_mla_decode_stage1`` in
`mla_decode_triton` (the merge, stage 2, is `mla_common`'s). One program holds 64 heads of one
request and one KV split; it walks the split in pairs of 64-token blocks. Three partitions
(Gluon ``warp_specialize``):

* ``wg0`` (default partition, 4 warps) owns the left half of the output, ``O_L`` =
  columns 0..255 of ``[64, 512]`` (128 fp32 registers per thread), and computes the scores
  of the even block of each pair;
* ``wg1`` (worker, 4 warps) owns ``O_R`` (columns 256..511) and the odd block's scores;
* ``loader`` (worker, 1 warp) issues the TMA copies, one per 64-column chunk of a block
  (9 chunks: c_kv 0..7, k_pe 8) in three groups (c_kv 0..3, c_kv 4..7, k_pe), each group
  as soon as its last reader released it (one "free" and one "ready" mbarrier per group).

Per pair (blocks ``B0`` in buffer 0, ``B1`` in buffer 1; ``m`` the running row max, kept
identical in both warpgroups; all scores in log2 units):

1. wg0: ``S0 = q @ B0^T`` (N=64 wgmmas); ``m0 = max(m, rowmax S0)``, ``a0 = 2^(m - m0)``,
   ``P0 = 2^(S0 - m0)``; publishes ``P0`` (bf16, own buffer), ``m0``, ``a0``;
   ``O_L = O_L * a0 + P0 @ B0[:, :256]`` (P0 from registers).
2. wg1 (``S1 = q @ B1^T``, issued once wg0's ``S0`` is done so that wg0's softmax runs
   under it): ``O_R = O_R * a0 + P0 @ B0[:, 256:]``
   (P0 from shared memory, asynchronous) while ``m1 = max(m0, rowmax S1)``, ``a1 = 2^(m0 -
   m1)``, ``P1 = 2^(S1 - m1)``; publishes ``P1`` (into B1's k_pe chunk, no longer needed),
   ``m1``, ``a1``; then ``O_R = O_R * a1 + P1 @ B1[:, 256:]``.
3. wg0: ``O_L = O_L * a1 + P1 @ B1[:, :256]``; ``m = m1``.

Row sums are kept per warpgroup (``l0``, ``l1`` rescaled by both ``a0`` and ``a1``) and
exchanged once at the end; each warpgroup then normalizes and stores its own output half
(wg0 also the LSE), so the two halves are written concurrently. Each warpgroup computes a
whole block's scores with N=64 wgmmas and the two warpgroups alternate their softmax with
each other's matmuls. This is the schedule
of FlashMLA's sm90 decode kernel ("seesaw"; github.com/deepseek-ai/FlashMLA,
docs/20250422-new-kernel-deep-dive.md; read for the algorithm, not copied), with one
change: wg1 folds ``P0`` in before its own block (rescaling ``O_R`` twice) so that B0's
right half is released early.

Shared memory: q ``[64, 576]`` + two blocks ``[64, 576]`` + ``P0`` ``[64, 64]`` (bf16):
229,376 B plus barriers. The split's partial last block is loaded whole by TMA (its rows
lie inside the page) and the rows past ``seq_lens`` are zeroed in shared memory by the
warpgroup that owns the block before anyone reads them as V.

One split (``MAX_KV_SPLITS == 1``): every request is written directly (the empty ones get
zeros from `_store_empty`), so `mla_decode.mla_decode_fwd` does not launch the merge.

FP8 cache (``FP8``; `mla_decode.mla_seesaw_fp8_applicable`): the loader partition has 4 warps.
It TMA-loads each fp8 ``[64, 64]`` chunk (4 KB) into the upper half of that chunk's 16-bit
slot (the slots are the same as above: no extra shared memory), waits for it on a "land"
barrier, converts it in place to fp16 (e4m3 / e5m2 -> fp16 is exact) and then arrives the
group's "ready" barrier, which is all the compute warpgroups wait for; their code is the
16-bit kernel's with fp16 operands (bf16 queries are converted with saturation to fp16's
+-65504 when q is loaded; P is fp16). A group (c_kv 0..3, 4..7, k_pe) is converted with one
barrier: all its fp8 bytes loaded into registers (32 a thread for 4 chunks; the converter
runs with 48 registers, warpgroup 1 with 216), then all its 16-bit slots stored; a group is
converted right after the next one is issued, so one copy is in flight while the previous
one is converted. ``out_scale`` (the cache's kv_scale; the host folds it into
``sm_scale_log2`` too) multiplies each output half. H100 (benchmarks/NOTES.md, Session 12):
128 heads bs 32 x 16K ~320 us against ~265 for bf16 (0.8x); 16 heads bs 128 x 4K ~165 us
against ~224 (1.35x).

Needs sm_90, 16-bit queries (and a cache of their dtype, or fp8), kv_lora_rank 512 + rope 64, ``page_size % 64 == 0`` and
TMA-compatible strides (`mla_decode.mla_gluon_applicable`). Gluon is experimental; written
against Triton 3.6 and imported only when used.

Modules: this one holds the kernel (shared memory, barriers, the partition launch), its
register budgets and the host side (`seesaw_descriptor`, `launch_seesaw_stage1`);
`mla_seesaw_warpgroups` the tile geometry, layouts and the two compute warpgroups;
`mla_seesaw_loaders` the 16-bit and fp8 loader partitions.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from attnserve.attention.triton_ops.mla_common import MLAStage1Args, _program_item, _split_bounds
from attnserve.attention.triton_ops.mla_seesaw_loaders import _loader, _loader_fp8
from attnserve.attention.triton_ops.mla_seesaw_warpgroups import BLOCK_H, CHUNK, N_CHUNKS, _store_empty, _wg0, _wg1

__all__ = ["seesaw_descriptor", "launch_seesaw_stage1", "SEESAW_MAXNREG"]

# registers: 12 warps (3 warpgroups, the loader's padded) x 32 x 168 <= 65536 at launch;
# setmaxnreg then gives the loader warpgroup 24 and each compute warpgroup 240.
SEESAW_MAXNREG = 168
WG_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)


@gluon.jit
def _to_mma(x, dtype: gl.constexpr):
    """A query tile in the MMA dtype: as is, or (bf16 queries with an fp8 cache, whose MMA
    dtype is fp16) converted with saturation to fp16's range."""
    if x.dtype == dtype:
        r = x
    else:
        r = gl.minimum(gl.maximum(x.to(gl.float32), -65504.0), 65504.0).to(dtype)
    return r


@gluon.jit(do_not_specialize=["num_heads", "num_splits_scalar"])
def _mla_decode_stage1_seesaw(
    QNope, QPe, KV, desc, desc_unused, BlockTable, SeqLens, NumSplits, Work,
    OPart, LsePart, O, Lse,
    sm_scale_log2, num_heads, num_splits_scalar,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_kv_t, stride_bt_b,
    stride_op_b, stride_op_h, stride_op_s, stride_lp_b, stride_lp_h,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    D_C: gl.constexpr, D_R: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    MAX_KV_SPLITS: gl.constexpr, PER_REQ_SPLITS: gl.constexpr, HAS_LSE: gl.constexpr, WORK_ITEMS: gl.constexpr,
    out_scale=1.0, MMA_DTYPE: gl.constexpr = None, FP8: gl.constexpr = False, WG1_REGS: gl.constexpr = 240,
    LD_REGS: gl.constexpr = 24,
):
    gl.static_assert(D_C == 512 and D_R == 64 and BLOCK_N == 64, "seesaw kernel: 512 + 64 dims, 64-token blocks")
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    dtype: gl.constexpr = MMA_DTYPE

    pid_h = gl.program_id(0)
    b, split_id = _program_item(Work, gl.program_id(1), gl.program_id(2), MAX_KV_SPLITS, WORK_ITEMS)
    kv_len, per_split, n_eff = _split_bounds(SeqLens, NumSplits, b, num_splits_scalar, MAX_KV_SPLITS, BLOCK_N,
                                             PER_REQ_SPLITS)
    start = split_id * per_split
    end = gl.minimum(start + per_split, kv_len)

    if start < end:
        # q and each block as 9 [64, 64] chunks (c_kv 0..7, k_pe 8): 576 is not a power of two
        q_s = (gl.allocate_shared_memory(dtype, [8, BLOCK_H, CHUNK], sw),
               gl.allocate_shared_memory(dtype, [BLOCK_H, CHUNK], sw))
        offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
        offs_k = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, ld))
        mh = (offs_h < num_heads)[:, None]
        for c in gl.static_range(N_CHUNKS - 1):
            x = gl.load(QNope + b * stride_qn_b + offs_h[:, None] * stride_qn_h + c * CHUNK + offs_k[None, :],
                        mask=mh, other=0.0)
            q_s[0].index(c).store(_to_mma(x, dtype))
        x = gl.load(QPe + b * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_k[None, :], mask=mh, other=0.0)
        q_s[1].store(_to_mma(x, dtype))
        kv_s = ((gl.allocate_shared_memory(dtype, [8, BLOCK_N, CHUNK], sw),
                 gl.allocate_shared_memory(dtype, [BLOCK_N, CHUNK], sw)),
                (gl.allocate_shared_memory(dtype, [8, BLOCK_N, CHUNK], sw),
                 gl.allocate_shared_memory(dtype, [BLOCK_N, CHUNK], sw)))
        p0_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], sw)
        xch = (
            gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat),  # m0
            gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat),  # a0
            gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat),  # m1
            gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat),  # a1
            gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat),  # l0
            gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat),  # l1
        )
        ready0 = gl.allocate_shared_memory(gl.int64, [N_CHUNKS, 1], mbarrier.MBarrierLayout())
        ready1 = gl.allocate_shared_memory(gl.int64, [N_CHUNKS, 1], mbarrier.MBarrierLayout())
        one = gl.allocate_shared_memory(gl.int64, [9, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N_CHUNKS):
            mbarrier.init(ready0.index(i), count=1)
            mbarrier.init(ready1.index(i), count=1)
            mbarrier.init(one.index(i), count=1)
        if FP8:  # the fp8 copies complete on "land" barriers; "ready" is arrived after the conversion
            land = (gl.allocate_shared_memory(gl.int64, [N_CHUNKS, 1], mbarrier.MBarrierLayout()),
                    gl.allocate_shared_memory(gl.int64, [N_CHUNKS, 1], mbarrier.MBarrierLayout()))
            for i in gl.static_range(N_CHUNKS):
                mbarrier.init(land[0].index(i), count=1)
                mbarrier.init(land[1].index(i), count=1)
        bars = (ready0, ready1, one.index(0), one.index(1), one.index(2), one.index(3), one.index(4),
                one.index(5), one.index(6), (one.index(7), one.index(8)))
        fence_async_shared()
        gl.thread_barrier()
        table = BlockTable + b * stride_bt_b
        out_args = (b, pid_h, split_id, n_eff, num_heads, O, OPart, LsePart, Lse, stride_o_b, stride_o_h,
                    stride_op_b, stride_op_h, stride_op_s, stride_lp_b, stride_lp_h, stride_lse_b, stride_lse_h)
        if FP8:
            gl.warp_specialize([
                (_wg0, (q_s, kv_s, p0_s, xch, bars, start, end, sm_scale_log2, out_args, out_scale, HAS_LSE, True)),
                (_wg1, (q_s, kv_s, p0_s, xch, bars, start, end, sm_scale_log2, out_args, out_scale, True)),
                (_loader_fp8, (kv_s, bars, land, start, end, desc, table, PAGE_SIZE)),
            ], [4, 4], [WG1_REGS, LD_REGS])
        else:
            gl.warp_specialize([
                (_wg0, (q_s, kv_s, p0_s, xch, bars, start, end, sm_scale_log2, out_args, out_scale, HAS_LSE, False)),
                (_wg1, (q_s, kv_s, p0_s, xch, bars, start, end, sm_scale_log2, out_args, out_scale, False)),
                (_loader, (kv_s, bars, start, end, desc, table, PAGE_SIZE)),
            ], [4, 1], [WG_REGS, LOADER_REGS])
    elif MAX_KV_SPLITS == 1:
        if kv_len == 0 and split_id == 0:  # (an unused work-list entry has split_id 1)
            _store_empty(b, pid_h, num_heads, O, Lse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, HAS_LSE)


def seesaw_descriptor(kv_rows):
    """Host TMA descriptor of the latent pool rows ``kv_rows`` ``[num_slots, 576]`` for
    `_mla_decode_stage1_seesaw`: ``[64, 64]`` boxes (one 64-column chunk of a 64-token
    block). 16-bit rows: 128-byte swizzled as the kernel's shared-memory chunks; fp8 rows
    (`mla_common.MLA_FP8_DTYPES`): 64-byte swizzled as the kernel's staging areas."""
    bits = 8 * kv_rows.element_size()
    sw = gl.NVMMASharedLayout(swizzle_byte_width=128 if bits == 16 else 64, element_bitwidth=bits, rank=2)
    return TensorDescriptor(kv_rows, list(kv_rows.shape), [kv_rows.stride(0), 1], [64, 64], sw)


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# fp8 variant: registers per warpgroup (default 240 / wg1 / the 4-warp loader-converter);
# 12 warps x 168 at launch = 504 a thread's worth over the three warpgroups. The converter
# holds a whole group's fp8 bytes (32 registers) and spills at 24 or 32; wg1 at 216 spills a
# few registers inside its loop and is still faster overall (benchmarks/NOTES.md, Session 12)
SEESAW_FP8_REGS = (216, 48)


def launch_seesaw_stage1(args: MLAStage1Args, grid: tuple, constexprs: dict, out_scale: float = 1.0) -> None:
    """Launch `_mla_decode_stage1_seesaw` over ``args`` (``desc_c`` from `seesaw_descriptor`,
    ``desc_r`` unused). ``constexprs`` as for every stage-1 kernel; its ``num_warps`` /
    ``num_stages`` are replaced: 4 warps for the default partition (the kernel adds 4 + 1
    worker warps, 4 + 4 for an fp8 cache), one stage, ``maxnreg`` `SEESAW_MAXNREG`.

    An fp8 ``args.kv`` (e4m3fn / e5m2) runs the fp8 variant: fp16 MMAs (bf16 queries are
    converted with saturation to +-65504), ``out_scale`` (the cache's kv_scale; the caller
    folds it into ``args.sm_scale_log2`` too) multiplies each normalised output. A 16-bit
    cache must have the queries' dtype and ignores ``out_scale`` (it must be 1.0)."""
    fp8 = args.kv.element_size() == 1
    q_dtype = args.q_nope.dtype
    if q_dtype not in _GL_DTYPES:
        raise ValueError(f"seesaw stage 1 needs fp16/bf16 queries, got {q_dtype}")
    if not fp8 and (args.kv.dtype != q_dtype or float(out_scale) != 1.0):
        raise ValueError("a 16-bit cache must have the queries' dtype and out_scale 1.0")
    mma = gl.float16 if fp8 else _GL_DTYPES[q_dtype]
    wg1_regs, ld_regs = SEESAW_FP8_REGS if fp8 else (240, 24)
    _mla_decode_stage1_seesaw[grid](*args, out_scale=float(out_scale), MMA_DTYPE=mma, FP8=fp8, WG1_REGS=wg1_regs,
                                    LD_REGS=ld_regs, maxnreg=SEESAW_MAXNREG,
                                    **dict(constexprs, num_warps=4, num_stages=1))
