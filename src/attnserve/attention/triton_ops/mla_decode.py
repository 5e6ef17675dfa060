"""Triton decode kernel for multi-head latent attention (MLA, DeepSeek-V2/V3), paged.

Math (DeepSeek-V2, arXiv:2405.04434 §2.1, with the up-projections absorbed into the query
and the output as in the FlashMLA README): every cached token ``t`` is one latent row
``kv[t] = [c_kv[t] (kv_lora_rank) | k_pe[t] (qk_rope_head_dim)]`` shared by all query
heads. For request ``i`` and head ``h``::

    score[t] = sm_scale * (q_nope[i, h] . c_kv[t] + q_pe[i, h] . k_pe[t]),  t < seq_lens[i]
    o[i, h]  = sum_t softmax(score)[t] * c_kv[t]             # [kv_lora_rank]
    lse[i, h] = log(sum_t exp(score[t]))                     # natural log, optional

The caller applies W_UV to ``o`` afterwards. Because there is one KV "head" for all query
heads, the kernel is grouped: a program owns a tile of ``BLOCK_H`` query heads of one
request and one split of its sequence, loads each ``BLOCK_N``-token latent tile once for
all heads of the tile, and computes both products with ``tl.dot`` (the c_kv tile is the
key of the first dot and the value of the second). Splits of a request are merged by
log-sum-exp in a second kernel (the split-K "flash decoding" scheme; the split count
heuristic follows the CUTLASS MLA wrapper in SGLang, see `mla_num_kv_splits`).

Paging: ``block_kv_indices[i, j]`` is the page holding tokens ``j*page_size ..`` of request
``i``; page ``p`` is slots ``p*page_size .. p*page_size + page_size - 1`` of ``kv_buffer``.
Entries past ``cdiv(seq_lens[i], page_size)`` (padding, e.g. -1) and slots past
``seq_lens[i]`` are never read.

Variant: non-default fields of `MLADecodeConfig` (TMA descriptor loads, peeled tail) switch
stage 1 to its ``PEEL`` loop: the same math, grid and split / merge scheme, with mask-free
full tiles fetched differently (see the dataclass). Note on the many-heads shape, from the
sm_90 code Triton emits for it: the QK dot's result feeds the PV dot, so Triton lays QK out
with all warps along M ([num_warps, 1]); with ``block_h`` 64 and 8 warps both warpgroups
compute the same 64 x ``block_n`` scores (m64n32k16 wgmmas reading q from shared memory
each time) while PV splits the 512 columns between them. That redundant, shared-memory-bound
QK (by a rough estimate 3/4 of the tensor-core time per tile) is a limit the variant does
not remove (nor did a persistent grid, a head loop, lazy rescaling or the loop pipelining
knobs, measured and dropped: benchmarks/NOTES.md "MLA decode"). The FlashMLA-like split
of the tile across warpgroups, which needs explicit layouts, is `mla_decode_gluon`
(``MLADecodeConfig.gluon``), and the warp-specialized `mla_decode_seesaw` (each warpgroup
a whole block's scores; the many-heads default on sm_90, ``MLADecodeConfig.seesaw``); a transposed Triton formulation
(tokens on the MMA M dimension) was tried and was slower (255 registers with spills).

CUDA graphs: `mla_decode_fwd` syncs nothing with the host and allocates nothing when a
workspace is given; its grids depend only on ``bs``, the head count, ``max_kv_splits`` and
the length of the optional work list; per-request split counts (and the work list) may live
on the device (`mla_num_kv_splits_device`).

All code here is original; algorithms after the sources above (SGLang's Triton
``decode_attention`` grouped kernel and CUTLASS-MLA wrapper, FlashMLA) were read, not copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

__all__ = [
    "MLADecodeConfig",
    "mla_decode_config",
    "mla_num_kv_splits",
    "mla_num_kv_splits_device",
    "mla_num_work_items",
    "MLA_WORK_SPLIT_SPAN",
    "mla_split_sm_count",
    "mla_workspace_size",
    "mla_decode_fwd",
    "mla_tma_applicable",
    "mla_gluon_applicable",
]

_LOG2E = 1.4426950408889634
# tokens per split unit of the split heuristic (CUTLASS MLA's tile of the sequence)
_SPLIT_UNIT = 128
# a work-list entry is b * MLA_WORK_SPLIT_SPAN + split (so max_kv_splits <= 256 with a work list)
MLA_WORK_SPLIT_SPAN = 256
_WORK_SPLIT_SPAN: tl.constexpr = tl.constexpr(MLA_WORK_SPLIT_SPAN)
# H100/H200 opt-in shared memory per block, used when the device is not asked
_DEFAULT_MAX_SMEM = 232448
# partial elements the merge loads per step: [split rows, columns] with 4 warps = 32 fp32
# registers a thread (8 x 512 at <= 8 splits, 16 x 256, 32 x 128 at 32 splits)
_MERGE_TILE = 4096


# ---------------------------------------------------------------------------------------
# split heuristic
# ---------------------------------------------------------------------------------------
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


def mla_split_sm_count(sm_count: int, num_heads: int) -> int:
    """The ``sm_count`` to feed the split heuristic: SMs per head tile of a request.

    CUTLASS MLA runs all heads of a request in one CTA, so its ``sm_count // bs`` counts
    CTAs per request. Our programs hold ``block_h = min(64, next_pow2(H))`` heads (see
    `mla_decode_config`), so a request takes ``cdiv(H, block_h)`` programs per split;
    dividing by that keeps the heuristic's one-wave intent. Measured on an H200 (Gluon
    kernel, 128 heads, b32): 2 splits instead of 4 gave 0.339 vs 0.355 ms at kv_len 16K and
    0.096 vs 0.109 ms at 4K (benchmarks/NOTES.md).
    """
    if sm_count < 1 or num_heads < 1:
        raise ValueError(f"sm_count and num_heads must be >= 1, got {sm_count}, {num_heads}")
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    return max(1, sm_count // triton.cdiv(num_heads, block_h))


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


# ---------------------------------------------------------------------------------------
# workspace
# ---------------------------------------------------------------------------------------
def mla_workspace_size(max_seq_len: int, bs: int, num_kv_splits: int, num_heads: int, kv_lora_rank: int) -> int:
    """Workspace for `mla_decode_fwd`, in **bytes**.

    Holds float32 split partials: ``o_part [bs, num_heads, num_kv_splits, kv_lora_rank]``
    then ``lse_part [bs, num_heads, num_kv_splits]``, i.e. ``4 * bs * num_heads *
    num_kv_splits * (kv_lora_rank + 1)`` bytes; ``num_kv_splits`` is the ``max_kv_splits``
    the kernel will be launched with. ``max_seq_len`` is accepted for parity with the
    CUTLASS MLA API (whose workspace depends on it) and is only validated: the split count
    already bounds the partials. A buffer sized for a larger ``bs`` serves smaller ones.
    """
    for name, v in (("bs", bs), ("num_kv_splits", num_kv_splits), ("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank)):
        if int(v) < 1:
            raise ValueError(f"mla_workspace_size: {name} must be >= 1, got {v}")
    if int(max_seq_len) < 0:
        raise ValueError(f"mla_workspace_size: max_seq_len must be >= 0, got {max_seq_len}")
    return 4 * bs * num_heads * num_kv_splits * (kv_lora_rank + 1)


# ---------------------------------------------------------------------------------------
# tuning
# ---------------------------------------------------------------------------------------
_KV_LOADS = ("ptr", "tma")


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters of the stage-1 kernel (stage 2 is a small merge).

    block_h: query heads per program (power of two >= 16; tl.dot M dimension).
    block_n: tokens per KV tile (power of two >= 16); split boundaries are multiples of it.
    num_warps / num_stages: Triton launch options of stage 1.
    merge_num_warps: num_warps of the merge kernel.

    Variant fields (``kv_load="tma"`` is `mla_decode_config`'s many-heads pick; the field
    defaults give the original masked loop, bit for bit): a non-default field makes stage 1
    peel the tail: every split runs its full ``block_n`` tiles without any mask and at most
    one masked tail tile (pointer loads) after the loop.

    kv_load: how full KV tiles are fetched.
        ``"ptr"``: pointer gathers (as the original kernel).
        ``"tma"``: host-side ``triton.tools.tensor_descriptor.TensorDescriptor`` over the
        pool viewed as ``[num_slots, D]`` (one descriptor for c_kv ``[block_n, 512]`` boxes
        and one for k_pe ``[block_n, 64]`` boxes at row ``page * page_size + offset``). Passed
        by value as kernel parameters: no allocation, CUDA-graph capturable. Applies only
        when ``page_size % block_n == 0`` (a tile is ``block_n`` contiguous pool rows), the
        row stride and ``kv_lora_rank`` are 16-byte multiples, and the pool has < 2**31
        rows (`mla_tma_applicable`); otherwise the same kernel's pointer path runs.
    peel_tail: the peeled (mask-free) main loop with pointer loads only.
    gluon: run stage 1 as the Gluon kernel of `mla_decode_gluon` (the tile split over the
        two warpgroups by tokens for QK and by columns for PV; TMA loads, ``num_stages``
        deep) where
        `mla_gluon_applicable` holds; elsewhere the Triton kernel with the fields above runs.
        Needs ``block_h`` 64, ``num_warps`` 8 and ``num_stages`` >= 2.
    seesaw: run stage 1 as the warp-specialized Gluon kernel of `mla_decode_seesaw` (each
        warpgroup computes the scores of a whole 64-token block of a pair; chunked TMA loads
        by a loader warp) where `mla_gluon_applicable` holds. It launches its own warps
        (4 + 4 + 1); ``num_warps`` / ``num_stages`` apply to the Triton kernel that runs
        elsewhere. Same field requirements as ``gluon``; exclusive with it.
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    merge_num_warps: int = 4
    kv_load: str = "ptr"
    peel_tail: bool = False
    gluon: bool = False
    seesaw: bool = False

    def __post_init__(self):
        if self.kv_load not in _KV_LOADS:
            raise ValueError(f"kv_load must be one of {_KV_LOADS}, got {self.kv_load!r}")
        if self.gluon and self.seesaw:
            raise ValueError("gluon and seesaw select different stage-1 kernels; set one")
        if (self.gluon or self.seesaw) and (self.block_h != 64 or self.num_warps != 8 or self.num_stages < 2):
            raise ValueError("gluon=True / seesaw=True need block_h=64, num_warps=8 and num_stages >= 2 (the scores of the next "
                             f"tile are computed while this one is resident), got {self.block_h}, {self.num_warps}, "
                             f"{self.num_stages}")

    @property
    def is_variant(self) -> bool:
        """True when a non-default variant field selects stage 1's peeled loop (``PEEL``)."""
        return self.kv_load != "ptr" or self.peel_tail

    def smem_estimate(self, kv_lora_rank: int, rope_dim: int, elt_bytes: int = 2) -> int:
        """Rough shared-memory bytes: KV tile per stage + the query tile + a P tile."""
        d = triton.next_power_of_2(kv_lora_rank) + max(16, triton.next_power_of_2(rope_dim))
        return (self.num_stages * self.block_n * d + self.block_h * d) * elt_bytes + self.block_h * self.block_n * 4


