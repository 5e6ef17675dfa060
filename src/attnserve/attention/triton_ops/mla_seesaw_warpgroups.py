"""Compute partitions of the seesaw MLA stage 1 (`mla_decode_seesaw`): tiles, layouts and the two warpgroups.

The kernel's tile geometry (64 heads x 64-token blocks, each block as 9 ``[64, 64]`` chunks:
c_kv 0..7, k_pe 8; ``HALF`` = 256 output columns per warpgroup), the wgmma register layouts,
and the ``gluon.jit`` code the two compute warpgroups run: ``_wg0`` (default partition:
even blocks' scores, the left output half ``O_L`` and the LSE) and ``_wg1`` (worker
partition: odd blocks' scores and ``O_R``), with their helpers (scores from chunked
shared-memory operands, the log2-domain online softmax, publishing P / row max / rescale
factor through shared memory, the final exchange of row sums and the stores of the output
halves, of the LSE and of an empty request's zeros). `_chunk` and `_num_pairs` are also
the loaders' (`mla_seesaw_loaders`). The schedule, the barriers and the shared-memory
budget are described in `mla_decode_seesaw`, which launches these partitions. Gluon is
experimental; written against Triton 3.6 and imported only when used.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__: list[str] = []  # kernel-internal; the public names are `mla_decode_seesaw`'s

BLOCK_H = gl.constexpr(64)
BLOCK_N = gl.constexpr(64)
CHUNK = gl.constexpr(64)
N_CHUNKS = gl.constexpr(9)  # 512 / 64 c_kv chunks + 1 k_pe chunk
HALF = gl.constexpr(256)  # output columns per warpgroup
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
