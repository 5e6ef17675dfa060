"""Partitions of the Gluon causal prefill kernel (`prefill_gluon`): the TMA loader and the two
consumer warpgroups, and the pieces the cached-prefix specialization
(`prefill_gluon_prefix_kernel`) shares with it: the shared-memory / barrier setup
(`_alloc_ring`), the TMA loads (`_load_q`, `_load_kv_tiles`) and the consumer schedule
(`_consumer_pipeline`, ``PREFIX`` on: prefix tiles after the new-token tiles).

One program owns ``BLOCK_M`` = 128 query rows of one request and one query head; consumer
warpgroup ``w`` (0 or 1) owns rows ``64 w .. 64 w + 63``. Both consumers walk the same key
tiles, from the causal diagonal down to key 0 (the diagonal tile first, so the masked tiles
come first and set the row maxima; FlashAttention-3, Shah et al. 2024, section 3), and share
every K/V tile of a ``STAGES``-deep shared-memory ring that the 1-warp loader fills by TMA.

Barriers (mbarriers; a fresh barrier counts as having completed phase "1", so a first wait
on parity 1 passes):

* ``q_ready``: both 64-row halves of the Q tile landed (TMA, expect-tx).
* ``k_ready[s]`` / ``v_ready[s]``: K / V of ring slot ``s`` landed (TMA, expect-tx).
* ``k_free[s]`` / ``v_free[s]`` (count 2): each consumer arrives once its QK (K) or PV (V)
  wgmma on slot ``s`` has completed; the loader waits before refilling the slot.
* ``sched[w]``: consumer ``w`` may issue its next group of wgmmas. Consumers alternate
  strictly (0, 1, 0, 1, ...): each waits for its turn, issues, and hands the turn to the
  other, so one warpgroup's softmax runs while the other's wgmmas occupy the tensor cores
  (inter-warpgroup "ping-pong", FA3 section 3.1).

Per consumer, key tile ``i`` (processed order; slot ``i % STAGES``): after its turn it issues
``S_i = Q K_i^T`` and then ``O += P_{i-1} V_{i-1}`` (both asynchronous), waits for the
first (``wgmma.wait_group 1``: the PV wgmma stays in flight), runs tile ``i``'s online softmax
(log2 domain, scale folded into one FMA a score) under the PV wgmma, waits for it, and
rescales ``O`` by tile ``i``'s correction (intra-warpgroup pipelining, FA3 section 3.2). P is
the A operand of the PV wgmma straight from registers. Gluon is experimental; written
against Triton 3.6 and imported only when used.
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

__all__: list[str] = []  # kernel-internal; the public names are `prefill_gluon`'s

HALF_M = gl.constexpr(64)  # query rows of one consumer warpgroup
HEAD_D = gl.constexpr(128)
# the output accumulator [64, 128] of one warpgroup (4 warps) and its per-row vectors
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
O_ROWS = gl.constexpr(gl.SliceLayout(1, O_LAYOUT))
P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))


@gluon.jit
def _stage(i, STAGES: gl.constexpr):
    """Ring slot and barrier parity of the ``i``-th tile."""
    return i % STAGES, (i // STAGES) & 1


@gluon.jit
def _load_q(q_s, q_ready, q_desc, q_row, q_col):
    """TMA of the Q tile's two 64-row boxes into ``q_s[0]`` / ``q_s[1]`` (one expect-tx on ``q_ready``)."""
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_ready, q_s.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, q_col], q_ready, q_s.index(1))


@gluon.jit
def _load_kv_tiles(k_s, v_s, bars, k_desc, v_desc, kv_row, kv_col, n_tiles, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, EXTRA_ARRIVALS: gl.constexpr):
    """TMA of K and V of ``n_tiles`` key tiles from the causal diagonal down (rows ``kv_row +
    (n_tiles - 1 - i) BLOCK_N ..``), ring slot ``i % STAGES`` each once both consumers freed
    it. ``EXTRA_ARRIVALS``: plain arrivals on the ready barrier besides the expect-tx one (the
    loader's other threads where the ready barrier counts every loader thread; 0: none)."""
    q_ready, k_ready, v_ready, k_free, v_free, sched = bars
    for i in range(n_tiles):
        s, ph = _stage(i, STAGES)
        row = kv_row + (n_tiles - 1 - i) * BLOCK_N
        mbarrier.wait(k_free.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        if EXTRA_ARRIVALS > 0:
            mbarrier.arrive(k_ready.index(s), count=EXTRA_ARRIVALS)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_s.index(s))
        mbarrier.wait(v_free.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        if EXTRA_ARRIVALS > 0:
            mbarrier.arrive(v_ready.index(s), count=EXTRA_ARRIVALS)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_s.index(s))


