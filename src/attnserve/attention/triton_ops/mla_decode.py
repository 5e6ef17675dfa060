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

Modules: this dispatcher (checks, workspace carving, the choice of stage 1, the merge
launch); `mla_common` (constants, workspace size, `MLADecodeConfig`, the stage-1 argument
bundle `MLAStage1Args`, shared device helpers, the merge kernel); `mla_splits` (split
counts and work lists); one module per stage-1 kernel: `mla_decode_triton`,
`mla_decode_gluon`, `mla_decode_seesaw`.

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
(``MLADecodeConfig.stage1 = "gluon"``), and the warp-specialized `mla_decode_seesaw` (each
warpgroup a whole block's scores; the many-heads default on sm_90, ``stage1 = "seesaw"``); a transposed Triton formulation
(tokens on the MMA M dimension) was tried and was slower (255 registers with spills).

CUDA graphs: `mla_decode_fwd` syncs nothing with the host and allocates nothing when a
workspace is given; its grids depend only on ``bs``, the head count, ``max_kv_splits`` and
the length of the optional work list; per-request split counts (and the work list) may live
on the device (`mla_num_kv_splits_device`).

All code here is original; algorithms after the sources above (SGLang's Triton
``decode_attention`` grouped kernel and CUTLASS-MLA wrapper, FlashMLA) were read, not copied.
"""

from __future__ import annotations

import importlib
from typing import Optional, Union

import torch
import triton

from attnserve.attention.triton_ops.mla_common import (
    _LOG2E,
    MLA_STAGE1_KERNELS,
    MLA_WORK_SPLIT_SPAN,
    MLADecodeConfig,
    MLAStage1Args,
    _merge_tiles,
    _mla_decode_stage2,
    check_last_dim,
    mla_decode_config,
    mla_workspace_size,
)
from attnserve.attention.triton_ops.mla_decode_triton import _mla_decode_stage1
from attnserve.attention.triton_ops.mla_splits import (
    _check_work_splits,
    mla_num_kv_splits,
    mla_num_kv_splits_device,
    mla_num_work_items,
    mla_split_sm_count,
)
from attnserve.triton_env import triton_interpreting

__all__ = [
    "MLADecodeConfig",
    "MLA_STAGE1_KERNELS",
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
        for name in ("mla_decode_gluon", "mla_decode_seesaw"):
            importlib.import_module(f"attnserve.attention.triton_ops.{name}")
    except (ImportError, AttributeError):
        return False
    return True


def _stage1_kind(cfg, q_nope, q_pe, kv_rows, page_size, interpret) -> str:
    """Which stage 1 runs: ``cfg.stage1`` when it is a Gluon kernel and
    `mla_gluon_applicable` holds; else ``"tma"`` (the Triton kernel with descriptor loads,
    where `mla_tma_applicable`) or ``"triton"``."""
    if cfg.stage1 != "triton" and not interpret and mla_gluon_applicable(q_nope, q_pe, kv_rows, page_size,
                                                                          cfg.block_n):
        return cfg.stage1
    if cfg.kv_load == "tma" and mla_tma_applicable(kv_rows, q_nope.shape[2], page_size, cfg.block_n):
        return "tma"
    return "triton"


def _descriptors(kind: str, cfg, kv_rows, d_c: int, d_r: int, block_c: int, block_r: int) -> tuple:
    """``(desc_c, desc_r)`` of the stage 1 ``kind`` (``kv_rows`` as placeholders where unused)."""
    if kind == "seesaw":
        from attnserve.attention.triton_ops.mla_decode_seesaw import seesaw_descriptor

        return seesaw_descriptor(kv_rows), kv_rows
    if kind == "gluon":
        from attnserve.attention.triton_ops.mla_decode_gluon import gluon_descriptors

        return gluon_descriptors(kv_rows, d_c, d_r, cfg.block_n)
    if kind == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        n = kv_rows.shape[0]
        return (TensorDescriptor(kv_rows, [n, d_c], [kv_rows.stride(0), 1], [cfg.block_n, block_c]),
                TensorDescriptor(kv_rows[:, d_c:], [n, d_r], [kv_rows.stride(0), 1], [cfg.block_n, block_r]))
    return kv_rows, kv_rows


def _launch_stage1(kind: str, cfg, args: MLAStage1Args, work_items: bool, page_size: int, max_kv_splits: int,
                   per_req: bool, has_lse: bool, fp32_dot: bool, interpret: bool, block_c: int, block_r: int) -> None:
    """Launch the stage 1 named by ``kind`` (`_stage1_kind`) over ``args`` (``work_items``:
    one program per work-list entry and head tile instead of the split grid)."""
    tiles = triton.cdiv(args.num_heads, cfg.block_h)
    grid = (tiles, args.work.numel(), 1) if work_items else (tiles, max_kv_splits, args.q_nope.shape[0])
    common = dict(D_C=args.q_nope.shape[2], D_R=args.q_pe.shape[2], BLOCK_N=cfg.block_n, PAGE_SIZE=page_size,
                  MAX_KV_SPLITS=max_kv_splits, PER_REQ_SPLITS=per_req, HAS_LSE=has_lse, WORK_ITEMS=work_items,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if kind == "seesaw":
        from attnserve.attention.triton_ops.mla_decode_seesaw import SEESAW_MAXNREG, _mla_decode_stage1_seesaw

        common.update(num_warps=4, num_stages=1)  # the default partition; the kernel adds 4 + 1 worker warps
        _mla_decode_stage1_seesaw[grid](*args, maxnreg=SEESAW_MAXNREG, **common)
    elif kind == "gluon":
        from attnserve.attention.triton_ops.mla_decode_gluon import _mla_decode_stage1_gluon

        _mla_decode_stage1_gluon[grid](*args, NUM_STAGES=cfg.num_stages, **common)
    else:
        _mla_decode_stage1[grid](
            *args, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_H=cfg.block_h, DOT_FP32=interpret,
            DOT_PRECISION="ieee" if fp32_dot else "tf32", PEEL=cfg.is_variant, USE_TMA=kind == "tma", **common,
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
    check_last_dim("q_nope", q_nope, 3)
    check_last_dim("q_pe", q_pe, 3)
    check_last_dim("o", o, 3)
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
    interpret = triton_interpreting()
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
        return o

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

    kind = _stage1_kind(cfg, q_nope, q_pe, kv_rows, int(page_size), interpret)
    desc_c, desc_r = _descriptors(kind, cfg, kv_rows, d_c, d_r, block_c, block_r)
    args = MLAStage1Args(
        q_nope, q_pe, kv_rows, desc_c, desc_r, block_kv_indices, seq_lens, splits_ptr,
        seq_lens if work is None else work, o_part, lse_part, o, lse_arg,
        float(sm_scale) * _LOG2E, num_heads, splits_scalar,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_rows.stride(0), block_kv_indices.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        o.stride(0), o.stride(1), *lse_strides,
    )
    _launch_stage1(kind, cfg, args, work is not None, int(page_size), max_kv_splits, per_req, has_lse, fp32_dot, interpret,
                   block_c, block_r)
    if kind == "seesaw" and max_kv_splits == 1:  # stage 1 wrote o (and lse) of every request, empty ones included
        return o
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
    return o
