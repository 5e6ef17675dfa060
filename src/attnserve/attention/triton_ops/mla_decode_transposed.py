"""MLA decode stage 1 for an fp8 cache and few heads on Hopper: transposed Gluon kernel.

Same math, grid, split scheme, workspace and outputs as ``_mla_decode_stage1`` in
`mla_decode_triton` (the merge, stage 2, is `mla_common`'s). One program (one warpgroup,
4 warps) holds ``BLOCK_H`` = 16 heads of one request and one KV split and walks the split
in 64-token tiles, computing the transposed products

* ``S^T = K q^T``: ``[64 tokens, 16 heads]``, wgmma ``m64n16k16`` with the K tile as the
  A operand *from registers* (each thread loads 16 contiguous fp8 bytes of a token row from
  the TMA staging buffer and converts them to fp16 in registers) and ``q^T`` (fp16, in
  shared memory, stored once) as B;
* ``O^T += V^T P^T``: ``[512 latent dims, 16 heads]`` as 8 accumulators ``[64, 16]``, A =
  ``V^T`` from registers (4 consecutive latent dims of one token per 32-bit shared load,
  converted to fp16 and regrouped into token pairs in registers), B = ``P^T`` (fp16, in
  shared memory, 2 KB a tile).

So the fp8 tile is never written back to shared memory as fp16 (which the seesaw kernel,
`mla_decode_seesaw`, must do because its wgmma B operands come from shared memory).

The register operands use permuted contraction and row orders so that a thread's
elements are contiguous bytes in shared memory: a wgmma A fragment holds, per row, the
k indices ``2c, 2c + 1, 2c + 8, 2c + 9`` (+16 per k-step, ``c`` = lane % 4). For the scores
the 64 latent dims of a chunk are read in the order ``16c + 4s + 2h + e`` for logical
``16s + 8h + 2c + e`` (the queries are stored with the same permutation, so the dot product
is unchanged). For ``V^T`` the rows (latent dims) of two consecutive 64-row wgmma tiles are
assigned so that a thread holds 4 consecutive dims (its output rows are permuted back when
stored), and the tokens (the contraction) so that a 32-bit load of 4 lanes lands in 4
different shared-memory banks; ``P^T`` is stored with the same token permutation.

Online softmax over the token axis (columns = heads): the column max is reduced across the
warpgroup's 4 warps every tile, the column sums are kept as a ``[64, 16]`` partial and
reduced once at the end. Loads: every tile (also a split's partial last one: its rows lie
inside the page) by 9 TMA copies of ``[64, 64]`` fp8 boxes, ``NUM_STAGES`` (2 or 4) tiles in flight;
the rows of a partial tile past ``seq_lens`` are zeroed in shared memory before use.
``out_scale`` (the cache's kv_scale; the host folds it into ``sm_scale_log2`` too) multiplies
the output. bf16 queries are converted with saturation to fp16 (+-65504) once.

Compiled (sm_90a): 219 registers, no spills; 94,480 B shared memory at 2 stages (two
programs an SM), 168,224 B at 4. H100, e4m3, stage 1 + merge (benchmarks/NOTES.md, Session 12
transposed kernel): 16 heads bs 128 x 4K 142.7 us at one split (fp8 seesaw 166.6, bf16
default 222.8), 126.7 us at two (what `mla_split_sm_count` gives an fp8 cache of <= 16
heads: two programs an SM); 128 heads bs 32 x 16K 700 us (seesaw 329): every 16 heads
re-read and re-convert the whole cache, so `mla_decode` picks it up to 16 heads only.

Needs sm_90, fp16/bf16 queries, an fp8 (e4m3fn / e5m2) cache, kv_lora_rank 512 + rope 64,
``page_size % 64 == 0`` and TMA-compatible strides (`mla_decode.mla_seesaw_fp8_applicable`).
Gluon is experimental; written against Triton 3.6 and imported only when used.
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

from attnserve.attention.triton_ops.mla_common import MLAStage1Args, _program_item, _split_bounds
from attnserve.attention.triton_ops.mla_decode_seesaw import _to_mma

__all__ = ["launch_transposed_stage1", "TRANSPOSED_BLOCK_H"]

TRANSPOSED_BLOCK_H = 16
BLOCK_H = gl.constexpr(16)
BLOCK_N = gl.constexpr(64)
CHUNK = gl.constexpr(64)
N_CHUNKS = gl.constexpr(9)  # 512 / 64 c_kv chunks + 1 k_pe chunk
# [64 tokens or latent dims, 16 heads] accumulators of one warpgroup, and the register A operand
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2))
# fp8 staging of one tile: 9 TMA boxes [64 tokens, 64 dims] (64-byte swizzle)
STAGE_SW = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
STAGE_SW_3D = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=3))
# scores' K operand: a thread reads 16 contiguous bytes (dims 16c .. 16c + 15, c = lane % 4) of
# tokens 16w + r and 16w + r + 8 (w warp, r = lane // 4) of a [64, 64] chunk
K_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
# V^T operand over two chunks [2, 64 tokens, 64 dims]: a thread reads 4 contiguous bytes
# (dims 32 (w % 2) + 4r .. + 3 of chunk w // 2) of 16 tokens; lanes c = lane % 4 take tokens
# differing in bits 0 and 2 (rows 0, 1, 4, 5 of the 64-byte swizzle: distinct banks)
V_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 2, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0]],
    lane_bases=[[0, 1, 0], [0, 4, 0], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
    warp_bases=[[0, 0, 32], [1, 0, 0]], block_bases=[], shape=[2, 64, 64]))


@gluon.jit
def _chunk(stage, c: gl.constexpr):
    """Chunk ``c`` (c_kv 0..7, k_pe 8) ``[64 tokens, 64]`` of a staged tile (c_kv, k_pe)."""
    if c == N_CHUNKS - 1:
        r = stage[1]
    else:
        r = stage[0].slice(c * BLOCK_N, BLOCK_N, 0)
    return r


@gluon.jit
def _perm_dims(x):
    """``[R, 64]`` -> ``[R, 64]`` with column ``16s + 8h + 2c + e`` = input column
    ``16c + 4s + 2h + e`` (the scores' contraction order)."""
    R: gl.constexpr = x.shape[0]
    return x.reshape([R, 4, 4, 2, 2]).permute((0, 2, 3, 1, 4)).reshape([R, 64])


@gluon.jit
def _k_operand(stage, c: gl.constexpr, dtype: gl.constexpr):
    """Chunk ``c`` of the staged tile as the scores' A operand ``[64 tokens, 64]`` (fp16)."""
    x = _chunk(stage, c).load(K_LOAD).to(dtype)
    return gl.convert_layout(_perm_dims(x), A_OP)


@gluon.jit
def _v_operands(stage, p: gl.constexpr, dtype: gl.constexpr):
    """c_kv chunks ``2p``, ``2p + 1`` of the staged tile as two ``V^T`` A operands
    ``[64 dims, 64 tokens]`` (fp16): logical row ``16w + 8j + r`` of operand ``ii`` is latent
    dim ``128p + 32w + 4r + 2ii + j`` (`_out_dims`), logical token ``4T + 2t0 + t1`` is token
    ``4T + 2t1 + t0`` (`_p_transposed`)."""
    v = stage[0]._reinterpret(stage[0].dtype, [8, BLOCK_N, CHUNK], STAGE_SW_3D).slice(2 * p, 2).load(V_LOAD)
    v = v.to(dtype)
    # [ch, T, t1, t0, w0, r, ii, j] -> [ch, w0, j, r, T, t0, t1, ii]
    v = v.reshape([2, 16, 2, 2, 2, 8, 2, 2]).permute((0, 4, 7, 5, 1, 3, 2, 6)).reshape([64, 64, 2])
    a0, a1 = v.split()
    return gl.convert_layout(a0, A_OP), gl.convert_layout(a1, A_OP)


@gluon.jit
def _p_transposed(p):
    """P ``[64 tokens, 16]`` -> ``P^T`` ``[16, 64]`` with tokens in `_v_operands`' order
    (bits 0 and 1 of the token index swapped)."""
    return p.reshape([16, 2, 2, BLOCK_H]).permute((0, 2, 1, 3)).reshape([BLOCK_N, BLOCK_H]).permute((1, 0))


@gluon.jit
def _out_dims(i: gl.constexpr):
    """Latent dims of the rows of output accumulator ``i`` (see `_v_operands`)."""
    row = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    return 128 * (i // 2) + 32 * (row >> 4) + 4 * (row & 7) + 2 * (i % 2) + ((row >> 3) & 1)


@gluon.jit
def _scores(stage, q_s, dtype: gl.constexpr):
    """Unscaled ``S^T = K q^T`` ``[64 tokens, 16]`` fp32 of the staged tile; chunk ``c + 1``
    is loaded and converted while chunk ``c``'s wgmma runs."""
    a = _k_operand(stage, 0, dtype)
    s = warpgroup_mma(a, q_s.index(0).permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_H], gl.float32, ACC),
                      use_acc=False, is_async=True)
    for c in gl.static_range(1, N_CHUNKS):
        an = _k_operand(stage, c, dtype)
        s = warpgroup_mma(an, q_s.index(c).permute((1, 0)), s, is_async=True)
        s, a = warpgroup_mma_wait(1, deps=[s, a])  # chunk c - 1 done: its registers may be reused
        a = an
    s, a = warpgroup_mma_wait(0, deps=[s, a])
    return s


