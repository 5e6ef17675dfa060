"""Gluon stage-1 kernel of paged decode attention over an fp8 (e4m3) KV cache, Hopper (sm_90).

Launched by `decode_fp8_gluon.gluon_fp8_decode_stage1`; same outputs as stage 1 of
`decode_attention` (``o`` for one-split requests, else ``attn_logits`` / ``attn_lse``), so
stage 2 (`decode_merge`) is reused unchanged. One program per (request ``b``, KV head,
split-grid slot ``z``) computes the request's splits ``z, z + G, ...`` (split bounds as in
`decode_splits._split_bounds`, re-stated here in Gluon).

Data flow of one split (4 warps, one partition):

* **Gather ring.** The split's keys are ``BLOCK_N``-key tiles; K and V rows of a tile (128 B
  each, rows ``kv_indices[...]``) are gathered with ``cp.async`` (16 B a thread, zero-filled
  past the split's end) into a ``NUM_BUF``-deep shared ring, one commit group per tile. The
  loop waits only for the oldest group (``wait_group(NUM_BUF - 2)``), so while tile ``t`` is
  computed, tiles ``t + 1 .. t + NUM_BUF - 2`` are in flight, and tile ``t + NUM_BUF - 1``
  is issued before tile ``t``'s compute starts (the multistage cp.async pipeline of Ampere
  GEMMs, NVIDIA CUTLASS "multistage" mainloop; PTX ISA ``cp.async.wait_group``). The next
  tile's kv_indices are loaded one iteration ahead, so no gather waits on an index load.
  (TMA cannot gather rows on sm_90, and Triton 3.6's pipeliner keeps one K/V buffer for these
  gathered loads: benchmarks/NOTES.md, "fp8-KV decode: offline instruction analysis".)
* **Orientation.** Keys are the MMA's M dimension and the GROUP query heads its N
  (padded to ``HP`` >= 8, mma.sync m16n8k16's minimum N): ``S^T[keys, heads] = K[keys, D] @
  q^T[D, heads]`` and ``O^T[D, heads] = V^T[D, keys] @ P^T[keys, heads]``. At GROUP 4 this
  pads N 2x where heads-as-M pads M 4x (16 rows), halving the MMAs and the exp2s a tile.
  ``mma_v2`` (mma.sync) takes register operands: the fp8 tiles are read from shared memory
  straight into the dot-operand layouts and converted in registers (e4m3 -> f16 is one
  ``cvt.rn.f16x2.e4m3x2`` per pair on sm_89+), with no f16 copy written back to shared memory
  (wgmma would need both operands in shared memory, or an fp8 K-major B operand). Only P^T
  (``BLOCK_N x HP`` f16) goes through shared memory (the compiler's layout conversion).
  ``PAIRS`` (default): both tiles are read as int16 pairs of adjacent head dims with 16-bit
  ``ldmatrix`` (``.trans`` for V^T) and split into even / odd dims by `_pairs_to_f16`; the
  dots run as even + odd halves (q is loaded as its even and odd dims, O^T is stored to even
  and odd dims). Without it, K is read with 2-byte and V^T with 1-byte shared loads.
* **Softmax.** Online softmax of FlashAttention-2 (Dao, arXiv:2307.08691) per head column,
  float32, log2 domain (``qk_scale`` = sm_scale * k_scale * log2 e, folded on the host); V's
  scale multiplies the split's normalised output (``V_SCALED``); the query is clamped to
  fp16's range and the dots run in fp16 (as stage 1's ``F16_DOT``).

Gluon is experimental; written against Triton 3.6 and imported only when used.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from attnserve.attention.triton_ops.fp8_pairs_asm import E4M3X2_TO_F16X2

__all__: list[str] = []  # kernel-internal; the public names are `decode_fp8_gluon`'s

D = gl.constexpr(128)  # head size (K and V), bytes per fp8 row
# mma.sync accumulators: 4 warps along M (keys for S^T, head dims for O^T), heads along N
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
# gather of a [BLOCK_N, 128] fp8 tile: 16 consecutive bytes a thread (one cp.async of 16 B),
# 8 threads a row, 16 rows per pass of 4 warps
GATHER = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
# shared ring: 16-byte vectors XOR-swizzled over 8 rows, so the dot-operand reads of 8
# consecutive rows (K) or of the bytes of one column (V^T) hit different banks
RING = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0]))
# the same ring seen as int16 pairs of adjacent columns (same bytes: 16-byte vectors, same XOR)
RING16 = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
LN2 = gl.constexpr(0.6931471805599453)
E4M3X2_ASM = gl.constexpr(E4M3X2_TO_F16X2)


@gluon.jit
def _pairs_to_f16(x):
    """Two fp16 tensors (``lo``, ``hi``) from int16 pairs of e4m3 values, in a 16-bit
    dot-operand layout (``k_width`` 2). ``pack=2`` hands each asm instance the two
    consecutive register elements of a thread, i.e. pairs ``j`` and ``j + 1`` along the MMA's
    K dimension: bytes (a0, a1, b0, b1). One ``prmt`` regroups them into (a0, b0) and (a1, b1)
    and one ``cvt.rn.f16x2.e4m3x2`` each converts them (PTX ISA, sm_89+), so ``lo`` holds
    every pair's byte 0 and ``hi`` its byte 1 at the pair's position (the asm of
    `decode_attention._fp8_pairs_to_f16`, e4m3 branch: `fp8_pairs_asm.E4M3X2_TO_F16X2`)."""
    lo, hi = gl.inline_asm_elementwise(
        E4M3X2_ASM, "=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)
    return lo, hi


@gluon.jit
def _tile_rows(idx_ptr, start, hi, BLOCK_N: gl.constexpr):
    """Cache slots (int64) of keys ``start .. start + BLOCK_N - 1`` of the request and their
    validity (``< hi``); invalid rows read slot 0's address but are never copied."""
    offs = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GATHER))
    valid = offs < hi
    slots = gl.load(idx_ptr + offs, mask=valid, other=0)
    return slots.to(gl.int64), valid


