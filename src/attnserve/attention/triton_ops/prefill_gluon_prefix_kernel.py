"""The Gluon causal prefill kernel over a cached prefix (`prefill_gluon`, ``k_buffer`` given):
entry, gather loader and consumers. A separate specialization of `prefill_gluon_kernel`, so
the plain (no-prefix) kernel's code is untouched.

Key order of one program (128 query rows of request ``b``, query head ``h``): first the new
tokens' key tiles from the causal diagonal down to new key 0 (TMA, as the plain kernel), then
the prefix tiles from the last (partial) one down to prefix key 0. Every query row sees every
prefix key, so only the last prefix tile is masked (keys ``>= n_prefix``).

Prefix rows are gathered through ``kv_indices[kv_indptr[b] + j]`` (token slots of the paged
``k_buffer`` / ``v_buffer`` ``[num_slots, Hkv, 128]``; any page size): TMA cannot gather on
sm_90, so the loader is a full warpgroup (4 warps; the plain kernel's 1-warp loader sits in a
warpgroup of its own anyway, so the register budget is the same) issuing ``cp.async`` of 16 B
a thread (`GATHER`: 2 threads a 32-byte sector, 16 rows a warp instruction; 16 copies a
thread per K or V tile of 128 keys) into the same NVMMA-swizzled ring the TMA tiles use. Rows
past the prefix are zero-filled. Completion: each loader thread's
``cp.async.mbarrier.arrive.noinc`` on the slot's ready barrier (count = the loader's 128
threads; PTX ISA, "cp.async.mbarrier.arrive"); a TMA tile's ready barrier gets the elected
thread's ``expect`` (1 arrival + bytes) plus ``arrive(count=127)``. The consumers fence the
generic proxy (cp.async writes) against the async proxy (wgmma reads) after each wait. The
slot indices of the next prefix tile are loaded one tile ahead, so no gather waits on an
index load (as `decode_fp8_gluon_kernel`). Gluon is experimental; written against Triton 3.6
and imported only when used.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnserve.attention.triton_ops.prefill_gluon_partitions import (
    HALF_M,
    HEAD_D,
    O_LAYOUT,
    O_ROWS,
    _p_operand,
    _rows_o,
    _softmax,
    _stage,
    _take_turn,
)

__all__: list[str] = []

LOADER_WARPS = gl.constexpr(4)
LOADER_THREADS = gl.constexpr(128)
# [BLOCK_N, 128] 16-bit gather: 8 values (16 B, one cp.async) a thread, 2 threads a row
# segment of 32 B (one sector), 16 rows a warp, 4 warps along the rows
GATHER = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))


@gluon.jit
def _prefix_rows(idx_ptr, key0, n_prefix, BLOCK_N: gl.constexpr):
    """Cache slots (int64) of prefix keys ``key0 .. key0 + BLOCK_N - 1`` (``idx_ptr``: the
    request's first kv_indices entry) and their validity (``0 <= key < n_prefix``); invalid
    keys read no index and are never copied (zero-filled)."""
    keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GATHER))
    valid = (keys < n_prefix) & (keys >= 0)
    slots = gl.load(idx_ptr + keys, mask=valid, other=0)
    return slots.to(gl.int64), valid


@gluon.jit
def _softmax_prefix(s, m_i, l_i, key0, n_prefix, qk_scale, S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr):
    """`prefill_gluon_partitions._softmax` for a prefix tile (keys ``key0 ..``): no causal
    mask (every query follows every prefix key); keys ``>= n_prefix`` are masked."""
    if key0 + BLOCK_N > n_prefix:
        keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where((keys < n_prefix)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return m_new, alpha, l_new, p


@gluon.jit
def _loader(q_s, k_s, v_s, bars, q_desc, k_desc, v_desc, q_row, q_col, kv_row, kv_col, n_ext,
            k_head_ptr, v_head_ptr, stride_kbt, stride_vbt, idx_ptr, n_prefix,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Worker partition (4 warps): Q and the new-token tiles by TMA (one elected thread), then
    the prefix tiles by cp.async gathers (every thread), in the consumers' order."""
    q_ready, k_ready, v_ready, k_free, v_free, sched = bars
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_ready, q_s.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, q_col], q_ready, q_s.index(1))
    for i in range(n_ext):
        s, ph = _stage(i, STAGES)
        row = kv_row + (n_ext - 1 - i) * BLOCK_N
        mbarrier.wait(k_free.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        mbarrier.arrive(k_ready.index(s), count=LOADER_THREADS - 1)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_s.index(s))
        mbarrier.wait(v_free.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        mbarrier.arrive(v_ready.index(s), count=LOADER_THREADS - 1)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_s.index(s))

    n_pre = (n_prefix + BLOCK_N - 1) // BLOCK_N
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, GATHER))
    slots, valid = _prefix_rows(idx_ptr, (n_pre - 1) * BLOCK_N, n_prefix, BLOCK_N)
    for j in range(n_pre):
        s, ph = _stage(n_ext + j, STAGES)
        nxt, nxt_valid = _prefix_rows(idx_ptr, (n_pre - 2 - j) * BLOCK_N, n_prefix, BLOCK_N)
        m = valid[:, None]
        mbarrier.wait(k_free.index(s), ph ^ 1)
        async_copy.async_copy_global_to_shared(
            k_s.index(s), k_head_ptr + (slots * stride_kbt)[:, None] + cols[None, :], mask=m)
        async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)
        mbarrier.wait(v_free.index(s), ph ^ 1)
        async_copy.async_copy_global_to_shared(
            v_s.index(s), v_head_ptr + (slots * stride_vbt)[:, None] + cols[None, :], mask=m)
        async_copy.mbarrier_arrive(v_ready.index(s), increment_count=False)
        slots, valid = nxt, nxt_valid


