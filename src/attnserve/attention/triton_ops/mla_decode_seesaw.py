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
"""

from __future__ import annotations

import torch
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

__all__ = ["seesaw_descriptor", "launch_seesaw_stage1", "SEESAW_MAXNREG"]

BLOCK_H = gl.constexpr(64)
BLOCK_N = gl.constexpr(64)
CHUNK = gl.constexpr(64)
N_CHUNKS = gl.constexpr(9)  # 512 / 64 c_kv chunks + 1 k_pe chunk
HALF = gl.constexpr(256)  # output columns per warpgroup
# registers: 12 warps (3 warpgroups, the loader's padded) x 32 x 168 <= 65536 at launch;
# setmaxnreg then gives the loader warpgroup 24 and each compute warpgroup 240.
SEESAW_MAXNREG = 168
WG_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)
# scores [64 heads, 64 tokens] and output half [64, 256] of one warpgroup (4 warps)
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
# per-row vectors (row max, row sum, rescale factors) of the scores, and P as the A operand
# of the P @ V wgmma taken from registers
ROWS = gl.constexpr(gl.SliceLayout(1, S_LAYOUT))
P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))


@gluon.jit
def _chunk(buf, c: gl.constexpr):
    """Chunk ``c`` of a (c_kv ``[8, 64, 64]``, k_pe ``[64, 64]``) pair of shared buffers."""
    if c == 8:
        r = buf[1]
    else:
        r = buf[0].index(c)
    return r


@gluon.jit
def _qk_chunk(q_s, kv, ready, ph, c: gl.constexpr, s, USE_ACC: gl.constexpr):
    if c % 4 == 0:  # first chunk of its TMA group (c_kv 0..3, c_kv 4..7, k_pe): wait for the group
        mbarrier.wait(ready.index(c), ph)
    return warpgroup_mma(_chunk(q_s, c), _chunk(kv, c).permute((1, 0)), s, use_acc=USE_ACC, is_async=True)


@gluon.jit
def _qk(q_s, kv, ready, ph, FIRST: gl.constexpr):
    """Scores ``q @ kv^T`` [64, 64] fp32 (unscaled); waits for each group of chunks' TMA
    (one barrier per group: c_kv 0..3 at index 0, c_kv 4..7 at 4, k_pe at 8) and issues its
    wgmmas. Chunk order, matching the order in which the loader can refill the buffer:
    ``FIRST == 8``: k_pe, then c_kv 0..7; ``FIRST == 4``: c_kv 4..7, 0..3, then k_pe."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    if FIRST == 8:
        s = _qk_chunk(q_s, kv, ready, ph, 8, s, False)
        for c in gl.static_range(8):
            s = _qk_chunk(q_s, kv, ready, ph, c, s, True)
    else:
        for c in gl.static_range(4, 8):
            s = _qk_chunk(q_s, kv, ready, ph, c, s, c > 4)
        for c in gl.static_range(4):
            s = _qk_chunk(q_s, kv, ready, ph, c, s, True)
        s = _qk_chunk(q_s, kv, ready, ph, 8, s, True)
    return warpgroup_mma_wait(0, deps=[s])