@gluon.jit
def _loader(q_s, k_s, v_s, bars, q_desc, k_desc, v_desc, q_row, q_col, kv_row, kv_col, n_tiles,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Worker partition (1 warp): the Q tile (two 64-row boxes), then K and V of each key tile
    in processed order (diagonal first), each into its ring slot once both consumers freed it.
    Rows past the request are loaded too (the next request's, or TMA's zeros past the tensor):
    the consumers mask them as keys and do not store them as queries."""
    _load_q(q_s, bars[0], q_desc, q_row, q_col)
    _load_kv_tiles(k_s, v_s, bars, k_desc, v_desc, kv_row, kv_col, n_tiles, BLOCK_N, STAGES, 0)


@gluon.jit
def _take_turn(sched, k, W: gl.constexpr):
    """Wait until consumer ``W`` may issue its ``k``-th wgmma group (consumer 0 goes first)."""
    if W == 0:
        mbarrier.wait(sched.index(0), (k & 1) ^ 1)
    else:
        mbarrier.wait(sched.index(1), k & 1)


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale):
    """(m_new, alpha, l_new, p) of one tile of (masked) unscaled scores ``s``: ``p = 2^(s *
    qk_scale - m_new)``, ``alpha = 2^(m_i - m_new)`` (log2 units; FlashAttention-2, Dao 2023)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return m_new, alpha, l_new, p


@gluon.jit
def _softmax(s, m_i, l_i, key0, row0, qk_scale, S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr):
    """Online-softmax update of one tile of unscaled scores ``s`` [64, BLOCK_N] (keys from
    ``key0``; this warpgroup's first query row ``row0``, both request-relative): returns
    (m_new, alpha, l_new, p) with ``p = 2^(s * qk_scale - m_new)`` and ``alpha = 2^(m_i -
    m_new)`` (log2 units). Only tiles reaching past ``row0`` are masked (key > query); the
    running max starts finite (-1e30), so a row that sees no key of a tile keeps p = 0."""
    if key0 + BLOCK_N - 1 > row0:
        rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, S_LAYOUT))
        keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
    return _online_softmax(s, m_i, l_i, qk_scale)


@gluon.jit
def _softmax_prefix(s, m_i, l_i, key0, n_prefix, qk_scale, S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr):
    """`_softmax` for a tile of cached-prefix keys ``key0 ..`` (`prefill_gluon_prefix_kernel`):
    no causal mask (every query follows every prefix key); keys ``>= n_prefix`` are masked."""
    if key0 + BLOCK_N > n_prefix:
        keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where((keys < n_prefix)[None, :], s, float("-inf"))
    return _online_softmax(s, m_i, l_i, qk_scale)


@gluon.jit
def _tile_softmax(s, m_i, l_i, i, n_ext, n_tiles, row0, n_prefix, qk_scale, S_LAYOUT: gl.constexpr,
                  BLOCK_N: gl.constexpr, PREFIX: gl.constexpr):
    """Softmax of processed tile ``i``: one of the ``n_ext`` new-token tiles (causal) or, with
    ``PREFIX``, a prefix tile after them."""
    if PREFIX:
        if i < n_ext:
            m_i, alpha, l_i, p = _softmax(s, m_i, l_i, (n_ext - 1 - i) * BLOCK_N, row0, qk_scale, S_LAYOUT, BLOCK_N)
        else:
            m_i, alpha, l_i, p = _softmax_prefix(s, m_i, l_i, (n_tiles - 1 - i) * BLOCK_N, n_prefix, qk_scale,
                                                 S_LAYOUT, BLOCK_N)
    else:
        m_i, alpha, l_i, p = _softmax(s, m_i, l_i, (n_tiles - 1 - i) * BLOCK_N, row0, qk_scale, S_LAYOUT, BLOCK_N)
    return m_i, alpha, l_i, p


@gluon.jit
def _p_operand(p, dtype: gl.constexpr):
    return gl.convert_layout(p.to(dtype), P_OPERAND)


@gluon.jit
def _rows_o(x):
    return gl.convert_layout(x, O_ROWS)


