"""Shared parts of the paged MLA decode (`mla_decode`): constants, the workspace layout, the
stage-1 tuning config, the argument bundle every stage-1 kernel takes, the device helpers
the stage-1 kernels share, and the log-sum-exp merge (stage 2) with its launcher.

Every stage-1 module (`mla_decode_triton`, `mla_decode_gluon`, `mla_decode_seesaw`) imports
only this module; the dispatcher `mla_decode` imports them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from attnserve.mem_cache.kv_quant import FP8_DTYPES

_LOG2E = 1.4426950408889634
# a work-list entry is b * MLA_WORK_SPLIT_SPAN + split (so max_kv_splits <= 256 with a work list)
MLA_WORK_SPLIT_SPAN = 256
_WORK_SPLIT_SPAN: tl.constexpr = tl.constexpr(MLA_WORK_SPLIT_SPAN)
# H100/H200 opt-in shared memory per block, used when the device is not asked
_DEFAULT_MAX_SMEM = 232448
# partial elements the merge loads per step: [split rows, columns] with 4 warps = 32 fp32
# registers a thread (8 x 512 at <= 8 splits, 16 x 256, 32 x 128 at 32 splits)
_MERGE_TILE = 4096


def mla_workspace_size(max_seq_len: int, bs: int, num_kv_splits: int, num_heads: int, kv_lora_rank: int) -> int:
    """Workspace for `mla_decode_fwd`, in **bytes**.

    Holds float32 split partials: ``o_part [bs, num_heads, num_kv_splits, kv_lora_rank]``
    then ``lse_part [bs, num_heads, num_kv_splits]``, i.e. ``4 * bs * num_heads *
    num_kv_splits * (kv_lora_rank + 1)`` bytes; ``num_kv_splits`` is the ``max_kv_splits``
    the kernel will be launched with. ``max_seq_len`` is accepted for parity with the
    CUTLASS MLA API (whose workspace depends on it) and is only validated: the split count
    already bounds the partials. A buffer sized for a larger ``bs`` serves smaller ones
    (the layout is `carve_workspace`'s); `mla_workspace_rows` gives the ``bs *
    num_kv_splits`` rows the attention backend's launches need (pass them as ``bs`` with
    ``num_kv_splits`` 1).
    """
    for name, v in (("bs", bs), ("num_kv_splits", num_kv_splits), ("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank)):
        if int(v) < 1:
            raise ValueError(f"mla_workspace_size: {name} must be >= 1, got {v}")
    if int(max_seq_len) < 0:
        raise ValueError(f"mla_workspace_size: max_seq_len must be >= 0, got {max_seq_len}")
    return 4 * bs * num_heads * num_kv_splits * (kv_lora_rank + 1)


def carve_workspace(workspace: Optional[torch.Tensor], bs: int, num_heads: int, split_stride: int, kv_lora_rank: int,
                    device: torch.device) -> tuple:
    """The float32 split partials of one `mla_decode_fwd` call, as views of ``workspace``.

    Layout (the one `mla_workspace_size` counts): ``o_part [bs, num_heads, split_stride,
    kv_lora_rank]`` from byte 0, then ``lse_part [bs, num_heads, split_stride]``; so row
    ``(b, s)`` of the partials is ``o_part[b, :, s]`` and ``lse_part[b, :, s]``, and a call
    needs ``bs * split_stride`` rows however few of them its split counts touch.
    ``workspace`` None allocates (not CUDA-graph capturable). Returns ``(o_part, lse_part)``.

    Raises ValueError when ``workspace`` is not a contiguous tensor on ``device``, holds
    fewer than ``mla_workspace_size(0, bs, split_stride, num_heads, kv_lora_rank)`` bytes,
    or any size is below 1 (an empty batch included).
    """
    need = mla_workspace_size(0, bs, split_stride, num_heads, kv_lora_rank)  # raises for bs 0 too
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=device)
    if not workspace.is_contiguous() or workspace.device != device:
        raise ValueError("workspace must be a contiguous tensor on the output's device")
    ws = workspace.view(-1).view(torch.uint8)
    if ws.numel() < need:
        raise ValueError(f"workspace has {ws.numel()} bytes, needs {need} (mla_workspace_size)")
    n_o = bs * num_heads * split_stride * kv_lora_rank
    o_part = ws[: 4 * n_o].view(torch.float32).view(bs, num_heads, split_stride, kv_lora_rank)
    lse_part = ws[4 * n_o : need].view(torch.float32).view(bs, num_heads, split_stride)
    return o_part, lse_part


#: fp8 latent-cache dtypes stage 1 reads (the Triton and seesaw kernels): a stored entry means
#: ``float(stored) * kv_scale`` (`mla_decode.mla_decode_fwd`)
MLA_FP8_DTYPES = FP8_DTYPES

_KV_LOADS = ("ptr", "tma")
#: stage-1 kernels: the Triton kernel (`mla_decode_triton`), the Gluon kernel
#: (`mla_decode_gluon`), the warp-specialized Gluon kernel (`mla_decode_seesaw`) and the
#: transposed fp8 Gluon kernel (`mla_decode_transposed`)
MLA_STAGE1_KERNELS = ("triton", "gluon", "seesaw", "transposed")


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
    stage1: which stage-1 kernel runs where it applies (`MLA_STAGE1_KERNELS`):
        ``"triton"``: the Triton kernel with the fields above (`mla_decode_triton`).
        ``"gluon"``: the Gluon kernel of `mla_decode_gluon` (the tile split over the two
        warpgroups by tokens for QK and by columns for PV; TMA loads, ``num_stages`` deep).
        ``"seesaw"``: the warp-specialized Gluon kernel of `mla_decode_seesaw` (each
        warpgroup computes the scores of a whole 64-token block of a pair; chunked TMA
        loads by a loader warp; it launches its own 4 + 4 + 1 warps).
        ``"transposed"``: for an fp8 cache, the Gluon kernel of `mla_decode_transposed`
        (``S^T = K q^T`` and ``O^T = V^T P^T`` with the fp8 tile converted in registers as
        the wgmma A operand; 16 heads a program, one warpgroup); needs ``block_h`` 16,
        ``block_n`` 64, ``num_warps`` 4 and ``num_stages`` 2 or 4 (TMA tiles in flight); runs
        where `mla_decode.mla_seesaw_fp8_applicable` holds, else (and for a 16-bit cache)
        the Triton kernel with the fields above.
        The other Gluon kernels run where `mla_gluon_applicable` holds and need ``block_h`` 64,
        ``num_warps`` 8 and ``num_stages`` >= 2; elsewhere the Triton kernel with the
        fields above runs.
    kv_pairs: an fp8 cache is read by the Triton kernel as int16 pairs of adjacent columns
        and converted to fp16 in registers, with fp16 dots (its ``KV_PAIRS`` path, where
        `mla_decode_triton.mla_kv_pairs_applicable` holds; else the Triton kernel's byte
        path runs); ignored for a 16-bit cache. A pointer loop that issues the next tile's
        loads before this tile's dots, so ``num_stages`` has no effect there; needs
        ``stage1 == "triton"`` and the ``kv_load`` / ``peel_tail`` defaults.
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    merge_num_warps: int = 4
    kv_load: str = "ptr"
    peel_tail: bool = False
    stage1: str = "triton"
    kv_pairs: bool = False

    def __post_init__(self):
        if self.kv_load not in _KV_LOADS:
            raise ValueError(f"kv_load must be one of {_KV_LOADS}, got {self.kv_load!r}")
        if self.stage1 not in MLA_STAGE1_KERNELS:
            raise ValueError(f"stage1 must be one of {MLA_STAGE1_KERNELS}, got {self.stage1!r}")
        if self.stage1 == "transposed":
            if (self.block_h, self.block_n, self.num_warps) != (16, 64, 4) or self.num_stages not in (2, 4):
                raise ValueError(f"stage1='transposed' needs block_h=16, block_n=64, num_warps=4 and num_stages 2 "
                                 f"or 4, got {self.block_h}, {self.block_n}, {self.num_warps}, {self.num_stages}")
        elif self.stage1 != "triton" and (self.block_h != 64 or self.num_warps != 8 or self.num_stages < 2):
            raise ValueError(f"stage1={self.stage1!r} needs block_h=64, num_warps=8 and num_stages >= 2 (the scores of the next "
                             f"tile are computed while this one is resident), got {self.block_h}, {self.num_warps}, "
                             f"{self.num_stages}")
        if self.kv_pairs and (self.stage1 != "triton" or self.is_variant):
            raise ValueError("kv_pairs runs the Triton kernel's pointer loop: it needs stage1='triton', kv_load='ptr' "
                             "and peel_tail=False")

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
    """The one place that picks stage-1 tiles; tune it from a GPU run (benchmarks/kernels_mla.py).

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
        # Tuned on an H100 (benchmarks/kernels_mla.py sweep, 2026-11-21): 128 heads, b32/16K:
        # (64, 64, 8, 2) 0.64 ms vs 0.82 ms for (64, 32, 8, 2), 221 KB shared memory as compiled;
        # 16 heads, b128/4K: (16, 128, 8, 2) 2.65 TB/s vs 1.96 TB/s for (16, 64, 4, 2).
        # Variant sweep (benchmarks/mla_sweep.py, H100, 2026-11-21): TMA descriptor loads of the
        # latent tiles with a mask-free main loop, 128 heads b32: 0.546 ms at 16K (1.11 TB/s)
        # and 0.161 ms at 4K vs 0.640 / 0.195 ms for the pointer kernel; page sizes that are
        # not a multiple of 64 take the same kernel's pointer path (0.565 ms at 16K).
        # Gluon stage 1 (mla_decode_gluon, 2026-11-21, H200): 0.339 ms at 16K / 0.096 ms at
        # 4K (2 splits) vs 0.507 / 0.141 ms for the Triton TMA kernel in the same run; where it
        # does not apply (not sm_90, other dims or pages) the Triton TMA kernel runs.
        # Warp-specialized seesaw stage 1 (mla_decode_seesaw, 2026-11-21, H100): 0.268 ms at
        # 16K / 0.090 ms at 4K vs 0.327 / 0.102 ms for the Gluon kernel above in the same run.
        if bh >= 64:
            return MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma", stage1="seesaw")
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