@gluon.jit
def _zero_tail_rows(kv, valid):
    """Zero rows ``valid..63`` of the c_kv chunks of block buffer ``kv`` (they are read as V;
    the pool rows past the sequence may hold anything)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    for c in gl.static_range(N_CHUNKS - 1):
        x = kv[0].index(c).load(ld)
        kv[0].index(c).store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _softmax(s, m_prev, n0, end, sm_scale_log2):
    """(m_new, alpha, p) of one block's unscaled scores ``s`` against the running max
    ``m_prev`` (log2 units). The scale is applied to the row max and inside ``exp2``'s
    argument (one FMA a score), and only a partial last block is masked."""
    if n0 + BLOCK_N > end:
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where((offs_n < end)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(s, axis=1) * sm_scale_log2)
    alpha = gl.exp2(m_prev - m_new)
    p = gl.exp2(s * sm_scale_log2 - m_new[:, None])
    return m_new, alpha, p


@gluon.jit
def _publish(p_dst, p, m_dst, m_new, a_dst, alpha, bar):
    """Write P (bf16) and the row max / rescale factor to shared memory, then arrive ``bar``."""
    p_dst.store(p)
    m_dst.store(m_new)
    a_dst.store(alpha)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _v_half(kv, h: gl.constexpr):
    """Columns ``h * 256 .. h * 256 + 255`` of a block's c_kv chunks as one ``[64, 256]`` B
    operand: four consecutive 128-byte-swizzled [64, 64] chunks are laid out exactly as a
    swizzled [64, 256] tile."""
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return kv[0]._reinterpret(kv[0].dtype, [BLOCK_N, 2 * HALF], sw).slice(h * HALF, HALF, 1)


@gluon.jit
def _exchange_row_sums(l_own, own_s, other_s, own_bar, other_bar):
    """Total row sums ``l0 + l1`` [64] fp32: publish this warpgroup's partial sums in
    ``own_s``, arrive ``own_bar``, wait for the other warpgroup's on ``other_bar`` (each
    barrier completes once per launch)."""
    own_s.store(l_own)
    gl.thread_barrier()
    mbarrier.arrive(own_bar)
    mbarrier.wait(other_bar, 0)
    return l_own + other_s.load(ROWS)


@gluon.jit
def _rows_o(x):
    return gl.convert_layout(x, gl.SliceLayout(1, O_LAYOUT))


@gluon.jit
def _store_half(acc, l_i, col0, out_args, out_scale, SCALE_OUT: gl.constexpr):
    """Normalize one ``[64, 256]`` output half by the row sums ``l_i`` (times ``out_scale``
    when SCALE_OUT: an fp8 cache's kv_scale) and store it."""
    (b, pid_h, split_id, n_eff, num_heads, O, OPart, LsePart, Lse, stride_o_b, stride_o_h, stride_op_b, stride_op_h,
     stride_op_s, stride_lp_b, stride_lp_h, stride_lse_b, stride_lse_h) = out_args
    out = acc / _rows_o(l_i)[:, None]
    if SCALE_OUT:
        out = out * out_scale
    offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_LAYOUT))
    offs_c = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_LAYOUT))
    mask_hc = (offs_h < num_heads)[:, None] & (offs_c < col0 + HALF)[None, :]
    if n_eff == 1:
        gl.store(O + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_c[None, :], out.to(O.dtype.element_ty),
                 mask=mask_hc)
    else:
        gl.store(OPart + b * stride_op_b + offs_h[:, None] * stride_op_h + split_id * stride_op_s + offs_c[None, :],
                 out, mask=mask_hc)


@gluon.jit
def _store_lse(m_i, l_i, out_args, HAS_LSE: gl.constexpr):
    (b, pid_h, split_id, n_eff, num_heads, O, OPart, LsePart, Lse, stride_o_b, stride_o_h, stride_op_b, stride_op_h,
     stride_op_s, stride_lp_b, stride_lp_h, stride_lse_b, stride_lse_h) = out_args
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=vec)
    lse2 = gl.convert_layout(m_i + gl.log2(l_i), vec)
    if n_eff == 1:
        if HAS_LSE:
            gl.store(Lse + b * stride_lse_b + offs_h * stride_lse_h, lse2 / 1.4426950408889634, mask=offs_h < num_heads)
    else:
        gl.store(LsePart + b * stride_lp_b + offs_h * stride_lp_h + split_id, lse2, mask=offs_h < num_heads)


@gluon.jit
def _store_empty(b, pid_h, num_heads, O, Lse, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
                 HAS_LSE: gl.constexpr):
    """``O = 0`` and ``Lse = -inf`` for this program's heads of an empty request (what the
    merge kernel writes; with one split it is not launched)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
    mrow = rows < num_heads
    zeros = gl.zeros([BLOCK_H, CHUNK], O.dtype.element_ty, ld)
    for c in gl.static_range(2 * HALF // CHUNK):
        cols = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, ld))
        gl.store(O + b * stride_o_b + rows[:, None] * stride_o_h + cols[None, :], zeros, mask=mrow[:, None])
    if HAS_LSE:
        gl.store(Lse + b * stride_lse_b + rows * stride_lse_h,
                 gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, ld)), mask=mrow)


@gluon.jit
def _num_pairs(start, end):
    """Number of 128-token pairs of 64-token blocks in the split ``[start, end)`` (the last
    pair may hold one block, the last block may be partial)."""
    return (end - start + 2 * BLOCK_N - 1) // (2 * BLOCK_N)


@gluon.jit
def _init_state():
    """A warpgroup's running max and row sum ([64] fp32) and its output half ([64, 256] fp32)."""
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT)
    return m_i, l_i, acc