@gluon.jit
def _issue(k_dst, v_dst, k_head_ptr, v_head_ptr, slots, valid, stride_kt, stride_vt, SAME_STRIDE: gl.constexpr):
    """cp.async gathers of one tile's K and V rows into ring slots ``k_dst`` / ``v_dst``
    (rows past the split's end are zero-filled, so no NaN pattern of a stale slot reaches
    the P V product). ``SAME_STRIDE``: K and V share the row stride, so the 64-bit row
    offsets are computed once."""
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, GATHER))
    m = valid[:, None]
    k_off = (slots * stride_kt)[:, None] + cols[None, :]
    if SAME_STRIDE:
        v_off = k_off
    else:
        v_off = (slots * stride_vt)[:, None] + cols[None, :]
    async_copy.async_copy_global_to_shared(k_dst, k_head_ptr + k_off, mask=m)
    async_copy.async_copy_global_to_shared(v_dst, v_head_ptr + v_off, mask=m)


@gluon.jit
def _fp8_decode_stage1_kernel(
    q_ptr, k_ptr, v_ptr,
    kv_indptr_ptr, kv_indices_ptr, num_kv_splits_ptr,
    logits_ptr, lse_ptr, o_ptr,
    qk_scale, v_scale,
    stride_qb, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh,
    stride_ob, stride_oh,
    grid_splits,
    max_kv_splits,
    GROUP: gl.constexpr,
    HP: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr,
    SPLIT_ALIGN: gl.constexpr,
    V_SCALED: gl.constexpr,
    PAIRS: gl.constexpr,
    SAME_STRIDE: gl.constexpr,
):
    b = gl.program_id(0)
    kv_head = gl.program_id(1)
    pid_s = gl.program_id(2)

    # q^T [D, HP] as the B operand of S^T = K q^T, fp16 (clamped to its range), padded heads 0
    dq = gl.arange(0, D, layout=gl.SliceLayout(1, B_OP))
    hq = gl.arange(0, HP, layout=gl.SliceLayout(0, B_OP))
    dh = gl.arange(0, D // 2, layout=gl.SliceLayout(1, B_OP))
    q_ptrs = q_ptr + b.to(gl.int64) * stride_qb + (kv_head * GROUP + hq)[None, :] * stride_qh + dq[:, None]
    if PAIRS:  # even and odd head dims: the K tile is read as int16 pairs (see the loop)
        q_ptrs = q_ptr + b.to(gl.int64) * stride_qb + (kv_head * GROUP + hq)[None, :] * stride_qh + 2 * dh[:, None]
        q_e = gl.load(q_ptrs, mask=(hq < GROUP)[None, :], other=0.0).to(gl.float32)
        q_o = gl.load(q_ptrs + 1, mask=(hq < GROUP)[None, :], other=0.0).to(gl.float32)
        q_e = gl.minimum(gl.maximum(q_e, -65504.0), 65504.0).to(gl.float16)
        q_t = gl.minimum(gl.maximum(q_o, -65504.0), 65504.0).to(gl.float16)  # odd dims
    else:
        q = gl.load(q_ptrs, mask=(hq < GROUP)[None, :], other=0.0).to(gl.float32)
        q_t = gl.minimum(gl.maximum(q, -65504.0), 65504.0).to(gl.float16)

    kv_start = gl.load(kv_indptr_ptr + b)
    kv_len = gl.load(kv_indptr_ptr + b + 1) - kv_start
    # `decode_splits._split_bounds`: the split count clamped to 1..max_kv_splits, the split
    # length rounded up to SPLIT_ALIGN keys
    n_req = gl.minimum(gl.maximum(gl.load(num_kv_splits_ptr + b), 1), max_kv_splits)
    per = (kv_len + n_req - 1) // n_req
    per = gl.maximum((per + SPLIT_ALIGN - 1) // SPLIT_ALIGN * SPLIT_ALIGN, SPLIT_ALIGN)
    n_splits = (kv_len + per - 1) // per

    k_head_ptr = k_ptr + kv_head.to(gl.int64) * stride_kh
    v_head_ptr = v_ptr + kv_head.to(gl.int64) * stride_vh
    idx_ptr = kv_indices_ptr + kv_start
    k_ring = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [NUM_BUF, BLOCK_N, D], RING)
    v_ring = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [NUM_BUF, BLOCK_N, D], RING)

    heads = gl.arange(0, HP, layout=gl.SliceLayout(0, MMA))
    mask_h = heads < GROUP
    dims = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    dims_h = gl.arange(0, D // 2, layout=gl.SliceLayout(1, MMA))
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    q_head = kv_head * GROUP + heads

    for split in range(pid_s, n_splits, grid_splits):
        lo = split * per
        hi = gl.minimum(lo + per, kv_len)
        n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
        gl.thread_barrier()  # the previous split's last reads of the ring are done
        slots, valid = _tile_rows(idx_ptr, lo, hi, BLOCK_N)
        for j in gl.static_range(NUM_BUF - 1):  # prologue: tiles 0 .. NUM_BUF - 2
            if j < n_tiles:
                _issue(k_ring.index(j), v_ring.index(j), k_head_ptr, v_head_ptr, slots, valid, stride_kt, stride_vt,
                       SAME_STRIDE)
            async_copy.commit_group()
            slots, valid = _tile_rows(idx_ptr, lo + (j + 1) * BLOCK_N, hi, BLOCK_N)

        m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        # row sums kept per (key lane, head) and reduced once per split: no cross-warp
        # reduction (shared memory round trip, 2 barriers) per tile for them
        l_part = gl.zeros([BLOCK_N, HP], gl.float32, layout=MMA)
        if PAIRS:  # O^T's even (acc_e) and odd (acc) head dims
            acc_e = gl.zeros([D // 2, HP], gl.float32, layout=MMA)
            acc = gl.zeros([D // 2, HP], gl.float32, layout=MMA)
        else:
            acc_e = gl.zeros([D // 2, HP], gl.float32, layout=MMA)  # unused
            acc = gl.zeros([D, HP], gl.float32, layout=MMA)
        for t in range(n_tiles):
            async_copy.wait_group(NUM_BUF - 2)  # this thread's copies of tile t have landed
            gl.thread_barrier()  # ... everyone's; and tile t - 1's slot is no longer read
            nt = t + NUM_BUF - 1
            if nt < n_tiles:
                ns = nt % NUM_BUF
                _issue(k_ring.index(ns), v_ring.index(ns), k_head_ptr, v_head_ptr, slots, valid, stride_kt, stride_vt,
                       SAME_STRIDE)
            async_copy.commit_group()
            slots, valid = _tile_rows(idx_ptr, lo + (nt + 1) * BLOCK_N, hi, BLOCK_N)

            cur = t % NUM_BUF
            s = gl.zeros([BLOCK_N, HP], gl.float32, layout=MMA)
            if PAIRS:  # [BLOCK_N, D / 2] int16 pairs (16-bit ldmatrix) -> even and odd dims
                k_e, k_o = _pairs_to_f16(k_ring.index(cur)._reinterpret(gl.int16, [BLOCK_N, D // 2], RING16).load(A_OP))
                s = mma_v2(k_o, q_t, mma_v2(k_e, q_e, s))
            else:
                s = mma_v2(k_ring.index(cur).load(A_OP).to(gl.float16), q_t, s)  # [BLOCK_N, D] bytes
            s = s * qk_scale
            s = gl.where((lo + t * BLOCK_N + keys < hi)[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l_part = l_part * alpha[None, :] + p
            p_t = gl.convert_layout(p.to(gl.float16), B_OP)  # [BLOCK_N, HP]
            if PAIRS:  # V^T as [D / 2, BLOCK_N] int16 pairs (16-bit ldmatrix.trans) -> even, odd dims
                v16 = v_ring.index(cur)._reinterpret(gl.int16, [BLOCK_N, D // 2], RING16).permute((1, 0))
                v_e, v_o = _pairs_to_f16(v16.load(A_OP))
                acc_e = mma_v2(v_e, p_t, acc_e * alpha[None, :])
                acc = mma_v2(v_o, p_t, acc * alpha[None, :])
            else:
                v_t = v_ring.index(cur).permute((1, 0)).load(A_OP).to(gl.float16)  # [D, BLOCK_N] bytes
                acc = mma_v2(v_t, p_t, acc * alpha[None, :])
            m_i = m_new

        # every visited split holds >= 1 key, so l_i > 0 in every real head's column
        l_i = gl.sum(l_part, axis=0)
        out = acc / l_i[None, :]
        out_e = acc_e / l_i[None, :]
        if V_SCALED:
            out = out * v_scale
            out_e = out_e * v_scale
        if n_splits == 1:  # the whole request: stage 2 skips it (see decode_attention)
            o_ptrs = o_ptr + b.to(gl.int64) * stride_ob + q_head[None, :] * stride_oh
            if PAIRS:
                gl.store(o_ptrs + 2 * dims_h[:, None], out_e.to(o_ptr.dtype.element_ty), mask=mask_h[None, :])
                gl.store(o_ptrs + 2 * dims_h[:, None] + 1, out.to(o_ptr.dtype.element_ty), mask=mask_h[None, :])
            else:
                gl.store(o_ptrs + dims[:, None], out.to(o_ptr.dtype.element_ty), mask=mask_h[None, :])
        else:
            l_ptrs = logits_ptr + b.to(gl.int64) * stride_lb + q_head[None, :] * stride_lh + split * stride_ls
            if PAIRS:
                gl.store(l_ptrs + 2 * dims_h[:, None], out_e, mask=mask_h[None, :])
                gl.store(l_ptrs + 2 * dims_h[:, None] + 1, out, mask=mask_h[None, :])
            else:
                gl.store(l_ptrs + dims[:, None], out, mask=mask_h[None, :])
            e_ptrs = lse_ptr + b.to(gl.int64) * stride_eb + q_head * stride_eh + split
            gl.store(e_ptrs, (m_i + gl.log2(l_i)) * LN2, mask=mask_h)
