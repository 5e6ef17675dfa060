"""MLA decode stage 1 for many heads on Hopper, in Triton's Gluon dialect (explicit layouts).

Same math, grid, split scheme and outputs as ``_mla_decode_stage1`` in `mla_decode_triton`
(the merge, stage 2, is `mla_common`'s); see `mla_decode` for the formulas. What differs is
how the work of one 64-head x 64-token tile is laid over the two warpgroups of a program,
which plain Triton does not let us choose (`mla_decode_triton` module note):

* scores ``S = q_nope @ c_kv^T + q_pe @ k_pe^T`` ([64 heads, 64 tokens]) in an MMA layout with
  warps ``[4, 2]``: warpgroup ``w`` computes tokens ``32w .. 32w + 31`` only, so no score is
  computed twice (plain Triton lays this dot out with both warpgroups computing all 64);
* the row max of the online softmax is reduced across the two warpgroups every tile; the
  row sum is kept as a [64, 64] partial and reduced once, after the last tile;
* ``P`` (bf16) goes through shared memory, and ``O += P @ c_kv`` ([64, 512], warps
  ``[4, 2]``) gives each warpgroup 256 of the 512 latent columns (128 fp32 accumulator
  registers per thread);
* schedule: the scores of tile ``i + 1`` are issued asynchronously right behind ``P @ V`` of
  tile ``i``, so the softmax of tile ``i + 1`` starts from finished scores (needs
  ``NUM_STAGES >= 2``).

The output split and P through shared memory follow FlashMLA's sm90 decode kernel
(github.com/deepseek-ai/FlashMLA and its 2025-04-22 deep-dive note; read for the idea, not
copied). FlashMLA goes further: each warpgroup computes the scores of a whole 64-token
block of a 128-token pair (N=64 wgmmas, "seesaw" schedule) with shared memory refilled
chunk by chunk; this kernel's N=32 score wgmmas are its main cost (benchmarks/NOTES.md).
Loads: full tiles by TMA (host descriptors over the pool rows, ``NUM_STAGES`` deep,
completion on mbarriers); the split's partial last tile through masked pointer loads (zero
past ``seq_lens``) stored to shared memory. Needs sm_90, 16-bit dtypes, ``page_size %
BLOCK_N == 0`` and TMA-compatible strides (`mla_decode.mla_gluon_applicable`).

Gluon is experimental and its API changes between Triton releases; this file was written
against Triton 3.6. It is imported only when the kernel is used.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from attnserve.attention.triton_ops.mla_common import MLAStage1Args, _program_item, _split_bounds

__all__ = ["gluon_descriptors", "launch_gluon_stage1"]

BLOCK_H = gl.constexpr(64)
NUM_WARPS = gl.constexpr(8)


@gluon.jit
def _qk(qn_s, qp_s, kc, kr, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, IS_ASYNC: gl.constexpr):
    """Unscaled scores ``q_nope @ kc^T + q_pe @ kr^T``: [BLOCK_H, BLOCK_N] in ``s_layout``
    (a wgmma token when IS_ASYNC)."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(qn_s, kc.permute((1, 0)), s, use_acc=False, is_async=IS_ASYNC)
    s = warpgroup_mma(qp_s, kr.permute((1, 0)), s, is_async=IS_ASYNC)
    return s