@gluon.jit
def _wg0(q_s, kv_s, p0_s, xch, bars, start, end, sm_scale_log2, out_args, out_scale, HAS_LSE: gl.constexpr,
         SCALE_OUT: gl.constexpr):
    """Default partition: even blocks' scores, ``O_L``; stores ``O_L`` and the LSE."""
    ready0, ready1, free_r0, free_a0, free_b0, free_a1, free_b1, p0_ready, p1_ready, l_bars = bars
    m0_s, a0_s, m1_s, a1_s, l0_s, l1_s = xch
    kv0 = kv_s[0]
    kv1 = kv_s[1]
    m_i, l_i, acc = _init_state()
    for t in range(_num_pairs(start, end)):
        ph = t & 1
        n0 = start + 2 * t * BLOCK_N
        s = _qk(q_s, kv0, ready0, ph, 8)
        mbarrier.arrive(free_r0)  # k_pe chunk of B0 read
        if n0 + BLOCK_N > end:
            _zero_tail_rows(kv0, end - n0)
        m_new, alpha, p = _softmax(s, m_i, n0, end, sm_scale_log2)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        p = p.to(p0_s.dtype)
        if t > 0:
            mbarrier.wait(free_b0, ph ^ 1)  # wg1 is done with the previous P0 / m0 / a0
        _publish(p0_s, p, m0_s, m_new, a0_s, alpha, p0_ready)
        acc = acc * _rows_o(alpha)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p, P_OPERAND), _v_half(kv0, 0), acc)
        mbarrier.arrive(free_a0)  # c_kv chunks 0..3 of B0 read
        m_i = m_new
        if n0 + BLOCK_N < end:  # B1 exists
            mbarrier.wait(p1_ready, ph)
            a1 = a1_s.load(ROWS)
            m_i = m1_s.load(ROWS)
            l_i = l_i * a1
            acc = acc * _rows_o(a1)[:, None]
            acc = warpgroup_mma(kv1[1], _v_half(kv1, 0), acc)
            mbarrier.arrive(free_a1)  # c_kv chunks 0..3 and P1 (k_pe chunk) of B1 read
    l_i = _exchange_row_sums(l_i, l0_s, l1_s, l_bars[0], l_bars[1])
    _store_lse(m_i, l_i, out_args, HAS_LSE)
    _store_half(acc, l_i, 0, out_args, out_scale, SCALE_OUT)


@gluon.jit
def _wg1(q_s, kv_s, p0_s, xch, bars, start, end, sm_scale_log2, out_args, out_scale, SCALE_OUT: gl.constexpr):
    """Worker partition (4 warps): odd blocks' scores, ``O_R``."""
    ready0, ready1, free_r0, free_a0, free_b0, free_a1, free_b1, p0_ready, p1_ready, l_bars = bars
    m0_s, a0_s, m1_s, a1_s, l0_s, l1_s = xch
    kv0 = kv_s[0]
    kv1 = kv_s[1]
    m_i, l_i, acc = _init_state()
    for t in range(_num_pairs(start, end)):
        ph = t & 1
        n1 = start + (2 * t + 1) * BLOCK_N
        has1 = n1 < end
        if has1:
            mbarrier.wait(free_r0, ph)  # wg0's scores of B0 are done: QK1 runs behind QK0
            s = _qk(q_s, kv1, ready1, ph, 4)
            if n1 + BLOCK_N > end:
                _zero_tail_rows(kv1, end - n1)
        else:
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
        mbarrier.wait(p0_ready, ph)
        m0 = m0_s.load(ROWS)
        a0 = a0_s.load(ROWS)
        acc = acc * _rows_o(a0)[:, None]
        acc_t = warpgroup_mma(p0_s, _v_half(kv0, 1), acc, is_async=True)
        l_i = l_i * a0
        m_i = m0
        if has1:
            m_new, alpha, p = _softmax(s, m0, n1, end, sm_scale_log2)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            p = p.to(p0_s.dtype)
            _publish(kv1[1], p, m1_s, m_new, a1_s, alpha, p1_ready)
            acc = warpgroup_mma_wait(0, deps=[acc_t])
            mbarrier.arrive(free_b0)  # c_kv chunks 4..7 of B0, P0, m0, a0 read
            acc = acc * _rows_o(alpha)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p, P_OPERAND), _v_half(kv1, 1), acc)
            mbarrier.arrive(free_b1)  # c_kv chunks 4..7 of B1 read
            m_i = m_new
        else:
            acc = warpgroup_mma_wait(0, deps=[acc_t])
            mbarrier.arrive(free_b0)
    l_i = _exchange_row_sums(l_i, l1_s, l0_s, l_bars[1], l_bars[0])
    _store_half(acc, l_i, HALF, out_args, out_scale, SCALE_OUT)