class MLAStage1Args(NamedTuple):
    """The positional arguments of every stage-1 kernel, in their order (one bundle, built
    once per call by `mla_decode.mla_decode_fwd` with `build`; each stage-1 launcher runs
    ``kernel[grid](*args, **constexprs)`` and `launch_merge` reads its fields by name).

    Tensors: ``q_nope`` / ``q_pe`` ``[bs, H, D_C / D_R]``; ``kv`` the pool as ``[slots, D_C
    + D_R]`` rows (the queries' dtype, or `MLA_FP8_DTYPES` for the Triton kernel, which takes
    the output scale as a separate argument); ``desc_c`` / ``desc_r`` TMA descriptors (or
    ``kv`` as a placeholder);
    ``block_table`` int32 ``[bs, pages]``; ``seq_lens``; ``num_splits`` (per-request counts
    or a placeholder); ``work`` (the work list or a placeholder); ``o_part`` / ``lse_part``
    float32 split partials (`carve_workspace`); ``o`` / ``lse`` outputs (``o_part`` stands
    in for an absent ``lse``). Scalars: ``sm_scale_log2`` (softmax scale, times an fp8
    cache's kv_scale, times log2 e),
    ``num_heads``, ``num_splits_scalar``, then strides in elements.
    """

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv: torch.Tensor
    desc_c: object
    desc_r: object
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: torch.Tensor
    work: torch.Tensor
    o_part: torch.Tensor
    lse_part: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor
    sm_scale_log2: float
    num_heads: int
    num_splits_scalar: int
    stride_qn_b: int
    stride_qn_h: int
    stride_qp_b: int
    stride_qp_h: int
    stride_kv_t: int
    stride_bt_b: int
    stride_op_b: int
    stride_op_h: int
    stride_op_s: int
    stride_lp_b: int
    stride_lp_h: int
    stride_o_b: int
    stride_o_h: int
    stride_lse_b: int
    stride_lse_h: int

    @classmethod
    def build(cls, q_nope, q_pe, kv, desc_c, desc_r, block_table, seq_lens, num_splits, work, o_part, lse_part, o,
              lse: Optional[torch.Tensor], sm_scale: float, num_splits_scalar: int) -> "MLAStage1Args":
        """The bundle of one call: strides read from the tensors, ``sm_scale`` in natural
        units (stored times log2 e), ``lse`` None replaced by ``o_part`` with strides 0."""
        lse_arg, lse_strides = (o_part, (0, 0)) if lse is None else (lse, (lse.stride(0), lse.stride(1)))
        return cls(
            q_nope, q_pe, kv, desc_c, desc_r, block_table, seq_lens, num_splits, work, o_part, lse_part, o, lse_arg,
            float(sm_scale) * _LOG2E, q_nope.shape[1], num_splits_scalar,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), block_table.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
            o.stride(0), o.stride(1), *lse_strides,
        )


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