@gluon.jit
def _pv(stage, pt, accs, dtype: gl.constexpr):
    """``O^T += V^T P^T`` over the 8 accumulators ``accs`` (``pt``: ``P^T`` ``[16, 64]`` in
    shared memory); pair ``p + 1``'s operands are loaded while pair ``p``'s wgmmas run."""
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = accs
    b = pt.permute((1, 0))
    a0, a1 = _v_operands(stage, 0, dtype)
    acc0 = warpgroup_mma(a0, b, acc0, is_async=True)
    acc1 = warpgroup_mma(a1, b, acc1, is_async=True)
    b0, b1 = _v_operands(stage, 1, dtype)
    acc2 = warpgroup_mma(b0, b, acc2, is_async=True)
    acc3 = warpgroup_mma(b1, b, acc3, is_async=True)
    acc0, acc1, a0, a1 = warpgroup_mma_wait(2, deps=[acc0, acc1, a0, a1])
    a0, a1 = _v_operands(stage, 2, dtype)
    acc4 = warpgroup_mma(a0, b, acc4, is_async=True)
    acc5 = warpgroup_mma(a1, b, acc5, is_async=True)
    acc2, acc3, b0, b1 = warpgroup_mma_wait(2, deps=[acc2, acc3, b0, b1])
    b0, b1 = _v_operands(stage, 3, dtype)
    acc6 = warpgroup_mma(b0, b, acc6, is_async=True)
    acc7 = warpgroup_mma(b1, b, acc7, is_async=True)
    acc4, acc5, acc6, acc7, a0, a1, b0, b1 = warpgroup_mma_wait(0, deps=[acc4, acc5, acc6, acc7, a0, a1, b0, b1])
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@gluon.jit
def _zero_tail_rows(stage, valid):
    """Zero token rows ``valid..63`` of the staged c_kv chunks (read as V; the pool rows past
    the sequence may hold anything, NaN included)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    for c in gl.static_range(N_CHUNKS - 1):
        x = _chunk(stage, c).load(ld)
        _chunk(stage, c).store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))
    gl.thread_barrier()


@gluon.jit
def _issue(desc, table, n0, bar, stage, PAGE_SIZE: gl.constexpr):
    page = gl.load(table + n0 // PAGE_SIZE)
    row0 = page * PAGE_SIZE + n0 % PAGE_SIZE
    mbarrier.expect(bar, N_CHUNKS * desc.block_type.nbytes)
    for c in gl.static_range(N_CHUNKS):
        tma.async_copy_global_to_shared(desc, [row0, c * CHUNK], bar, _chunk(stage, c))


@gluon.jit(do_not_specialize=["num_heads", "num_splits_scalar"])
def _mla_decode_stage1_transposed(
    QNope, QPe, KV, desc, desc_unused, BlockTable, SeqLens, NumSplits, Work,
    OPart, LsePart, O, Lse,
    sm_scale_log2, num_heads, num_splits_scalar,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_kv_t, stride_bt_b,
    stride_op_b, stride_op_h, stride_op_s, stride_lp_b, stride_lp_h,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    D_C: gl.constexpr, D_R: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr,
    MAX_KV_SPLITS: gl.constexpr, PER_REQ_SPLITS: gl.constexpr, HAS_LSE: gl.constexpr, WORK_ITEMS: gl.constexpr,
    out_scale=1.0, NUM_STAGES: gl.constexpr = 2,
):
    gl.static_assert(D_C == 512 and D_R == 64 and BLOCK_N == 64, "transposed kernel: 512 + 64 dims, 64-token tiles")
    dtype: gl.constexpr = gl.float16
    fp8: gl.constexpr = desc.dtype
    q_sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])

    pid_h = gl.program_id(0)
    b, split_id = _program_item(Work, gl.program_id(1), gl.program_id(2), MAX_KV_SPLITS, WORK_ITEMS)
    kv_len, per_split, n_eff = _split_bounds(SeqLens, NumSplits, b, num_splits_scalar, MAX_KV_SPLITS, BLOCK_N,
                                             PER_REQ_SPLITS)
    start = split_id * per_split
    end = gl.minimum(start + per_split, kv_len)

    if start < end:
        # q [16, 576] as 9 chunks [16, 64] (fp16, dims permuted as the scores' K operand)
        q_s = gl.allocate_shared_memory(dtype, [N_CHUNKS, BLOCK_H, CHUNK], q_sw)
        offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_ld))
        offs_k = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, q_ld))
        mh = (offs_h < num_heads)[:, None]
        for c in gl.static_range(N_CHUNKS):
            if c < N_CHUNKS - 1:
                x = gl.load(QNope + b * stride_qn_b + offs_h[:, None] * stride_qn_h + c * CHUNK + offs_k[None, :],
                            mask=mh, other=0.0)
            else:
                x = gl.load(QPe + b * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_k[None, :], mask=mh,
                            other=0.0)
            q_s.index(c).store(_perm_dims(_to_mma(x, dtype)))
        # staged tiles: c_kv [NUM_STAGES, 512, 64] and k_pe [NUM_STAGES, 64, 64] (shapes must be powers of two)
        kc_s = gl.allocate_shared_memory(fp8, [NUM_STAGES, D_C, CHUNK], STAGE_SW)
        kr_s = gl.allocate_shared_memory(fp8, [NUM_STAGES, BLOCK_N, CHUNK], STAGE_SW)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], q_sw)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()

        table = BlockTable + b * stride_bt_b
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        for i in gl.static_range(NUM_STAGES):
            if i < n_tiles:
                _issue(desc, table, start + i * BLOCK_N, bars.index(i), (kc_s.index(i), kr_s.index(i)), PAGE_SIZE)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, ACC))
        l_i = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, ACC)
        z = gl.zeros([64, BLOCK_H], gl.float32, ACC)
        accs = (z, z, z, z, z, z, z, z)
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
        for i in range(n_tiles):
            st = i % NUM_STAGES
            n0 = start + i * BLOCK_N
            stage = (kc_s.index(st), kr_s.index(st))
            mbarrier.wait(bars.index(st), (i // NUM_STAGES) & 1)
            if n0 + BLOCK_N > end:
                _zero_tail_rows(stage, end - n0)
            s = _scores(stage, q_s, dtype) * sm_scale_log2
            if n0 + BLOCK_N > end:
                s = gl.where((rows < end - n0)[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l_i = l_i * alpha[None, :] + p
            m_i = m_new
            p_s.store(_p_transposed(p.to(dtype)))
            fence_async_shared()
            gl.thread_barrier()  # P^T complete (all 4 warps) before the wgmmas read it
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = accs
            accs = (acc0 * alpha[None, :], acc1 * alpha[None, :], acc2 * alpha[None, :], acc3 * alpha[None, :],
                    acc4 * alpha[None, :], acc5 * alpha[None, :], acc6 * alpha[None, :], acc7 * alpha[None, :])
            accs = _pv(stage, p_s, accs, dtype)
            gl.thread_barrier()  # every warp is done with this stage and with P^T
            if i + NUM_STAGES < n_tiles:
                _issue(desc, table, n0 + NUM_STAGES * BLOCK_N, bars.index(st), stage, PAGE_SIZE)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(i))

        l_sum = gl.sum(l_i, axis=0)
        lse2 = m_i + gl.log2(l_sum)
        inv = out_scale / l_sum
        heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, ACC))
        mask = (heads < num_heads)[None, :]
        for i in gl.static_range(8):
            out = accs[i] * inv[None, :]
            dims = _out_dims(i)
            if n_eff == 1:
                gl.store(O + b * stride_o_b + heads[None, :] * stride_o_h + dims[:, None], out.to(O.dtype.element_ty),
                         mask=mask)
            else:
                gl.store(OPart + b * stride_op_b + heads[None, :] * stride_op_h + split_id * stride_op_s
                         + dims[:, None], out, mask=mask)
        if n_eff == 1:
            if HAS_LSE:
                gl.store(Lse + b * stride_lse_b + heads * stride_lse_h, lse2 / 1.4426950408889634,
                         mask=heads < num_heads)
        else:
            gl.store(LsePart + b * stride_lp_b + heads * stride_lp_h + split_id, lse2, mask=heads < num_heads)


def launch_transposed_stage1(args: MLAStage1Args, grid: tuple, constexprs: dict, num_stages: int,
                             out_scale: float = 1.0) -> None:
    """Launch `_mla_decode_stage1_transposed` over ``args`` (``desc_c`` from
    `mla_decode_seesaw.seesaw_descriptor` over the fp8 pool rows, ``desc_r`` unused; the grid's
    head tiles of ``TRANSPOSED_BLOCK_H`` heads); ``num_stages`` tiles (36 KB each) in flight;
    ``out_scale``: the cache's kv_scale (the caller folds it into ``args.sm_scale_log2`` too).
    ``constexprs`` as for every stage-1 kernel; its ``num_warps`` / ``num_stages`` are replaced
    (4 warps, one software stage)."""
    if args.kv.element_size() != 1:
        raise ValueError("the transposed stage 1 reads an fp8 cache")
    _mla_decode_stage1_transposed[grid](*args, out_scale=float(out_scale), NUM_STAGES=int(num_stages),
                                        **dict(constexprs, num_warps=4, num_stages=1))