@gluon.jit
def _consumer(q_s, k_s, v_s, bars, n_tiles, m0, ext_len, out_ptr, stride_ot, qk_scale,
              W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warpgroup ``W``: rows ``m0 + 64 W ..`` of the tile; ``out_ptr`` points at the
    request's first row of this head's output, ``stride_ot`` its row stride (elements)."""
    _consumer_pipeline(q_s, k_s, v_s, bars, n_tiles, n_tiles, m0, ext_len, out_ptr, stride_ot, qk_scale,
                       W, BLOCK_N, STAGES, False)


@gluon.jit
def _consumer_pipeline(q_s, k_s, v_s, bars, n_ext, n_prefix, m0, ext_len, out_ptr, stride_ot, qk_scale,
                       W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PREFIX: gl.constexpr):
    """The consumer schedule over the ``n_ext`` new-token tiles and, with ``PREFIX``, then the
    ``ceil(n_prefix / BLOCK_N)`` cached-prefix tiles (`prefill_gluon_prefix_kernel`, whose
    cp.async-filled slots need a proxy fence after each ready wait; without ``PREFIX``
    ``n_prefix`` is unused)."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    q_ready, k_ready, v_ready, k_free, v_free, sched = bars
    dtype: gl.constexpr = q_s.dtype
    if PREFIX:
        n_tiles = n_ext + (n_prefix + BLOCK_N - 1) // BLOCK_N
    else:
        n_tiles = n_ext
    q_w = q_s.index(W)
    row0 = m0 + W * HALF_M
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, S_LAYOUT)
    m_i = gl.full([HALF_M], -1.0e30, gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    o = gl.zeros([HALF_M, HEAD_D], gl.float32, O_LAYOUT)
    mbarrier.wait(q_ready, 0)

    # tile 0 (the diagonal): scores only
    mbarrier.wait(k_ready.index(0), 0)
    _take_turn(sched, 0, W)
    s_tok = warpgroup_mma(q_w, k_s.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(sched.index(1 - W))
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(k_free.index(0))
    m_i, alpha, l_i, p = _softmax(s, m_i, l_i, (n_ext - 1) * BLOCK_N, row0, qk_scale, S_LAYOUT, BLOCK_N)
    p_op = _p_operand(p, dtype)

    for i in range(1, n_tiles):
        sk, phk = _stage(i, STAGES)
        sv, phv = _stage(i - 1, STAGES)
        mbarrier.wait(k_ready.index(sk), phk)
        mbarrier.wait(v_ready.index(sv), phv)
        if PREFIX:
            fence_async_shared()  # cp.async (generic proxy) writes before wgmma (async proxy) reads
        _take_turn(sched, i, W)
        s_tok = warpgroup_mma(q_w, k_s.index(sk).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_op, v_s.index(sv), o, is_async=True)
        mbarrier.arrive(sched.index(1 - W))
        s = warpgroup_mma_wait(1, deps=[s_tok])  # the PV wgmma stays in flight
        mbarrier.arrive(k_free.index(sk))
        m_i, alpha, l_i, p = _tile_softmax(s, m_i, l_i, i, n_ext, n_tiles, row0, n_prefix, qk_scale,
                                           S_LAYOUT, BLOCK_N, PREFIX)
        o, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        mbarrier.arrive(v_free.index(sv))
        o = o * _rows_o(alpha)[:, None]
        p_op = _p_operand(p, dtype)

    # the last tile's PV
    sv, phv = _stage(n_tiles - 1, STAGES)
    mbarrier.wait(v_ready.index(sv), phv)
    if PREFIX:
        fence_async_shared()
    _take_turn(sched, n_tiles, W)
    o_tok = warpgroup_mma(p_op, v_s.index(sv), o, is_async=True)
    mbarrier.arrive(sched.index(1 - W))
    o, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
    mbarrier.arrive(v_free.index(sv))

    # every row saw at least (new) key 0, so l_i > 0
    out = o / _rows_o(l_i)[:, None]
    rows = row0 + gl.arange(0, HALF_M, layout=O_ROWS)
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, O_LAYOUT))
    ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_ot + cols[None, :]
    gl.store(ptrs, out.to(dtype), mask=(rows < ext_len)[:, None] & (cols < HEAD_D)[None, :])


@gluon.jit
def _alloc_ring(dtype: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, READY_COUNT: gl.constexpr):
    """Shared memory of one program: the Q tile ``[2, 64, 128]``, the K / V rings ``[STAGES,
    BLOCK_N, 128]`` (128-byte NVMMA swizzle) and the initialised barriers ``(q_ready, k_ready,
    v_ready, k_free, v_free, sched)`` (``READY_COUNT`` arrivals complete a K / V ready phase).
    Returns ``(q_s, k_s, v_s, bars)``; call it before `gl.warp_specialize`."""
    sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_s = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_D], sw)
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], sw)
    v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], sw)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=READY_COUNT)
        mbarrier.init(v_ready.index(s), count=READY_COUNT)
        mbarrier.init(k_free.index(s), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(v_free.index(s), count=2)
    mbarrier.init(sched.index(0), count=1)
    mbarrier.init(sched.index(1), count=1)
    fence_async_shared()
    gl.thread_barrier()
    return q_s, k_s, v_s, (q_ready, k_ready, v_ready, k_free, v_free, sched)