def _merge_tiles(block_c: int, splits: int) -> tuple:
    """``(BLOCK_DV, SPLIT_CHUNK)`` of the merge for requests of ``splits`` splits: all of
    them (up to 32) in one load step of ``_MERGE_TILE`` elements, so up to 8 splits keep whole
    512-column rows and 32 splits take 128-column programs (4x the programs, each with one
    step instead of four); a request with more splits takes several steps."""
    chunk = min(32, max(2, triton.next_power_of_2(splits)))
    block_dv = min(block_c, max(16, _MERGE_TILE // chunk))
    return block_dv, chunk


def launch_merge(args: MLAStage1Args, block_n: int, max_kv_splits: int, per_req_splits: bool, has_lse: bool,
                 typical_splits: int, num_warps: int) -> None:
    """Launch stage 2 over the partials of ``args``: grid ``(H, column tiles, bs)``, tiles
    from `_merge_tiles` for requests of ``typical_splits`` splits (more take several steps)."""
    bs, num_heads, _, d_v = args.o_part.shape
    block_dv, chunk = _merge_tiles(triton.next_power_of_2(d_v), typical_splits)
    _mla_decode_stage2[(num_heads, triton.cdiv(d_v, block_dv), bs)](
        args.o_part, args.lse_part, args.o, args.lse, args.seq_lens, args.num_splits, args.num_splits_scalar,
        args.stride_op_b, args.stride_op_h, args.stride_op_s, args.stride_lp_b, args.stride_lp_h,
        args.stride_o_b, args.stride_o_h, args.stride_lse_b, args.stride_lse_h,
        D_V=d_v, BLOCK_DV=block_dv, BLOCK_S=max(2, triton.next_power_of_2(max_kv_splits)), BLOCK_N=block_n,
        MAX_KV_SPLITS=max_kv_splits, PER_REQ_SPLITS=per_req_splits, HAS_LSE=has_lse, SPLIT_CHUNK=chunk,
        num_warps=num_warps,
    )


def check_last_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    """Raise ValueError unless ``t`` has ``ndim`` dimensions and a contiguous last one."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