@gluon.jit
def _softmax_p(s, m_i, l_i, p_s, n0, end, sm_scale_log2, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
               MASKED: gl.constexpr):
    """Online-softmax update with one tile's scores ``s``; writes P to ``p_s`` (visible to
    all warps on return) and returns (m_new, l_i, alpha). ``l_i`` is kept as a
    [BLOCK_H, BLOCK_N] partial sum, reduced across the warpgroups once at the end, so the
    only cross-warpgroup reduction per tile is the row max."""
    s = s * sm_scale_log2
    if MASKED:
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((offs_n < end)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha[:, None] + p
    p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    gl.thread_barrier()  # P complete (both warpgroups) before either reads it
    return m_new, l_i, alpha


@gluon.jit
def _issue_tile(desc_c, desc_r, table, n0, bar, kc, kr, PAGE_SIZE: gl.constexpr):
    page = gl.load(table + n0 // PAGE_SIZE)
    row0 = page * PAGE_SIZE + n0 % PAGE_SIZE
    mbarrier.expect(bar, desc_c.block_type.nbytes + desc_r.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_c, [row0, 0], bar, kc)
    tma.async_copy_global_to_shared(desc_r, [row0, 0], bar, kr)


@gluon.jit(do_not_specialize=["num_heads", "num_splits_scalar"])
def _mla_decode_stage1_gluon(
    QNope, QPe, KV, desc_c, desc_r, BlockTable, SeqLens, NumSplits, Work,
    OPart, LsePart, O, Lse,
    sm_scale_log2, num_heads, num_splits_scalar,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_kv_t, stride_bt_b,
    stride_op_b, stride_op_h, stride_op_s, stride_lp_b, stride_lp_h,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    D_C: gl.constexpr, D_R: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    MAX_KV_SPLITS: gl.constexpr, PER_REQ_SPLITS: gl.constexpr, HAS_LSE: gl.constexpr,
    NUM_STAGES: gl.constexpr, WORK_ITEMS: gl.constexpr,
):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D_C // 2, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dtype: gl.constexpr = desc_c.dtype

    pid_h = gl.program_id(0)
    b, split_id = _program_item(Work, gl.program_id(1), gl.program_id(2), MAX_KV_SPLITS, WORK_ITEMS)
    kv_len, per_split, n_eff = _split_bounds(SeqLens, NumSplits, b, num_splits_scalar, MAX_KV_SPLITS, BLOCK_N,
                                             PER_REQ_SPLITS)
    start = split_id * per_split
    end = gl.minimum(start + per_split, kv_len)

    if start < end:
        # q tile -> shared memory (rows past num_heads are zero)
        offs_hl = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_layout))
        offs_cl = gl.arange(0, D_C, layout=gl.SliceLayout(0, ld_layout))
        offs_rl = gl.arange(0, D_R, layout=gl.SliceLayout(0, ld_layout))
        mh = (offs_hl < num_heads)[:, None]
        qn = gl.load(QNope + b * stride_qn_b + offs_hl[:, None] * stride_qn_h + offs_cl[None, :], mask=mh, other=0.0)
        qp = gl.load(QPe + b * stride_qp_b + offs_hl[:, None] * stride_qp_h + offs_rl[None, :], mask=mh, other=0.0)
        qn_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_C], sw, qn)
        qp_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], sw, qp)
        kc_s = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_C], sw)
        kr_s = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_R], sw)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], sw)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([BLOCK_H, D_C], gl.float32, o_layout)
        table = BlockTable + b * stride_bt_b

        # Full tiles. Tile i + NUM_STAGES is fetched into stage i % NUM_STAGES once tile i
        # is consumed; the scores of tile i + 1 are issued right behind P @ V of tile i, so
        # the tensor cores run the two back to back and the softmax of tile i + 1 starts
        # from finished scores.
        n_full = (end - start) // BLOCK_N
        for i in gl.static_range(NUM_STAGES):
            if i < n_full:
                _issue_tile(desc_c, desc_r, table, start + i * BLOCK_N, bars.index(i), kc_s.index(i),
                            kr_s.index(i), PAGE_SIZE)
        if n_full > 0:
            mbarrier.wait(bars.index(0), 0)
            s_cur = _qk(qn_s, qp_s, kc_s.index(0), kr_s.index(0), s_layout, BLOCK_N, False)
        else:
            s_cur = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        for i in range(n_full):
            st = i % NUM_STAGES
            m_i, l_i, alpha = _softmax_p(s_cur, m_i, l_i, p_s, start + i * BLOCK_N, end, sm_scale_log2,
                                         s_layout, BLOCK_N, False)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc_t = warpgroup_mma(p_s, kc_s.index(st), acc, is_async=True)
            if i + 1 < n_full:
                st1 = (i + 1) % NUM_STAGES
                mbarrier.wait(bars.index(st1), ((i + 1) // NUM_STAGES) & 1)
                s_t = _qk(qn_s, qp_s, kc_s.index(st1), kr_s.index(st1), s_layout, BLOCK_N, True)
                acc, s_cur = warpgroup_mma_wait(0, deps=[acc_t, s_t])
            else:
                acc = warpgroup_mma_wait(0, deps=[acc_t])
            gl.thread_barrier()  # both warpgroups are done with stage st and P
            if i + NUM_STAGES < n_full:
                _issue_tile(desc_c, desc_r, table, start + (i + NUM_STAGES) * BLOCK_N, bars.index(st),
                            kc_s.index(st), kr_s.index(st), PAGE_SIZE)

        n0 = start + n_full * BLOCK_N
        if n0 < end:  # partial last tile: masked loads (zero past end) into stage 0, no TMA in flight
            offs_nl = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))
            page = gl.load(table + n0 // PAGE_SIZE).to(gl.int64)
            rows = KV + (page * PAGE_SIZE + n0 % PAGE_SIZE + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))
                         ).to(gl.int64) * stride_kv_t
            mn = (offs_nl < end)[:, None]
            kc_s.index(0).store(gl.load(rows[:, None] + offs_cl[None, :], mask=mn, other=0.0))
            kr_s.index(0).store(gl.load(rows[:, None] + D_C + offs_rl[None, :], mask=mn, other=0.0))
            fence_async_shared()
            gl.thread_barrier()
            s = _qk(qn_s, qp_s, kc_s.index(0), kr_s.index(0), s_layout, BLOCK_N, False)
            m_i, l_i, alpha = _softmax_p(s, m_i, l_i, p_s, n0, end, sm_scale_log2, s_layout, BLOCK_N, True)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(p_s, kc_s.index(0), acc)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(i))

        l_i = gl.sum(l_i, axis=1)
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        out = acc / l_o[:, None]
        lse2 = m_o + gl.log2(l_o)
        offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        offs_c = gl.arange(0, D_C, layout=gl.SliceLayout(0, o_layout))
        mask_h = offs_h < num_heads
        mask_hc = mask_h[:, None] & (offs_c < D_C)[None, :]
        if n_eff == 1:
            gl.store(O + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_c[None, :],
                     out.to(O.dtype.element_ty), mask=mask_hc)
            if HAS_LSE:
                gl.store(Lse + b * stride_lse_b + offs_h * stride_lse_h, lse2 / 1.4426950408889634, mask=mask_h)
        else:
            gl.store(OPart + b * stride_op_b + offs_h[:, None] * stride_op_h + split_id * stride_op_s
                     + offs_c[None, :], out, mask=mask_hc)
            gl.store(LsePart + b * stride_lp_b + offs_h * stride_lp_h + split_id, lse2, mask=mask_h)


