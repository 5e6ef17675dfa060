"""Stage 2 of `decode_attention`: merge each request's split-K partial outputs by their
log-sum-exp (Flash-Decoding; Dao, Haziza, Massa, Sizov, 2023, "Flash-Decoding for
long-context inference", PyTorch blog / FlashAttention repo).

One program per (request, query head) reads the request's split count from
``num_kv_splits`` and its length from ``kv_indptr`` (the same `_split_bounds` as stage 1,
so both agree on the number of non-empty splits). A request with one split was finished by
stage 1, which wrote ``o`` itself, and its programs return at once.

The partials are read ``SPLIT_BLOCK`` splits at a time as one ``[SPLIT_BLOCK, Dv]`` tile
(and their LSEs as one vector): with ``SPLIT_BLOCK >= n_splits`` the merge is one round
trip to L2 instead of one per split, which is what a batch-1 step waits for (the kernel
moves a few KB). ``SPLIT_BLOCK = 1`` is the one-split-at-a-time loop this kernel had before
(same operations in the same order, so the same bits). Either way a request's result
depends only on its own splits, so deterministic mode stays batch-invariant.

Large batches (`DecodeConfig.merge_heads` > 1, the batch tiles of `decode_tuning`): one
program merges a block of ``HEADS`` query heads of a request as ``[HEADS, SPLIT_BLOCK, Dv]``
tiles (`_decode_stage2_heads_kernel`). There nearly every request has one split, so nearly
every program only reads its request's bounds and returns; a grid of ``(bs, Hq)`` such
programs (4,608 at 144 Llama-3-8B requests, two waves of the SM's block slots) cost ~4 us
a layer, a grid of ``(bs, Hq / 16)`` 1.6 us (H100, `benchmarks/profile_step.py`,
benchmarks/NOTES.md 2026-11-27; `decode_tuning.BATCH_MERGE_HEADS`). A request's merged values equal the one-head kernel's up to
float32 summation order (the split axis is reduced in a 3-D tile); deterministic mode never
takes this path (`decode_config` sees batch size 0 there).

Attention sinks (``HAS_SINK``, gpt-oss; `attnserve.attention.sinks`): query head ``h``'s
sink is one more partial with log-sum-exp ``sinks[h]`` and output 0, merged first (the
running max starts at ``sinks[h]``, the denominator at 1). A request with no keys then
still outputs zeros. Without sinks the kernels are the ones before (constexpr).

``USE_PDL`` (programmatic dependent launch, `attnserve.pdl`): the program
reads ``kv_indptr`` / ``num_kv_splits`` before ``gdc_wait``. That is safe because stage 1,
the kernel before it, either was launched without PDL or waits for its own predecessor
before it lets this kernel launch (`decode_attention._decode_stage1_kernel`), so every
kernel before stage 1 (the step's metadata kernels among them) has completed; stage 1
writes none of them. Every program waits, including those that return, so that this
grid's completion implies stage 1's.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attnserve.attention.triton_ops.decode_splits import _split_bounds
from attnserve.pdl_triton import gdc_launch_dependents, gdc_wait

#: largest ``SPLIT_BLOCK`` (splits merged per step); 32 x 128 float32 partials are 64
#: registers a thread at 2 warps
MAX_SPLIT_BLOCK = 32
#: elements of a ``[SPLIT_BLOCK, BLOCK_DV]`` tile above which the merge runs 4 warps
_WIDE_TILE = 4096
#: most elements of that tile (64 float32 registers a thread at 4 warps; Dv 512 merges 16)
_MAX_TILE = 8192


@triton.jit
def _request_splits(kv_indptr_ptr, num_kv_splits_ptr, b, max_kv_splits, SPLIT_ALIGN: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """Request ``b``'s non-empty splits (stage 1's `_split_bounds`), read before the PDL wait
    (see the module doc), which follows when ``USE_PDL``."""
    kv_len = tl.load(kv_indptr_ptr + b + 1) - tl.load(kv_indptr_ptr + b)
    per, n_splits = _split_bounds(kv_len, tl.load(num_kv_splits_ptr + b), max_kv_splits, SPLIT_ALIGN)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    return n_splits


@triton.jit
def _decode_stage2_kernel(
    logits_ptr, lse_ptr, o_ptr,
    kv_indptr_ptr, num_kv_splits_ptr, sinks_ptr,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh,
    stride_ob, stride_oh,
    max_kv_splits,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    HAS_SINK: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = _request_splits(kv_indptr_ptr, num_kv_splits_ptr, b, max_kv_splits, SPLIT_ALIGN, USE_PDL)
    if n_splits == 1:  # stage 1 wrote this request's output
        return
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV
    offs_s = tl.arange(0, SPLIT_BLOCK)
    part_ptr = logits_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + offs_dv[None, :]
    lse_row = lse_ptr + b.to(tl.int64) * stride_eb + h * stride_eh
    m = float("-inf")
    l = 0.0
    if HAS_SINK:  # the sink's partial: lse = sinks[h], output 0 (weight exp(lse - m) = 1)
        m = tl.load(sinks_ptr + h).to(tl.float32)
        l = 1.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, n_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        mask_s = s < n_splits
        lse_s = tl.load(lse_row + s, mask=mask_s, other=float("-inf"))
        part = tl.load(part_ptr + s[:, None] * stride_ls, mask=mask_s[:, None] & mask_dv[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse_s - m_new)  # 0 for the masked splits
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    # A request with no keys (a padded CUDA-graph row) outputs zeros.
    out = tl.where(l > 0, acc / tl.maximum(l, 1e-30), 0.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_dv, out.to(o_ptr.dtype.element_ty), mask=mask_dv)


@triton.jit
def _decode_stage2_heads_kernel(
    logits_ptr, lse_ptr, o_ptr,
    kv_indptr_ptr, num_kv_splits_ptr, sinks_ptr,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh,
    stride_ob, stride_oh,
    max_kv_splits,
    num_heads,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    HAS_SINK: tl.constexpr = False,
):
    # The merge of `_decode_stage2_kernel` for query heads hb * HEADS .. + HEADS - 1 of request
    # b at once (rows past ``num_heads`` are masked and merge zeros that are never stored).
    b = tl.program_id(0)
    hb = tl.program_id(1)
    n_splits = _request_splits(kv_indptr_ptr, num_kv_splits_ptr, b, max_kv_splits, SPLIT_ALIGN, USE_PDL)
    if n_splits == 1:  # stage 1 wrote this request's output
        return
    offs_h = hb * HEADS + tl.arange(0, HEADS)
    mask_h = offs_h < num_heads
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV
    offs_s = tl.arange(0, SPLIT_BLOCK)
    part_ptr = (logits_ptr + b.to(tl.int64) * stride_lb + offs_h[:, None, None] * stride_lh
                + offs_dv[None, None, :])
    lse_row = lse_ptr + b.to(tl.int64) * stride_eb + offs_h[:, None] * stride_eh
    m = tl.full([HEADS], float("-inf"), dtype=tl.float32)
    l = tl.zeros([HEADS], dtype=tl.float32)
    if HAS_SINK:  # the sinks' partials (see `_decode_stage2_kernel`); rows past num_heads: 0, never stored
        m = tl.load(sinks_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        l = tl.full([HEADS], 1.0, dtype=tl.float32)
    acc = tl.zeros([HEADS, BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, n_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        mask_s = s < n_splits
        lse_s = tl.load(lse_row + s[None, :], mask=mask_h[:, None] & mask_s[None, :], other=float("-inf"))
        lse_s = tl.where(mask_h[:, None], lse_s, 0.0)  # rows past num_heads: finite, never stored
        part = tl.load(part_ptr + s[None, :, None] * stride_ls,
                       mask=mask_h[:, None, None] & mask_s[None, :, None] & mask_dv[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, 1))
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse_s - m_new[:, None])  # 0 for the masked splits
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, 1)
        l = l * alpha + tl.sum(w, 1)
        m = m_new
    out = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1e-30)[:, None], 0.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_dv[None, :])


def merge_split_block(merge_block: int, max_kv_splits: int, block_dv: int = 128) -> int:
    """``SPLIT_BLOCK`` of stage 2: ``merge_block`` (a `DecodeConfig` field; 1 = one split a
    step) capped by `MAX_SPLIT_BLOCK`, by the next power of two of ``max_kv_splits`` and by
    ``_MAX_TILE // block_dv``, always a power of two >= 1."""
    cap = min(MAX_SPLIT_BLOCK, triton.next_power_of_2(max(1, max_kv_splits)), max(1, _MAX_TILE // block_dv))
    return max(1, min(cap, triton.next_power_of_2(max(1, merge_block))))


def decode_stage2(attn_logits: torch.Tensor, attn_lse: torch.Tensor, o: torch.Tensor, kv_indptr: torch.Tensor,
                  num_kv_splits: torch.Tensor, max_kv_splits: int, *, split_align: int, merge_block: int,
                  num_warps: int, use_pdl: bool = False, merge_heads: int = 1,
                  sinks: Optional[torch.Tensor] = None) -> None:
    """Launch stage 2 on the grid ``(bs, Hq)`` with ``bs, Hq = o.shape[:2]`` (arguments as
    in `decode_attention.decode_attention_fwd`, already checked there; ``split_align`` is
    stage 1's ``block_n``), or with ``merge_heads > 1`` on ``(bs, cdiv(Hq, heads))`` with
    ``heads`` = ``merge_heads`` rounded up to a power of two and capped at Hq's
    (`_decode_stage2_heads_kernel`). ``use_pdl`` launches with PDL (the caller checks
    `attnserve.pdl.pdl_enabled`). ``sinks``: None, or float ``[Hq]`` attention-sink logits
    (checked by the caller; merged as one more split, see the module doc). Host ints in;
    nothing is synchronised."""
    bs, hq, dv = o.shape
    block_dv = max(16, triton.next_power_of_2(dv))
    extra = {"launch_pdl": True} if use_pdl else {}
    heads = min(triton.next_power_of_2(max(1, merge_heads)), triton.next_power_of_2(hq))
    sinks_arg = attn_lse if sinks is None else sinks  # a dummy pointer without sinks (never read)
    if heads > 1:
        split_block = min(merge_split_block(merge_block, max_kv_splits, block_dv),
                          max(1, _MAX_TILE // (heads * block_dv)))
        _decode_stage2_heads_kernel[(bs, triton.cdiv(hq, heads))](
            attn_logits, attn_lse, o,
            kv_indptr, num_kv_splits, sinks_arg,
            attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
            attn_lse.stride(0), attn_lse.stride(1),
            o.stride(0), o.stride(1),
            int(max_kv_splits), hq,
            DV=dv, BLOCK_DV=block_dv, SPLIT_ALIGN=split_align, SPLIT_BLOCK=split_block, HEADS=heads,
            USE_PDL=bool(use_pdl), HAS_SINK=sinks is not None, num_warps=4, **extra,
        )
        return
    split_block = merge_split_block(merge_block, max_kv_splits, block_dv)
    warps = max(num_warps, 4) if split_block * block_dv > _WIDE_TILE else num_warps
    _decode_stage2_kernel[(bs, hq)](
        attn_logits, attn_lse, o,
        kv_indptr, num_kv_splits, sinks_arg,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1),
        o.stride(0), o.stride(1),
        int(max_kv_splits),
        DV=dv,
        BLOCK_DV=block_dv,
        SPLIT_ALIGN=split_align,
        SPLIT_BLOCK=split_block,
        USE_PDL=bool(use_pdl),
        HAS_SINK=sinks is not None,
        num_warps=warps,
        **extra,
    )