def mla_decode_config(
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype: torch.dtype,
    interpret: bool = False,
    max_shared_mem: Optional[int] = None,
) -> MLADecodeConfig:
    """The one place that picks stage-1 tiles; tune it from a GPU run (bench/kernels_mla.py).

    Many heads (>= 64, DeepSeek's 128): compute-heavy per byte, so 64-head tiles on two
    warpgroups (acc 64 x 512 fp32 = 128 registers/thread), 64-token tiles, 2 stages, when
    that fits ``max_shared_mem``, else smaller tiles. Few heads: one tile holds all heads
    (memory-bound; KV read once). Under the interpreter: large tiles (numpy is faster per
    element on big blocks) but still >= 16 for tl.dot.
    """
    bh = min(64, max(16, triton.next_power_of_2(num_heads)))
    if interpret:
        return MLADecodeConfig(block_h=bh, block_n=32, num_warps=4, num_stages=1)
    elt = 4 if dtype == torch.float32 else 2
    limit = _DEFAULT_MAX_SMEM if max_shared_mem is None else max_shared_mem
    if elt == 2 and limit >= _DEFAULT_MAX_SMEM and kv_lora_rank + qk_rope_head_dim <= 576:
        # Tuned on an H100 (bench/kernels_mla.py sweep, 2026-11-21): 128 heads, b32/16K:
        # (64, 64, 8, 2) 0.64 ms vs 0.82 ms for (64, 32, 8, 2), 221 KB shared memory as compiled;
        # 16 heads, b128/4K: (16, 128, 8, 2) 2.65 TB/s vs 1.96 TB/s for (16, 64, 4, 2).
        # Variant sweep (bench/mla_sweep.py, H100, 2026-11-21): TMA descriptor loads of the
        # latent tiles with a mask-free main loop, 128 heads b32: 0.546 ms at 16K (1.11 TB/s)
        # and 0.161 ms at 4K vs 0.640 / 0.195 ms for the pointer kernel; page sizes that are
        # not a multiple of 64 take the same kernel's pointer path (0.565 ms at 16K).
        # Gluon stage 1 (mla_decode_gluon, 2026-11-21, H200): 0.339 ms at 16K / 0.096 ms at
        # 4K (2 splits) vs 0.507 / 0.141 ms for the Triton TMA kernel in the same run; where it
        # does not apply (not sm_90, other dims or pages) the Triton TMA kernel runs.
        # Warp-specialized seesaw stage 1 (mla_decode_seesaw, 2026-11-21, H100): 0.268 ms at
        # 16K / 0.090 ms at 4K vs 0.327 / 0.102 ms for the Gluon kernel above in the same run.
        if bh >= 64:
            return MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma", seesaw=True)
        return MLADecodeConfig(block_h=bh, block_n=128, num_warps=8, num_stages=2)
    if bh >= 64:
        candidates = [(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 1), (32, 32, 4, 1), (16, 16, 4, 1)]
    else:
        candidates = [(bh, 64, 4, 2), (bh, 32, 4, 2), (bh, 32, 4, 1), (16, 16, 4, 1)]
    for h, n, w, s in candidates:
        cfg = MLADecodeConfig(block_h=h, block_n=n, num_warps=w, num_stages=s)
        if cfg.smem_estimate(kv_lora_rank, qk_rope_head_dim, elt) <= limit:
            return cfg
    return MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------
