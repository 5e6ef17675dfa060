"""Stage 1 of the paged MLA decode as a Triton kernel (grouped heads, split sequence).

One program owns ``BLOCK_H`` query heads of one request and one split of its sequence,
loads each ``BLOCK_N``-token latent tile once for all its heads (pointer gathers, or TMA
descriptor boxes with ``USE_TMA``), and computes both products with ``tl.dot``; it writes
the split's normalised partial output and log-sum-exp (merged by `mla_common`'s stage 2).
The module note of `mla_decode` has the layout discussion and the measured variants.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.attention.triton_ops.mla_common import _program_item, _split_bounds


@triton.jit
def _load_q(QNope, QPe, b, offs_h, mask_h, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
               D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
               DOT_FP32: tl.constexpr):
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    qn = tl.load(QNope + b * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_c[None, :],
                 mask=mask_h[:, None] & (offs_c < D_C)[None, :], other=0.0)
    qp = tl.load(QPe + b * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_r[None, :],
                 mask=mask_h[:, None] & (offs_r < D_R)[None, :], other=0.0)
    if DOT_FP32:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)
    return qn, qp


@triton.jit
def _load_kv_ptr(KV, table, n0, end, stride_kv_t,
                    D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_FP32: tl.constexpr):
    """One [BLOCK_N, BLOCK_C] c_kv and [BLOCK_N, BLOCK_R] k_pe tile through pointers.

    MASKED=False: every token n0 .. n0 + BLOCK_N - 1 is valid (no row mask at all)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_n = offs_n < end
    if PAGE_SIZE % BLOCK_N == 0:
        # the tile is BLOCK_N consecutive rows of one page (n0 is a multiple of BLOCK_N)
        page = tl.load(table + n0 // PAGE_SIZE).to(tl.int64)
        slot = page * PAGE_SIZE + (n0 % PAGE_SIZE) + tl.arange(0, BLOCK_N)
    else:
        if MASKED:
            page = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        else:
            page = tl.load(table + offs_n // PAGE_SIZE).to(tl.int64)
        slot = page * PAGE_SIZE + (offs_n % PAGE_SIZE)
    row = KV + slot * stride_kv_t
    if MASKED:
        if BLOCK_C == D_C:
            ckv = tl.load(row[:, None] + offs_c[None, :], mask=mask_n[:, None], other=0.0)
        else:
            ckv = tl.load(row[:, None] + offs_c[None, :], mask=mask_n[:, None] & (offs_c < D_C)[None, :], other=0.0)
        if BLOCK_R == D_R:
            kpe = tl.load(row[:, None] + D_C + offs_r[None, :], mask=mask_n[:, None], other=0.0)
        else:
            kpe = tl.load(row[:, None] + D_C + offs_r[None, :], mask=mask_n[:, None] & (offs_r < D_R)[None, :],
                          other=0.0)
    else:
        if BLOCK_C == D_C:
            ckv = tl.load(row[:, None] + offs_c[None, :])
        else:
            ckv = tl.load(row[:, None] + offs_c[None, :], mask=(offs_c < D_C)[None, :], other=0.0)
        if BLOCK_R == D_R:
            kpe = tl.load(row[:, None] + D_C + offs_r[None, :])
        else:
            kpe = tl.load(row[:, None] + D_C + offs_r[None, :], mask=(offs_r < D_R)[None, :], other=0.0)
    if DOT_FP32:
        ckv = ckv.to(tl.float32)
        kpe = kpe.to(tl.float32)
    return ckv, kpe


@triton.jit
def _load_kv_tma(desc_c, desc_r, table, n0, PAGE_SIZE: tl.constexpr, DOT_FP32: tl.constexpr):
    """A full tile through the TMA descriptors (needs PAGE_SIZE % BLOCK_N == 0): rows
    page * PAGE_SIZE + n0 % PAGE_SIZE .. + BLOCK_N of the pool; columns past D_C / D_R of
    the descriptors' shapes are zero-filled by the hardware."""
    page = tl.load(table + n0 // PAGE_SIZE)
    row0 = page * PAGE_SIZE + n0 % PAGE_SIZE
    ckv = desc_c.load([row0, 0])
    kpe = desc_r.load([row0, 0])
    if DOT_FP32:
        ckv = ckv.to(tl.float32)
        kpe = kpe.to(tl.float32)
    return ckv, kpe


@triton.jit
def _online_softmax_step(qn, qp, ckv, kpe, m_i, l_i, acc, offs_n, end, sm_scale_log2,
               MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax step of one KV tile for a head tile."""
    qk = tl.dot(qn, tl.trans(ckv), input_precision=DOT_PRECISION)
    qk = tl.dot(qp, tl.trans(kpe), acc=qk, input_precision=DOT_PRECISION)
    s = qk * sm_scale_log2
    if MASKED:
        s = tl.where((offs_n < end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(ckv.dtype), ckv, acc=acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ints equal to 1 would otherwise become constexprs (Triton specialization)
@triton.jit(do_not_specialize=["num_heads", "num_splits_scalar"])
def _mla_decode_stage1(
    QNope, QPe, KV, DescC, DescR, BlockTable, SeqLens, NumSplits, Work,
    OPart, LsePart, O, Lse,
    sm_scale_log2, num_heads, num_splits_scalar,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_kv_t, stride_bt_b,
    stride_op_b, stride_op_h, stride_op_s, stride_lp_b, stride_lp_h,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr, PER_REQ_SPLITS: tl.constexpr, HAS_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, PEEL: tl.constexpr, USE_TMA: tl.constexpr,
    WORK_ITEMS: tl.constexpr,
):
    """Grid (head tiles, MAX_KV_SPLITS, bs), or (head tiles, W) over a work list
    (WORK_ITEMS, `_program_item`); the head tile is the fastest axis, so the head tiles of
    one (request, split) run together and share each KV tile through L2.

    PEEL=False: every tile of a split is loaded through pointers with a row mask (the
    original kernel). PEEL=True: the split's full ``BLOCK_N`` tiles run mask-free, through
    the host descriptors DescC / DescR when USE_TMA (else pointers; DescC / DescR are
    unused placeholders then), and at most one masked pointer tail tile follows."""
    pid_h = tl.program_id(0)
    b, split_id = _program_item(Work, tl.program_id(1), tl.program_id(2), MAX_KV_SPLITS, WORK_ITEMS)

    kv_len, per_split, n_eff = _split_bounds(SeqLens, NumSplits, b, num_splits_scalar, MAX_KV_SPLITS, BLOCK_N,
                                             PER_REQ_SPLITS)
    start = split_id * per_split
    end = tl.minimum(start + per_split, kv_len)

    if start < end:
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_heads
        offs_c = tl.arange(0, BLOCK_C)
        mask_c = offs_c < D_C
        qn, qp = _load_q(QNope, QPe, b, offs_h, mask_h, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
                            D_C, D_R, BLOCK_C, BLOCK_R, DOT_FP32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        table = BlockTable + b * stride_bt_b
        if PEEL:
            # full tiles, no masks; then at most one partial tail tile
            full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
            for n0 in tl.range(start, full_end, BLOCK_N):
                if USE_TMA:
                    ckv, kpe = _load_kv_tma(DescC, DescR, table, n0, PAGE_SIZE, DOT_FP32)
                else:
                    ckv, kpe = _load_kv_ptr(KV, table, n0, end, stride_kv_t, D_C, D_R, BLOCK_C, BLOCK_R,
                                            BLOCK_N, PAGE_SIZE, False, DOT_FP32)
                m_i, l_i, acc = _online_softmax_step(qn, qp, ckv, kpe, m_i, l_i, acc, n0, end, sm_scale_log2,
                                                     False, DOT_PRECISION)
            if full_end < end:
                ckv, kpe = _load_kv_ptr(KV, table, full_end, end, stride_kv_t, D_C, D_R, BLOCK_C, BLOCK_R,
                                        BLOCK_N, PAGE_SIZE, True, DOT_FP32)
                m_i, l_i, acc = _online_softmax_step(qn, qp, ckv, kpe, m_i, l_i, acc,
                                                     full_end + tl.arange(0, BLOCK_N), end, sm_scale_log2,
                                                     True, DOT_PRECISION)
        else:
            for n0 in range(start, end, BLOCK_N):
                ckv, kpe = _load_kv_ptr(KV, table, n0, end, stride_kv_t, D_C, D_R, BLOCK_C, BLOCK_R,
                                        BLOCK_N, PAGE_SIZE, True, DOT_FP32)
                m_i, l_i, acc = _online_softmax_step(qn, qp, ckv, kpe, m_i, l_i, acc, n0 + tl.arange(0, BLOCK_N),
                                                     end, sm_scale_log2, True, DOT_PRECISION)

        out = acc / l_i[:, None]
        lse2 = m_i + tl.log2(l_i)
        mask_hc = mask_h[:, None] & mask_c[None, :]
        if n_eff == 1:
            tl.store(O + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_c[None, :],
                     out.to(O.dtype.element_ty), mask=mask_hc)
            if HAS_LSE:
                tl.store(Lse + b * stride_lse_b + offs_h * stride_lse_h, lse2 / 1.4426950408889634, mask=mask_h)
        else:
            tl.store(OPart + b * stride_op_b + offs_h[:, None] * stride_op_h + split_id * stride_op_s
                     + offs_c[None, :], out, mask=mask_hc)
            tl.store(LsePart + b * stride_lp_b + offs_h * stride_lp_h + split_id, lse2, mask=mask_h)