def gluon_descriptors(kv_rows, d_c: int, d_r: int, block_n: int):
    """Host TMA descriptors of the latent pool rows ``kv_rows`` ``[num_slots, d_c + d_r]``
    for `_mla_decode_stage1_gluon`: ``[block_n, d_c]`` c_kv boxes and ``[block_n, d_r]``
    k_pe boxes, 128-byte swizzled as the kernel's shared-memory tiles."""
    sw = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    n = kv_rows.shape[0]
    desc_c = TensorDescriptor(kv_rows, [n, d_c], [kv_rows.stride(0), 1], [block_n, d_c], sw)
    desc_r = TensorDescriptor(kv_rows[:, d_c:], [n, d_r], [kv_rows.stride(0), 1], [block_n, d_r], sw)
    return desc_c, desc_r


def launch_gluon_stage1(args: MLAStage1Args, grid: tuple, constexprs: dict, num_stages: int) -> None:
    """Launch `_mla_decode_stage1_gluon` over ``args`` (``desc_c`` / ``desc_r`` from
    `gluon_descriptors`), ``num_stages`` TMA tiles in flight; ``constexprs`` as for every
    stage-1 kernel (dims, ``BLOCK_N``, ``PAGE_SIZE``, split mode, ``num_warps`` 8)."""
    _mla_decode_stage1_gluon[grid](*args, NUM_STAGES=num_stages, **constexprs)
