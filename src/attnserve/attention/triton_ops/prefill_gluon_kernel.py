"""The Gluon causal prefill kernel's entry (`prefill_gluon`): program indexing, shared memory,
barriers and the partition launch. The partitions are `prefill_gluon_partitions`'s; the
host side, the schedule and the budgets are described in `prefill_gluon`. Gluon is
experimental; written against Triton 3.6 and imported only when used.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from attnserve.attention.triton_ops.prefill_gluon_partitions import HALF_M, HEAD_D, _consumer, _loader

__all__: list[str] = []


@gluon.jit(do_not_specialize=["num_m_blocks"])
def _prefill_fwd_kernel(
    q_desc, k_desc, v_desc, out_ptr, start_ptr, len_ptr,
    stride_ot, stride_oh, qk_scale, num_m_blocks,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    FROM_INDPTR: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    gl.static_assert(BLOCK_M == 2 * HALF_M, "two consumer warpgroups of 64 rows")
    h = gl.program_id(0)
    b = gl.program_id(1)
    mb = num_m_blocks - 1 - gl.program_id(2)  # query tiles with the most keys first
    start = gl.load(start_ptr + b).to(gl.int32)
    if FROM_INDPTR:
        ext_len = gl.load(start_ptr + b + 1).to(gl.int32) - start
    else:
        ext_len = gl.load(len_ptr + b).to(gl.int32)
    m0 = mb * BLOCK_M
    if m0 < ext_len:
        n_tiles = (gl.minimum(m0 + BLOCK_M, ext_len) + BLOCK_N - 1) // BLOCK_N
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
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(k_free.index(s), count=2)  # one arrive per consumer warpgroup
            mbarrier.init(v_free.index(s), count=2)
        mbarrier.init(sched.index(0), count=1)
        mbarrier.init(sched.index(1), count=1)
        fence_async_shared()
        gl.thread_barrier()
        bars = (q_ready, k_ready, v_ready, k_free, v_free, sched)
        out = out_ptr + start.to(gl.int64) * stride_ot + h * stride_oh
        gl.warp_specialize([
            (_consumer, (q_s, k_s, v_s, bars, n_tiles, m0, ext_len, out, stride_ot, qk_scale, 0, BLOCK_N, STAGES)),
            (_consumer, (q_s, k_s, v_s, bars, n_tiles, m0, ext_len, out, stride_ot, qk_scale, 1, BLOCK_N, STAGES)),
            (_loader, (q_s, k_s, v_s, bars, q_desc, k_desc, v_desc, start + m0, h * HEAD_D, start,
                       (h // GROUP) * HEAD_D, n_tiles, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
