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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from attnserve.attention.triton_ops.prefill_gluon_partitions import (
    HALF_M,
    HEAD_D,
    _alloc_ring,
    _consumer_pipeline,
    _load_kv_tiles,
    _load_q,
    _stage,
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
def _loader(q_s, k_s, v_s, bars, q_desc, k_desc, v_desc, q_row, q_col, kv_row, kv_col, n_ext,
            k_head_ptr, v_head_ptr, stride_kbt, stride_vbt, idx_ptr, n_prefix,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Worker partition (4 warps): Q and the new-token tiles by TMA (one elected thread), then
    the prefix tiles by cp.async gathers (every thread), in the consumers' order."""
    q_ready, k_ready, v_ready, k_free, v_free, sched = bars
    _load_q(q_s, q_ready, q_desc, q_row, q_col)
    _load_kv_tiles(k_s, v_s, bars, k_desc, v_desc, kv_row, kv_col, n_ext, BLOCK_N, STAGES, LOADER_THREADS - 1)

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
def _consumer(q_s, k_s, v_s, bars, n_ext, n_prefix, m0, ext_len, out_ptr, stride_ot, qk_scale,
              W: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warpgroup ``W`` (`prefill_gluon_partitions._consumer`'s schedule) over the
    ``n_ext`` new-token tiles and then the prefix tiles."""
    _consumer_pipeline(q_s, k_s, v_s, bars, n_ext, n_prefix, m0, ext_len, out_ptr, stride_ot, qk_scale,
                       W, BLOCK_N, STAGES, True)


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
        dtype: gl.constexpr = q_desc.dtype
        q_s, k_s, v_s, bars = _alloc_ring(dtype, BLOCK_N, STAGES, LOADER_THREADS)  # one arrive per loader thread
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
