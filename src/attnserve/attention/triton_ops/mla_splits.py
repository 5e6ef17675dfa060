"""Split counts and work lists of the paged MLA decode (CUTLASS-MLA's heuristic, SMs shared
among the requests by length on the device), and the workspace rows the attention backend's
launches need (`mla_workspace_rows`). See `mla_decode` for how they are used."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attnserve.attention.triton_ops.mla_common import _WORK_SPLIT_SPAN, MLA_FP8_DTYPES, MLA_WORK_SPLIT_SPAN

# tokens per split unit of the split heuristic (CUTLASS MLA's tile of the sequence)
_SPLIT_UNIT = 128
#: an fp8 cache with up to this many query heads counts two programs per SM (`mla_split_sm_count`)
FP8_TWO_PER_SM_MAX_HEADS = 16


def mla_num_kv_splits(max_seq_len: int, bs: int, sm_count: int) -> int:
    """Number of sequence splits per request (host), CUTLASS-MLA style.

    ``max_splits = cdiv(kv_len, 128)``; ``sms_per_batch = max(1, sm_count // bs)``;
    ``split = min(max_splits, sms_per_batch)``; then balance the waves:
    ``k_waves = cdiv(max_splits, split)``, ``split = cdiv(max_splits, k_waves)``.
    ``max_seq_len <= 0`` gives 1. Raises ValueError for ``bs < 1`` or ``sm_count < 1``.
    """
    if bs < 1 or sm_count < 1:
        raise ValueError(f"mla_num_kv_splits needs bs >= 1 and sm_count >= 1, got bs={bs}, sm_count={sm_count}")
    max_splits = max(1, triton.cdiv(max(int(max_seq_len), 0), _SPLIT_UNIT))
    sms_per_batch = max(1, sm_count // bs)
    split = min(max_splits, sms_per_batch)
    k_waves = triton.cdiv(max_splits, split)
    return triton.cdiv(max_splits, k_waves)


def mla_split_sm_count(sm_count: int, num_heads: int, kv_dtype: Optional[torch.dtype] = None) -> int:
    """The ``sm_count`` to feed the split heuristic: SMs per head tile of a request.

    CUTLASS MLA runs all heads of a request in one CTA, so its ``sm_count // bs`` counts
    CTAs per request. Our programs hold ``block_h = min(64, next_pow2(H))`` heads (see
    `mla_decode_config`), so a request takes ``cdiv(H, block_h)`` programs per split;
    dividing by that keeps the heuristic's one-wave intent. Measured on an H200 (Gluon
    kernel, 128 heads, b32): 2 splits instead of 4 gave 0.339 vs 0.355 ms at kv_len 16K and
    0.096 vs 0.109 ms at 4K (benchmarks/NOTES.md).

    ``kv_dtype`` (the cache's; None: 16-bit): an fp8 cache with at most
    ``FP8_TWO_PER_SM_MAX_HEADS`` heads counts two programs per SM, for the transposed fp8
    kernel that serves it on sm_90 (94 KB of shared memory, two resident per SM; one
    program's chain of copies, conversions and MMAs leaves the SM half idle). H100, e4m3,
    16 heads, this count against the 16-bit one (benchmarks/NOTES.md session 12): bs 128 x
    4K 142.7 -> 127.0 us, bs 32 x 16K 145.9 -> 126.5 us. The Triton pairs path (pages that
    are not multiples of 64) shares the count without gaining from it: page 32, bs 128 x 4K
    210.0 -> 216.5 us (other runs, within their noise).
    """
    if sm_count < 1 or num_heads < 1:
        raise ValueError(f"sm_count and num_heads must be >= 1, got {sm_count}, {num_heads}")
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    per_sm = 2 if kv_dtype in MLA_FP8_DTYPES and num_heads <= FP8_TWO_PER_SM_MAX_HEADS else 1
    return max(1, per_sm * sm_count // triton.cdiv(num_heads, block_h))


@triton.jit(do_not_specialize=["bs", "sm_count", "max_kv_splits", "num_work"])
def _mla_splits_kernel(SeqLens, Out, Work, bs, sm_count, max_kv_splits, num_work,
                       SPLIT_UNIT: tl.constexpr, BLOCK: tl.constexpr, WORK_ITEMS: tl.constexpr):
    """One program: split counts of all requests (`mla_num_kv_splits_device`) and, with
    WORK_ITEMS, the work list ``Work[:num_work]`` (request-major, -1 past the last item)."""
    offs0 = tl.arange(0, BLOCK)
    total = tl.full([], 0, tl.int64)
    for c0 in range(0, bs, BLOCK):
        kv = tl.load(SeqLens + c0 + offs0, mask=c0 + offs0 < bs, other=0).to(tl.int64)
        total += tl.sum(tl.maximum(kv, 0), 0)
    total = tl.maximum(total, 1)
    n_items = tl.full([], 0, tl.int32)
    for c0 in range(0, bs, BLOCK):
        offs = c0 + offs0
        mask = offs < bs
        kv_len = tl.maximum(tl.load(SeqLens + offs, mask=mask, other=0).to(tl.int64), 0)
        share = tl.maximum((sm_count * kv_len) // total, 1).to(tl.int32)  # this request's SMs
        max_splits = tl.maximum((kv_len + SPLIT_UNIT - 1) // SPLIT_UNIT, 1).to(tl.int32)
        split = tl.minimum(max_splits, share)
        k_waves = (max_splits + split - 1) // split
        split = (max_splits + k_waves - 1) // k_waves
        split = tl.minimum(split, max_kv_splits)
        tl.store(Out + offs, split, mask=mask)
        if WORK_ITEMS:
            split = tl.where(mask, split, 0)
            first = n_items + tl.cumsum(split, 0) - split
            for s in range(0, tl.max(split, 0)):
                j = first + s
                tl.store(Work + j, offs * _WORK_SPLIT_SPAN + s, mask=(s < split) & (j < num_work))
            n_items += tl.sum(split, 0)
    if WORK_ITEMS:
        for j0 in range(0, num_work, BLOCK):
            j = j0 + offs0
            tl.store(Work + j, tl.full([BLOCK], -1, tl.int32), mask=(j >= n_items) & (j < num_work))


def _check_work_splits(max_kv_splits: int) -> None:
    """A work-list entry holds the split below ``MLA_WORK_SPLIT_SPAN``: raise ValueError past it."""
    if int(max_kv_splits) > MLA_WORK_SPLIT_SPAN:
        raise ValueError(f"a work list needs max_kv_splits <= {MLA_WORK_SPLIT_SPAN}, got {max_kv_splits}")


def mla_num_work_items(bs: int, sm_count: int, max_kv_splits: int) -> int:
    """Length of the work list `mla_num_kv_splits_device` fills for ``bs`` requests: a bound
    on the sum of their split counts, ``min(bs * max_kv_splits, sm_count + bs)`` (each
    request's count is at most ``max(1, sm_count * len / total_len)``). Depends on ``bs``
    only, so a captured graph keeps it."""
    return min(bs * max_kv_splits, sm_count + bs)


def mla_num_kv_splits_device(
    seq_lens: torch.Tensor, sm_count: int, max_kv_splits: int, out: Optional[torch.Tensor] = None,
    work: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-request split counts on the device, without a host sync (CUDA-graph safe).

    The `mla_num_kv_splits` formula per request with the SMs shared by length: request
    ``i`` gets ``sms_i = max(1, sm_count * seq_lens[i] // sum(seq_lens))`` SMs where the
    CUTLASS heuristic has ``sm_count // bs`` (the same number for equal lengths, so uniform
    batches split exactly as `mla_num_kv_splits`; a long request among short ones gets more
    splits instead of the batch's share), then caps at ``max_kv_splits``.

    Args:
        seq_lens: int32/int64 ``[bs]``.
        out: int32 ``[bs]`` to fill (allocated when None). Returned.
        work: optional int32 ``[W]`` work list to fill for a launch over items
            (`mla_decode_fwd` ``work=``): ``b * 256 + split`` for every split of every
            request, request-major, then -1; ``W >= mla_num_work_items(bs, sm_count,
            max_kv_splits)`` holds them all. Needs ``max_kv_splits <= 256``.
    """
    bs = seq_lens.numel()
    if bs < 1 or sm_count < 1 or max_kv_splits < 1:
        raise ValueError(f"need bs, sm_count, max_kv_splits >= 1, got {bs}, {sm_count}, {max_kv_splits}")
    if out is None:
        out = torch.empty(bs, dtype=torch.int32, device=seq_lens.device)
    if out.dtype != torch.int32 or out.numel() < bs or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 tensor of >= {bs} elements, got {out.dtype} {tuple(out.shape)}")
    if work is not None:
        need = mla_num_work_items(bs, sm_count, max_kv_splits)
        if work.dtype != torch.int32 or work.dim() != 1 or work.numel() < need or not work.is_contiguous():
            raise ValueError(f"work must be a contiguous int32 [>= {need}] tensor, got {work.dtype} {tuple(work.shape)}")
        _check_work_splits(max_kv_splits)
    block = min(1024, max(16, triton.next_power_of_2(bs)))
    _mla_splits_kernel[(1,)](
        seq_lens, out, out if work is None else work, bs, sm_count, max_kv_splits,
        0 if work is None else work.numel(), SPLIT_UNIT=_SPLIT_UNIT, BLOCK=block, WORK_ITEMS=work is not None,
    )
    return out


def _grid_splits(bs: int, split_sm: int, max_kv_splits: int) -> int:
    """The split grid `TritonMLADecode` launches a batch of ``bs`` with outside deterministic
    mode and without a work list: ``split_sm // bs`` rounded up to a power of two, capped."""
    per_batch = max(1, split_sm // bs)
    return min(max_kv_splits, 1 << (per_batch - 1).bit_length())


def mla_workspace_rows(max_bs: int, num_sms: int, num_heads: int, max_kv_splits: int, deterministic: bool,
                       kv_dtype: Optional[torch.dtype] = None) -> int:
    """(request, split) rows of float32 partials the attention backend's decode launches
    need for any batch of ``1 .. max_bs`` requests; `mla_workspace_size` ``(0, rows, 1,
    num_heads, kv_lora_rank)`` bytes hold them.

    From the indexing: a call ``mla_decode_fwd(..., max_kv_splits=S)`` on ``bs`` requests
    lays the workspace out as ``o_part`` float32 ``[bs, H, S, kv_lora_rank]`` followed by
    ``lse_part`` float32 ``[bs, H, S]`` (`mla_common.carve_workspace`). Split ``s`` of
    request ``b`` (``s`` below the request's split count, itself clamped to ``S``; on a work
    list the entry ``b * MLA_WORK_SPLIT_SPAN + s``) is written at ``o_part[b, :, s]`` and
    ``lse_part[b, :, s]``, and the call refuses a workspace under ``4 * bs * S * H *
    (kv_lora_rank + 1)`` bytes. So one call needs exactly ``bs * S`` rows of ``H *
    (kv_lora_rank + 1)`` float32, used or not (a buffer of more rows serves it too).

    The split stride ``S`` is the one `TritonMLADecode.forward` (attention/mla_triton.py)
    passes: ``max_kv_splits`` when it launches over a work list, else the split grid
    ``G(bs)``: ``max_kv_splits`` with ``deterministic``, else ``min(max_kv_splits,
    next_pow2(max(1, mla_split_sm_count(num_sms, num_heads, kv_dtype) // bs)))``. It uses a work list
    unless ``deterministic``, ``G(bs) == 1`` or ``max_kv_splits > MLA_WORK_SPLIT_SPAN``.
    ``S`` shrinks as ``bs`` grows, so the answer is ``max(bs * S(bs) for bs in 1 ..
    max_bs)``, not the value at ``max_bs``: ``max_bs * max_kv_splits`` when deterministic;
    otherwise at least ``max_bs`` (``S >= 1``) and usually far below ``max_bs *
    max_kv_splits``.

    Raises ValueError when any count is below 1.
    """
    for name, v in (("max_bs", max_bs), ("num_sms", num_sms), ("num_heads", num_heads),
                    ("max_kv_splits", max_kv_splits)):
        if int(v) < 1:
            raise ValueError(f"mla_workspace_rows: {name} must be >= 1, got {v}")
    max_bs, max_kv_splits = int(max_bs), int(max_kv_splits)
    if deterministic:
        return max_bs * max_kv_splits
    split_sm = mla_split_sm_count(int(num_sms), int(num_heads), kv_dtype)
    rows = max_bs  # S >= 1; past split_sm requests the grid is 1 and there is no work list
    for bs in range(1, min(max_bs, split_sm) + 1):
        grid = _grid_splits(bs, split_sm, max_kv_splits)
        work_list = grid != 1 and max_kv_splits <= MLA_WORK_SPLIT_SPAN
        rows = max(rows, bs * (max_kv_splits if work_list else grid))
    return rows