@gluon.jit
def _issue(desc, row0, c0: gl.constexpr, n: gl.constexpr, ready, kv):
    """TMA copies of chunks ``c0 .. c0 + n - 1`` of one block, completing on ``ready[c0]``."""
    bar = ready.index(c0)
    mbarrier.expect(bar, n * desc.block_type.nbytes)
    for c in gl.static_range(c0, c0 + n):
        tma.async_copy_global_to_shared(desc, [row0, c * CHUNK], bar, _chunk(kv, c))


@gluon.jit
def _loader(kv_s, bars, start, end, desc, table, PAGE_SIZE: gl.constexpr):
    """Worker partition (1 warp): TMA copies of each block, chunk by chunk, as the chunks are
    released (the release order of the seesaw: B0's k_pe, c_kv 0..3, 4..7; B1's c_kv 4..7,
    then 0..3 with k_pe)."""
    ready0, ready1, free_r0, free_a0, free_b0, free_a1, free_b1, p0_ready, p1_ready, l_bars = bars
    kv0 = kv_s[0]
    kv1 = kv_s[1]
    for t in range(_num_pairs(start, end)):
        ph = (t & 1) ^ 1  # a fresh barrier counts as released (phase 1 complete)
        n0 = start + 2 * t * BLOCK_N
        page = gl.load(table + n0 // PAGE_SIZE)
        row0 = page * PAGE_SIZE + n0 % PAGE_SIZE
        mbarrier.wait(free_r0, ph)
        _issue(desc, row0, 8, 1, ready0, kv0)
        mbarrier.wait(free_a0, ph)
        _issue(desc, row0, 0, 4, ready0, kv0)
        mbarrier.wait(free_b0, ph)
        _issue(desc, row0, 4, 4, ready0, kv0)
        n1 = n0 + BLOCK_N
        if n1 < end:
            page1 = gl.load(table + n1 // PAGE_SIZE)
            row1 = page1 * PAGE_SIZE + n1 % PAGE_SIZE
            mbarrier.wait(free_b1, ph)
            _issue(desc, row1, 4, 4, ready1, kv1)
            mbarrier.wait(free_a1, ph)
            _issue(desc, row1, 0, 4, ready1, kv1)
            _issue(desc, row1, 8, 1, ready1, kv1)


# fp8 cache: a [64, 64] fp8 chunk (4 KB) is TMA-loaded into the upper half of the chunk's
# 16-bit slot (8 KB; 64-byte swizzle) and converted in place by the loader partition
STAGE_SW = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
# the same swizzles as rank-3 views over the chunk index (a rank-2 layout over a 3-d register
# tensor is refused by the compiler)
STAGE_SW_3D = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=3))
MMA_SW_3D = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
# 64 rows x 64 fp8 of a chunk over the loader's 4 warps: 16 consecutive bytes a thread and
# row, 2 rows a thread; over a group of 4 chunks 8 such 16-byte pieces a thread
CVT_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
CVT_LAYOUT_3D = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0]))


@gluon.jit
def _issue_fp8(desc, row0, c0: gl.constexpr, n: gl.constexpr, land, kv):
    """TMA copies of fp8 chunks ``c0 .. c0 + n - 1`` of one block into their staging areas
    (the upper 4 KB of each chunk's 8 KB slot), completing on ``land[c0]``."""
    bar = land.index(c0)
    mbarrier.expect(bar, n * desc.block_type.nbytes)
    for c in gl.static_range(c0, c0 + n):
        dst = _chunk(kv, c)._reinterpret(desc.dtype, [2, BLOCK_N, CHUNK], STAGE_SW).index(1)
        tma.async_copy_global_to_shared(desc, [row0, c * CHUNK], bar, dst)


