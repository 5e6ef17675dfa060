"""Loader partitions of the seesaw MLA stage 1 (`mla_decode_seesaw`): TMA copies, 16-bit and fp8.

``_loader`` (1 warp) issues the TMA copies of a 16-bit cache's blocks, chunk group by
chunk group, in the order the compute warpgroups (`mla_seesaw_warpgroups`) release them;
each group completes on its "ready" barrier. ``_loader_fp8`` (4 warps) does the same for an
fp8 cache (e4m3fn / e5m2): each fp8 ``[64, 64]`` chunk lands in the upper half of its
16-bit slot (completing on a "land" barrier) and is converted in place to fp16 before the
group's "ready" barrier is arrived. Barrier protocol, release order and the measurements
behind the conversion schedule: `mla_decode_seesaw` and benchmarks/NOTES.md (Sessions 10,
12). Gluon is experimental; written against Triton 3.6 and imported only when used.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

from attnserve.attention.triton_ops.mla_seesaw_warpgroups import BLOCK_N, CHUNK, _chunk, _num_pairs

__all__: list[str] = []  # kernel-internal; the public names are `mla_decode_seesaw`'s


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