@gluon.jit
def _tile_softmax(s, m_i, l_i, i, n_ext, n_tiles, row0, n_prefix, qk_scale, S_LAYOUT: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """Softmax of processed tile ``i``: a new-token tile (causal) or a prefix tile."""
    if i < n_ext:
        m_i, alpha, l_i, p = _softmax(s, m_i, l_i, (n_ext - 1 - i) * BLOCK_N, row0, qk_scale, S_LAYOUT, BLOCK_N)
    else:
        m_i, alpha, l_i, p = _softmax_prefix(s, m_i, l_i, (n_tiles - 1 - i) * BLOCK_N, n_prefix, qk_scale,
                                             S_LAYOUT, BLOCK_N)
    return m_i, alpha, l_i, p


@gluon.jit
def _consumer(q_s, k_s, v_s, bars, n_ext, n_prefix, m0, ext_len, out_ptr, stride_ot, qk_scale,
              W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warpgroup ``W`` (`prefill_gluon_partitions._consumer`'s schedule) over the
    ``n_ext`` new-token tiles and then the prefix tiles."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    q_ready, k_ready, v_ready, k_free, v_free, sched = bars
    dtype: gl.constexpr = q_s.dtype
    n_tiles = n_ext + (n_prefix + BLOCK_N - 1) // BLOCK_N
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
        fence_async_shared()  # cp.async (generic proxy) writes before wgmma (async proxy) reads
        _take_turn(sched, i, W)
        s_tok = warpgroup_mma(q_w, k_s.index(sk).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_op, v_s.index(sv), o, is_async=True)
        mbarrier.arrive(sched.index(1 - W))
        s = warpgroup_mma_wait(1, deps=[s_tok])  # the PV wgmma stays in flight
        mbarrier.arrive(k_free.index(sk))
        m_i, alpha, l_i, p = _tile_softmax(s, m_i, l_i, i, n_ext, n_tiles, row0, n_prefix, qk_scale,
                                           S_LAYOUT, BLOCK_N)
        o, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        mbarrier.arrive(v_free.index(sv))
        o = o * _rows_o(alpha)[:, None]
        p_op = _p_operand(p, dtype)

    # the last tile's PV
    sv, phv = _stage(n_tiles - 1, STAGES)
    mbarrier.wait(v_ready.index(sv), phv)
    fence_async_shared()
    _take_turn(sched, n_tiles, W)
    o_tok = warpgroup_mma(p_op, v_s.index(sv), o, is_async=True)
    mbarrier.arrive(sched.index(1 - W))
    o, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
    mbarrier.arrive(v_free.index(sv))

    # every row saw at least new key 0, so l_i > 0
    out = o / _rows_o(l_i)[:, None]
    rows = row0 + gl.arange(0, HALF_M, layout=O_ROWS)
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, O_LAYOUT))
    ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_ot + cols[None, :]
    gl.store(ptrs, out.to(dtype), mask=(rows < ext_len)[:, None] & (cols < HEAD_D)[None, :])


@gluon.jit(do_not_specialize=["num_m_blocks"])
def _prefill_prefix_fwd_kernel(
    q_desc, k_desc, v_desc, out_ptr, qo_indptr_ptr, k_buf_ptr, v_buf_ptr, kv_indptr_ptr, kv_indices_ptr,
    stride_ot, stride_oh, stride_kbt, stride_kbh, stride_vbt, stride_vbh, qk_scale, num_m_blocks,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    gl.static_assert(BLOCK_M == 2 * HALF_M, "two consumer warpgroups of 64 rows")
    h = gl.program_id(0)
    b = gl.program_id(1)
    mb = num_m_blocks - 1 - gl.program_id(2)  # query tiles with the most keys first
    start = gl.load(qo_indptr_ptr + b).to(gl.int32)
    ext_len = gl.load(qo_indptr_ptr + b + 1).to(gl.int32) - start
    m0 = mb * BLOCK_M
    if m0 < ext_len:
        kv_start = gl.load(kv_indptr_ptr + b)
        n_prefix = (gl.load(kv_indptr_ptr + b + 1) - kv_start).to(gl.int32)
        n_ext = (gl.minimum(m0 + BLOCK_M, ext_len) + BLOCK_N - 1) // BLOCK_N
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        dtype: gl.constexpr = q_desc.dtype
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
            mbarrier.init(k_ready.index(s), count=LOADER_THREADS)  # one arrive per loader thread
            mbarrier.init(v_ready.index(s), count=LOADER_THREADS)
            mbarrier.init(k_free.index(s), count=2)  # one arrive per consumer warpgroup
            mbarrier.init(v_free.index(s), count=2)
        mbarrier.init(sched.index(0), count=1)
        mbarrier.init(sched.index(1), count=1)
        fence_async_shared()
        gl.thread_barrier()
        bars = (q_ready, k_ready, v_ready, k_free, v_free, sched)
        out = out_ptr + start.to(gl.int64) * stride_ot + h * stride_oh
        kv_head = h // GROUP
        k_head = k_buf_ptr + kv_head.to(gl.int64) * stride_kbh
        v_head = v_buf_ptr + kv_head.to(gl.int64) * stride_vbh
        gl.warp_specialize([
            (_consumer, (q_s, k_s, v_s, bars, n_ext, n_prefix, m0, ext_len, out, stride_ot, qk_scale, 0, BLOCK_N,
                         STAGES)),
            (_consumer, (q_s, k_s, v_s, bars, n_ext, n_prefix, m0, ext_len, out, stride_ot, qk_scale, 1, BLOCK_N,
                         STAGES)),
            (_loader, (q_s, k_s, v_s, bars, q_desc, k_desc, v_desc, start + m0, h * HEAD_D, start, kv_head * HEAD_D,
                       n_ext, k_head, v_head, stride_kbt, stride_vbt, kv_indices_ptr + kv_start, n_prefix,
                       BLOCK_N, STAGES)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