@gluon.jit
def _convert(kv, c0: gl.constexpr, n: gl.constexpr, land, ready, ph, fp8: gl.constexpr):
    """Wait for the fp8 chunks ``c0 .. c0 + n - 1`` (``land[c0]``, phase ``ph``), convert
    them in place to the slot's 16-bit dtype and arrive ``ready[c0]`` (what the compute
    warpgroups wait for).

    A group is converted with one barrier: one shared-memory load of all its fp8 bytes (for
    c_kv 0..3 / 4..7, 8 independent 16-byte loads a thread, so their latencies overlap), one
    barrier (each 16-bit slot overlaps its own staging area), one store of the 16-bit slots.
    Each slot seen as ``[128, 64]`` fp8 holds its staging area in rows 64..127 (the 64-byte
    swizzle repeats every 8 rows). One load and one store a group also keep the compiler
    from adding barriers between chunks and between the halves of a chunk (it cannot tell
    the views of one buffer apart): converting chunk by chunk cost 4 barriers a chunk and
    was 1.2x slower at 128 heads (benchmarks/NOTES.md, Session 12)."""
    mbarrier.wait(land.index(c0), ph)
    if c0 == 8:
        slot = _chunk(kv, c0)
        x = slot._reinterpret(fp8, [2 * BLOCK_N, CHUNK], STAGE_SW).slice(BLOCK_N, BLOCK_N, 0).load(CVT_LAYOUT)
        gl.thread_barrier()
        slot.store(x.to(kv[0].dtype))
    else:
        src = kv[0]._reinterpret(fp8, [8, 2 * BLOCK_N, CHUNK], STAGE_SW_3D).slice(c0, n).slice(BLOCK_N, BLOCK_N, 1)
        x = src.load(CVT_LAYOUT_3D)
        gl.thread_barrier()
        kv[0]._reinterpret(kv[0].dtype, [8, BLOCK_N, CHUNK], MMA_SW_3D).slice(c0, n).store(x.to(kv[0].dtype))
    fence_async_shared()  # generic writes before the compute warpgroups' wgmma (async proxy) reads
    gl.thread_barrier()
    mbarrier.arrive(ready.index(c0))


@gluon.jit
def _loader_fp8(kv_s, bars, land, start, end, desc, table, PAGE_SIZE: gl.constexpr):
    """Worker partition (4 warps) for an fp8 cache: the loader's TMA copies (same release
    order and barriers as `_loader`, into the staging areas, completing on ``land``), each
    group converted right after the next group is issued (one copy in flight while the
    previous one is converted; B1's groups at the end of the pair). Converting earlier
    (right after a group's own copy) was slower: the conversions then delay the next
    issues (benchmarks/NOTES.md, Session 10)."""
    ready0, ready1, free_r0, free_a0, free_b0, free_a1, free_b1, p0_ready, p1_ready, l_bars = bars
    land0, land1 = land
    kv0 = kv_s[0]
    kv1 = kv_s[1]
    fp8: gl.constexpr = desc.dtype
    for t in range(_num_pairs(start, end)):
        ph = (t & 1) ^ 1  # a fresh barrier counts as released (phase 1 complete)
        ph_land = t & 1
        n0 = start + 2 * t * BLOCK_N
        page = gl.load(table + n0 // PAGE_SIZE)
        row0 = page * PAGE_SIZE + n0 % PAGE_SIZE
        mbarrier.wait(free_r0, ph)
        _issue_fp8(desc, row0, 8, 1, land0, kv0)
        mbarrier.wait(free_a0, ph)
        _issue_fp8(desc, row0, 0, 4, land0, kv0)
        _convert(kv0, 8, 1, land0, ready0, ph_land, fp8)
        mbarrier.wait(free_b0, ph)
        _issue_fp8(desc, row0, 4, 4, land0, kv0)
        _convert(kv0, 0, 4, land0, ready0, ph_land, fp8)
        n1 = n0 + BLOCK_N
        if n1 < end:
            page1 = gl.load(table + n1 // PAGE_SIZE)
            row1 = page1 * PAGE_SIZE + n1 % PAGE_SIZE
            mbarrier.wait(free_b1, ph)
            _issue_fp8(desc, row1, 4, 4, land1, kv1)
            _convert(kv0, 4, 4, land0, ready0, ph_land, fp8)
            mbarrier.wait(free_a1, ph)
            _issue_fp8(desc, row1, 0, 4, land1, kv1)
            _issue_fp8(desc, row1, 8, 1, land1, kv1)
            _convert(kv1, 4, 4, land1, ready1, ph_land, fp8)
            _convert(kv1, 0, 4, land1, ready1, ph_land, fp8)
            _convert(kv1, 8, 1, land1, ready1, ph_land, fp8)
        else:
            _convert(kv0, 4, 4, land0, ready0, ph_land, fp8)


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
