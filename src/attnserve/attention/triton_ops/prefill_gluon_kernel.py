"""The Gluon causal prefill kernel's entry (`prefill_gluon`): program indexing and the partition launch.
The partitions and the shared-memory / barrier setup are `prefill_gluon_partitions`'s; the
host side, the schedule and the budgets are described in `prefill_gluon`. Gluon is
experimental; written against Triton 3.6 and imported only when used.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from attnserve.attention.triton_ops.prefill_gluon_partitions import HALF_M, HEAD_D, _alloc_ring, _consumer, _loader

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
        dtype: gl.constexpr = q_desc.dtype
        q_s, k_s, v_s, bars = _alloc_ring(dtype, BLOCK_N, STAGES, 1)
        out = out_ptr + start.to(gl.int64) * stride_ot + h * stride_oh
        gl.warp_specialize([
            (_consumer, (q_s, k_s, v_s, bars, n_tiles, m0, ext_len, out, stride_ot, qk_scale, 0, BLOCK_N, STAGES)),
            (_consumer, (q_s, k_s, v_s, bars, n_tiles, m0, ext_len, out, stride_ot, qk_scale, 1, BLOCK_N, STAGES)),
            (_loader, (q_s, k_s, v_s, bars, q_desc, k_desc, v_desc, start + m0, h * HEAD_D, start,
                       (h // GROUP) * HEAD_D, n_tiles, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