@triton.jit
def _split_bounds(SeqLens, NumSplits, b, num_splits_scalar, MAX_KV_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                  PER_REQ_SPLITS: tl.constexpr):
    """Request ``b``'s length, tokens per split (a multiple of BLOCK_N, >= BLOCK_N) and
    number of non-empty splits; the split count is ``NumSplits[b]`` when PER_REQ_SPLITS,
    else ``num_splits_scalar``. Shared by stage 1 (Triton and Gluon kernels) and the merge."""
    kv_len = tl.load(SeqLens + b).to(tl.int32)
    if PER_REQ_SPLITS:
        n_req = tl.load(NumSplits + b).to(tl.int32)
    else:
        n_req = num_splits_scalar
    n = tl.minimum(tl.maximum(n_req, 1), MAX_KV_SPLITS)
    n_blocks = (kv_len + BLOCK_N - 1) // BLOCK_N
    per_split = tl.maximum((n_blocks + n - 1) // n, 1) * BLOCK_N
    n_eff = (kv_len + per_split - 1) // per_split
    return kv_len, per_split, n_eff


@triton.jit
def _program_item(Work, pid1, pid2, MAX_KV_SPLITS: tl.constexpr, WORK_ITEMS: tl.constexpr):
    """``(b, split_id)`` of a stage-1 program: from the grid ``(.., split, b)``, or with
    WORK_ITEMS from the work list entry ``Work[pid1]`` = ``b * 256 + split`` (-1: no work;
    then ``split_id = MAX_KV_SPLITS``, which starts past every request's end)."""
    if WORK_ITEMS:
        item = tl.load(Work + pid1)
        b = (tl.maximum(item, 0) // _WORK_SPLIT_SPAN).to(tl.int64)
        split_id = tl.where(item >= 0, item % _WORK_SPLIT_SPAN, MAX_KV_SPLITS)
    else:
        b = pid2.to(tl.int64)
        split_id = pid1
    return b, split_id


# ---------------------------------------------------------------------------------------
# stage 1 pieces
# ---------------------------------------------------------------------------------------
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


@triton.jit(do_not_specialize=["num_splits_scalar"])
def _mla_decode_stage2(
    OPart, LsePart, O, Lse, SeqLens, NumSplits, num_splits_scalar,
    stride_op_b, stride_op_h, stride_op_s, stride_lp_b, stride_lp_h,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr, PER_REQ_SPLITS: tl.constexpr, HAS_LSE: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """Log-sum-exp merge of one head's split partials, ``BLOCK_DV`` output columns a program.
    Grid (H, cdiv(D_V, BLOCK_DV), bs); `_merge_tiles` picks ``BLOCK_DV`` and ``SPLIT_CHUNK``
    (partial rows loaded per step) so that many splits are read in one step by more programs."""
    h = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    kv_len, per_split, n_eff = _split_bounds(SeqLens, NumSplits, b, num_splits_scalar, MAX_KV_SPLITS, BLOCK_N,
                                             PER_REQ_SPLITS)

    if n_eff != 1:  # n_eff == 1 was written by stage 1
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < n_eff
        lp = LsePart + b * stride_lp_b + h * stride_lp_h
        lse_s = tl.load(lp + offs_s, mask=mask_s, other=float("-inf"))
        m = tl.max(lse_s, 0)
        m = tl.where(n_eff > 0, m, 0.0)
        w = tl.where(mask_s, tl.exp2(lse_s - m), 0.0)
        denom = tl.sum(w, 0)

        offs_d = pid_d * BLOCK_DV + tl.arange(0, BLOCK_DV)
        mask_d = offs_d < D_V
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        op = OPart + b * stride_op_b + h * stride_op_h + offs_d
        # SPLIT_CHUNK partial rows per step, so that their loads are in flight together
        offs_c = tl.arange(0, SPLIT_CHUNK)
        for s0 in range(0, n_eff, SPLIT_CHUNK):
            ms = (s0 + offs_c) < n_eff
            w_c = tl.where(ms, tl.exp2(tl.load(lp + s0 + offs_c, mask=ms, other=float("-inf")) - m), 0.0)
            part = tl.load(op[None, :] + (s0 + offs_c)[:, None] * stride_op_s, mask=ms[:, None] & mask_d[None, :],
                           other=0.0)
            acc += tl.sum(w_c[:, None] * part, axis=0)
        out = acc / tl.where(denom > 0, denom, 1.0)
        tl.store(O + b * stride_o_b + h * stride_o_h + offs_d, out.to(O.dtype.element_ty), mask=mask_d)
        if HAS_LSE:
            if pid_d == 0:
                lse = tl.where(denom > 0, (m + tl.log2(tl.where(denom > 0, denom, 1.0))) / 1.4426950408889634,
                               float("-inf"))
                tl.store(Lse + b * stride_lse_b + h * stride_lse_h, lse)


# ---------------------------------------------------------------------------------------
# host entry
# ---------------------------------------------------------------------------------------
def _merge_tiles(block_c: int, splits: int) -> tuple:
    """``(BLOCK_DV, SPLIT_CHUNK)`` of the merge for requests of ``splits`` splits: all of
    them (up to 32) in one load step of ``_MERGE_TILE`` elements, so up to 8 splits keep whole
    512-column rows and 32 splits take 128-column programs (4x the programs, each with one
    step instead of four); a request with more splits takes several steps."""
    chunk = min(32, max(2, triton.next_power_of_2(splits)))
    block_dv = min(block_c, max(16, _MERGE_TILE // chunk))
    return block_dv, chunk


def _interpreting() -> bool:
    return type(_mla_decode_stage1).__name__ == "InterpretedFunction"


def _check_last_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def mla_tma_applicable(kv_rows: torch.Tensor, kv_lora_rank: int, page_size: int, block_n: int) -> bool:
    """Whether the TMA variant can load full tiles of ``kv_rows`` ([num_slots, D] view):
    a tile must be ``block_n`` whole rows of one page and every box start 16-byte aligned."""
    elt = kv_rows.element_size()
    return (
        page_size % block_n == 0
        and kv_rows.dim() == 2
        and kv_rows.stride(1) == 1
        and (kv_rows.stride(0) * elt) % 16 == 0
        and (kv_lora_rank * elt) % 16 == 0
        and kv_rows.data_ptr() % 16 == 0
        and kv_rows.shape[0] < 2**31
    )


def mla_gluon_applicable(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor, page_size: int,
                         block_n: int) -> bool:
    """Whether the Gluon stage 1 kernels (`mla_decode_gluon`, `mla_decode_seesaw`) can run: a CUDA device of compute
    capability 9.x (wgmma, TMA), fp16/bf16, DeepSeek's kv_lora_rank 512 + rope 64, 64-token
    tiles (a P row of 64 bf16 is one 128-byte swizzle row; 32 did not compile) that the TMA
    can fetch (`mla_tma_applicable`), and a Triton with Gluon's Hopper module."""
    if q_nope.device.type != "cuda" or q_nope.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q_nope.shape[2] != 512 or q_pe.shape[2] != 64 or block_n != 64:
        return False
    if torch.cuda.get_device_capability(q_nope.device)[0] != 9:
        return False
    if not mla_tma_applicable(kv_rows, q_nope.shape[2], page_size, block_n):
        return False
    try:  # a Triton without Gluon's Hopper module (or with a different API) falls back
        from . import mla_decode_gluon, mla_decode_seesaw  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def _stage1_kernel(cfg, q_nope, q_pe, kv_rows, page_size, interpret) -> str:
    """Which stage 1 runs: ``"seesaw"`` / ``"gluon"`` (where `mla_gluon_applicable`),
    ``"tma"`` (where `mla_tma_applicable`) or ``"triton"``."""
    if (cfg.gluon or cfg.seesaw) and not interpret and mla_gluon_applicable(q_nope, q_pe, kv_rows, page_size,
                                                                            cfg.block_n):
        return "seesaw" if cfg.seesaw else "gluon"
    if cfg.kv_load == "tma" and mla_tma_applicable(kv_rows, q_nope.shape[2], page_size, cfg.block_n):
        return "tma"
    return "triton"


def _launch_stage1(cfg, kind, q_nope, q_pe, kv_rows, block_kv_indices, seq_lens, splits_ptr, work, o_part, lse_part, o,
                      lse_arg, sm_scale_log2, num_heads, splits_scalar, lse_strides, page_size, max_kv_splits,
                      per_req, has_lse, fp32_dot, interpret, block_c, block_r):
    """Launch the stage 1 named by ``kind`` (`_stage1_kernel`); returns what the launch
    returns (the compiled kernel)."""
    d_c, d_r = q_nope.shape[2], q_pe.shape[2]
    desc_c = desc_r = kv_rows  # unused placeholders unless a descriptor path runs
    if kind == "seesaw":
        from .mla_decode_seesaw import seesaw_descriptor

        desc_c = seesaw_descriptor(kv_rows)
    elif kind == "gluon":
        from .mla_decode_gluon import gluon_descriptors

        desc_c, desc_r = gluon_descriptors(kv_rows, d_c, d_r, cfg.block_n)
    elif kind == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        n = kv_rows.shape[0]
        desc_c = TensorDescriptor(kv_rows, [n, d_c], [kv_rows.stride(0), 1], [cfg.block_n, block_c])
        desc_r = TensorDescriptor(kv_rows[:, d_c:], [n, d_r], [kv_rows.stride(0), 1], [cfg.block_n, block_r])
    tiles = triton.cdiv(num_heads, cfg.block_h)
    grid = (tiles, max_kv_splits, q_nope.shape[0]) if work is None else (tiles, work.numel(), 1)
    # the positional arguments the stage-1 kernels take
    args = (
        q_nope, q_pe, kv_rows, desc_c, desc_r, block_kv_indices, seq_lens, splits_ptr,
        seq_lens if work is None else work,
        o_part, lse_part, o, lse_arg,
        sm_scale_log2, num_heads, splits_scalar,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_rows.stride(0), block_kv_indices.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        o.stride(0), o.stride(1), *lse_strides,
    )
    common = dict(D_C=d_c, D_R=d_r, BLOCK_N=cfg.block_n, PAGE_SIZE=page_size, MAX_KV_SPLITS=max_kv_splits,
                  PER_REQ_SPLITS=per_req, HAS_LSE=has_lse, WORK_ITEMS=work is not None, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    if kind == "seesaw":
        from .mla_decode_seesaw import SEESAW_MAXNREG, _mla_decode_stage1_seesaw

        common.update(num_warps=4, num_stages=1)  # the default partition; the kernel adds 4 + 1 worker warps
        return _mla_decode_stage1_seesaw[grid](*args, maxnreg=SEESAW_MAXNREG, **common)
    if kind == "gluon":
        from .mla_decode_gluon import _mla_decode_stage1_gluon

        return _mla_decode_stage1_gluon[grid](*args, NUM_STAGES=cfg.num_stages, **common)
    return _mla_decode_stage1[grid](
        *args, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_H=cfg.block_h,
        DOT_FP32=interpret, DOT_PRECISION="ieee" if fp32_dot else "tf32", PEEL=cfg.is_variant, USE_TMA=kind == "tma",
        **common,
    )


def mla_decode_fwd(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_buffer: torch.Tensor,
    block_kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    o: torch.Tensor,
    sm_scale: float,
    num_kv_splits: Union[int, torch.Tensor],
    max_kv_splits: int,
    workspace: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    *,
    config: Optional[MLADecodeConfig] = None,
    work: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Paged MLA decode with absorbed weights; writes ``o`` (and ``lse``) and returns ``o``.

    Args:
        q_nope: ``[bs, H, kv_lora_rank]`` fp16/bf16 (fp32 accepted), query already times W_UK.
        q_pe: ``[bs, H, rope]`` same dtype, rotary part of the query.
        kv_buffer: latent cache ``[num_slots, 1, kv_lora_rank + rope]`` (also accepted:
            ``[num_slots, D]`` or ``[num_pages, page_size, 1, D]`` views), same dtype as q.
        block_kv_indices: int32 ``[bs, max_blocks]`` page ids, padded (e.g. with -1); must
            have at least ``cdiv(seq_lens[i], page_size)`` valid entries in row i.
        seq_lens: ``[bs]`` int32/int64 tokens per request (0 allowed: o = 0, lse = -inf).
        page_size: tokens per page (>= 1; 1 = token-level table).
        o: output ``[bs, H, kv_lora_rank]`` (any float dtype; last dim contiguous).
        sm_scale: softmax scale applied to the full 576-wide dot.
        num_kv_splits: python int, or int32 ``[bs]`` device tensor (`mla_num_kv_splits_device`);
            clamped to ``[1, max_kv_splits]`` per request.
        max_kv_splits: grid size along the sequence (>= 1); fixed for CUDA graphs.
        workspace: >= `mla_workspace_size` (..., bs, max_kv_splits, H, kv_lora_rank) bytes,
            contiguous, any dtype; allocated here when None (not capturable then).
        lse: optional float32 ``[bs, H]``: natural-log sum-exp of the scaled scores.
        config: stage-1 tiles; `mla_decode_config` when None.
        work: optional int32 ``[W]`` work list from `mla_num_kv_splits_device` (with
            ``num_kv_splits`` the tensor it filled): stage 1 then runs one program per
            list entry and head tile (grid ``(head tiles, W)``) instead of ``(head tiles,
            max_kv_splits, bs)``, so a long request can take many splits without a grid of
            empty programs for the others. ``max_kv_splits`` stays the workspace's split
            dimension and the merge's cap.

    With ``max_kv_splits == 1`` the seesaw stage 1 writes every request itself (zeros for
    empty ones) and the merge kernel is not launched.

    Raises ValueError on shape/dtype/device mismatches or a too-small workspace. No host
    sync: lengths and split counts are read on the device only.
    """
    return _mla_decode_fwd(q_nope, q_pe, kv_buffer, block_kv_indices, seq_lens, page_size, o, sm_scale,
                           num_kv_splits, max_kv_splits, workspace, lse, config=config, work=work)[0]


def _mla_decode_fwd(q_nope, q_pe, kv_buffer, block_kv_indices, seq_lens, page_size, o, sm_scale, num_kv_splits,
                    max_kv_splits, workspace=None, lse=None, *, config=None, work=None):
    """`mla_decode_fwd`, returning ``(o, stage1)``: ``stage1`` is what the stage-1 launch
    returned (the compiled kernel, for n_regs / n_spills / metadata.shared in benchmarks;
    None when ``bs == 0``)."""
    _check_last_dim("q_nope", q_nope, 3)
    _check_last_dim("q_pe", q_pe, 3)
    _check_last_dim("o", o, 3)
    bs, num_heads, d_c = q_nope.shape
    d_r = q_pe.shape[2]
    if q_pe.shape[:2] != (bs, num_heads):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} does not match q_nope {tuple(q_nope.shape)}")
    if tuple(o.shape) != (bs, num_heads, d_c):
        raise ValueError(f"o must be {(bs, num_heads, d_c)}, got {tuple(o.shape)}")
    if q_pe.dtype != q_nope.dtype or kv_buffer.dtype != q_nope.dtype:
        raise ValueError(f"dtype mismatch: q_nope {q_nope.dtype}, q_pe {q_pe.dtype}, kv_buffer {kv_buffer.dtype}")
    if q_nope.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q_nope.dtype}")
    if kv_buffer.shape[-1] != d_c + d_r or kv_buffer.dim() not in (2, 3, 4) or kv_buffer.stride(-1) != 1:
        raise ValueError(
            f"kv_buffer must be [num_slots, 1, {d_c + d_r}] (kv_lora_rank + rope) with a contiguous last dim, "
            f"got shape {tuple(kv_buffer.shape)} strides {kv_buffer.stride()}"
        )
    try:
        kv_rows = kv_buffer.view(-1, d_c + d_r)
    except RuntimeError as e:
        raise ValueError(f"kv_buffer {tuple(kv_buffer.shape)} cannot be viewed as token rows: {e}") from None
    if block_kv_indices.dim() != 2 or block_kv_indices.shape[0] < bs or block_kv_indices.dtype != torch.int32:
        raise ValueError(f"block_kv_indices must be int32 [bs, max_blocks], got {block_kv_indices.dtype} {tuple(block_kv_indices.shape)}")
    if block_kv_indices.stride(1) != 1:
        raise ValueError("block_kv_indices must have a contiguous last dimension")
    if seq_lens.dim() != 1 or seq_lens.numel() < bs or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64 [bs], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if int(page_size) < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if int(max_kv_splits) < 1:
        raise ValueError(f"max_kv_splits must be >= 1, got {max_kv_splits}")
    devs = {t.device for t in (q_nope, q_pe, kv_buffer, block_kv_indices, seq_lens, o)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    interpret = _interpreting()
    if not interpret and q_nope.device.type != "cuda":
        raise ValueError("mla_decode_fwd needs CUDA tensors (or TRITON_INTERPRET=1 set before importing triton)")

    if isinstance(num_kv_splits, torch.Tensor):
        if num_kv_splits.dtype != torch.int32 or num_kv_splits.numel() < bs or num_kv_splits.device != q_nope.device:
            raise ValueError(f"num_kv_splits tensor must be int32 [bs] on {q_nope.device}")
        per_req, splits_ptr, splits_scalar = True, num_kv_splits, 1
    else:
        if not 1 <= int(num_kv_splits) <= int(max_kv_splits):
            raise ValueError(f"num_kv_splits must be in [1, max_kv_splits={max_kv_splits}], got {num_kv_splits}")
        per_req, splits_ptr, splits_scalar = False, seq_lens, int(num_kv_splits)
    if work is not None:
        if not per_req:
            raise ValueError("a work list needs num_kv_splits as the int32 [bs] tensor mla_num_kv_splits_device filled")
        if work.dtype != torch.int32 or work.dim() != 1 or work.numel() < 1 or work.device != q_nope.device:
            raise ValueError(f"work must be a 1-D int32 tensor on {q_nope.device}, got {work.dtype} {tuple(work.shape)}")
        _check_work_splits(max_kv_splits)
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (bs, num_heads) or lse.device != o.device):
        raise ValueError(f"lse must be float32 [{bs}, {num_heads}] on {o.device}")

    max_kv_splits = int(max_kv_splits)
    need = mla_workspace_size(0, bs, max_kv_splits, num_heads, d_c)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=o.device)
    if not workspace.is_contiguous() or workspace.device != o.device:
        raise ValueError("workspace must be a contiguous tensor on the output's device")
    ws = workspace.view(-1).view(torch.uint8)
    if ws.numel() < need:
        raise ValueError(f"workspace has {ws.numel()} bytes, needs {need} (mla_workspace_size)")
    n_o = bs * num_heads * max_kv_splits * d_c
    o_part = ws[: 4 * n_o].view(torch.float32).view(bs, num_heads, max_kv_splits, d_c)
    lse_part = ws[4 * n_o : need].view(torch.float32).view(bs, num_heads, max_kv_splits)
    if bs == 0:
        return o, None

    if config is None:
        smem = None
        if not interpret:  # torch caches the properties; older torch lacks the field
            smem = getattr(torch.cuda.get_device_properties(o.device), "shared_memory_per_block_optin", None)
        config = mla_decode_config(num_heads, d_c, d_r, q_nope.dtype, interpret=interpret, max_shared_mem=smem)
    cfg = config
    fp32_dot = interpret or q_nope.dtype == torch.float32
    has_lse = lse is not None
    lse_arg = lse if has_lse else o_part
    lse_strides = (lse.stride(0), lse.stride(1)) if has_lse else (0, 0)
    block_c = triton.next_power_of_2(d_c)
    block_r = max(16, triton.next_power_of_2(d_r))

    kind = _stage1_kernel(cfg, q_nope, q_pe, kv_rows, int(page_size), interpret)
    stage1 = _launch_stage1(
        cfg, kind, q_nope, q_pe, kv_rows, block_kv_indices, seq_lens, splits_ptr, work, o_part, lse_part, o, lse_arg,
        float(sm_scale) * _LOG2E, num_heads, splits_scalar, lse_strides, int(page_size), max_kv_splits,
        per_req, has_lse, fp32_dot, interpret, block_c, block_r,
    )
    if kind == "seesaw" and max_kv_splits == 1:  # stage 1 wrote o (and lse) of every request, empty ones included
        return o, stage1
    # merge tiles for the split count most requests have: max_kv_splits on a grid, the
    # uniform batch's count (split_sm_count // bs = (W - bs) // bs) with a work list; a
    # request with more splits loops over chunks
    typical = max_kv_splits if work is None else max(1, min(max_kv_splits, (work.numel() - bs) // bs))
    block_dv, chunk = _merge_tiles(block_c, typical)
    _mla_decode_stage2[(num_heads, triton.cdiv(d_c, block_dv), bs)](
        o_part, lse_part, o, lse_arg, seq_lens, splits_ptr, splits_scalar,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        o.stride(0), o.stride(1), *lse_strides,
        D_V=d_c, BLOCK_DV=block_dv, BLOCK_S=max(2, triton.next_power_of_2(max_kv_splits)), BLOCK_N=cfg.block_n,
        MAX_KV_SPLITS=max_kv_splits, PER_REQ_SPLITS=per_req, HAS_LSE=has_lse, SPLIT_CHUNK=chunk,
        num_warps=cfg.merge_num_warps,
    )
    return o, stage1
