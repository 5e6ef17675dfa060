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

FP8 cache: ``kv_buffer`` may hold `MLA_FP8_DTYPES` entries (e4m3fn / e5m2) with one
per-tensor ``kv_scale`` (a stored entry means ``float(stored) * kv_scale``; the latent row
is both key and value, so one scale serves both products). Since ``q . (s * x) = s * (q .
x)`` and the output is a convex combination of c_kv rows, the scale is exact to apply
outside the dots: ``sm_scale * kv_scale`` is folded on the host into the scores' scale, and
each split's normalised output is multiplied by ``kv_scale`` before the merge. The tiles are
converted after their load (exact for both formats) and the dots accumulate in fp32 as for
a 16-bit cache. Four stage-1 paths read fp8: the seesaw kernel (each tile converted to fp16
in shared memory, fp16 MMAs), the transposed kernel (``S^T = K q^T``, ``O^T = V^T P^T`` with
the tile converted to fp16 in registers as the wgmma A operand), the Triton kernel's pairs
path (``kv_pairs``: the cache read as int16 pairs of adjacent columns, converted to fp16 in
registers, fp16 dots) and its byte path (tiles converted to the queries' dtype; fp32 under
the interpreter); the fp16 paths convert bf16 queries to fp16 with saturation to +-65504.
See Stage 1 below.

Paging: ``block_kv_indices[i, j]`` is the page holding tokens ``j*page_size ..`` of request
``i``; page ``p`` is slots ``p*page_size .. p*page_size + page_size - 1`` of ``kv_buffer``.
Entries past ``cdiv(seq_lens[i], page_size)`` (padding, e.g. -1) and slots past
``seq_lens[i]`` are never read.

Modules: this dispatcher (checks, the choice of stage 1, the launches); `mla_common`
(constants, the workspace layout, `MLADecodeConfig`, the stage-1 argument bundle
`MLAStage1Args`, shared device helpers, the merge kernel and its launcher); `mla_splits`
(split counts, work lists, `mla_workspace_rows`); one module per stage-1 kernel, each with
its launcher: `mla_decode_triton` (pointer or TMA loads), `mla_decode_gluon`,
`mla_decode_seesaw` and `mla_decode_transposed` (Gluon, sm_90; imported only when they run).

Stage 1: ``config.stage1`` names the kernel to prefer (`MLA_STAGE1_KERNELS`); a Gluon kernel
runs only where `mla_gluon_applicable` holds, else the Triton kernel, with TMA loads where
``config.kv_load == "tma"`` and `mla_tma_applicable` hold. ``config=None`` takes
`mla_decode_config`'s pick for the shape (the seesaw kernel for >= 64 heads of DeepSeek's
dims in 16-bit). An fp8 cache takes, where `mla_seesaw_fp8_applicable` holds, the
transposed kernel (``"transposed_fp8"``) with config None and up to 16 heads or with a
config preferring ``"transposed"``, and the fp8 variant of the seesaw kernel
(``"seesaw_fp8"``, any head count) with config None above 16 heads or a config preferring
``"seesaw"``; else, with config None and up to 32 heads, or with ``config.kv_pairs``, the
Triton kernel's pairs path (``"triton_pairs"``, where `mla_kv_pairs_applicable` holds);
else the Triton kernel's byte path (TMA loads where the config asks for them and they
apply, else pointer loads). On an H100 the transposed kernel was the fastest at 16 heads
and the fp8 seesaw kernel at 128 (32 and 64 heads: the seesaw kernel beat the Triton paths;
the transposed kernel was not measured there) (benchmarks/NOTES.md session 12);
`mla_stage1_kernel` says which kernel a call runs.

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
    MLA_FP8_DTYPES,
    MLA_STAGE1_KERNELS,
    MLA_WORK_SPLIT_SPAN,
    MLADecodeConfig,
    MLAStage1Args,
    carve_workspace,
    check_last_dim,
    launch_merge,
    mla_decode_config,
    mla_workspace_size,
)
from attnserve.attention.triton_ops.mla_decode_triton import (
    launch_triton_stage1,
    mla_kv_pairs_applicable,
    mla_tma_applicable,
    tma_descriptors,
)
from attnserve.attention.triton_ops.mla_splits import (
    _check_work_splits,
    mla_num_kv_splits,
    mla_num_kv_splits_device,
    mla_num_work_items,
    mla_split_sm_count,
    mla_workspace_rows,
)
from attnserve.mem_cache.kv_quant import check_scale
from attnserve.triton_env import triton_interpreting

__all__ = [
    "MLADecodeConfig",
    "MLA_FP8_DTYPES",
    "MLA_STAGE1_KERNELS",
    "MLA_WORK_SPLIT_SPAN",
    "mla_decode_config",
    "mla_decode_fwd",
    "mla_gluon_applicable",
    "mla_kv_pairs_applicable",
    "mla_seesaw_fp8_applicable",
    "mla_num_kv_splits",
    "mla_num_kv_splits_device",
    "mla_num_work_items",
    "mla_split_sm_count",
    "mla_stage1_kernel",
    "mla_tma_applicable",
    "mla_workspace_rows",
    "mla_workspace_size",
]


def mla_gluon_applicable(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor, page_size: int,
                         block_n: int) -> bool:
    """Whether the Gluon stage 1 kernels (`mla_decode_gluon`, `mla_decode_seesaw`) can run: a CUDA device of compute
    capability 9.x (wgmma, TMA), fp16/bf16 queries and a cache of the same dtype (never an
    fp8 cache: those kernels feed the loaded tiles to wgmma as they are), DeepSeek's
    kv_lora_rank 512 + rope 64, 64-token tiles (a P row of 64 bf16 is one 128-byte swizzle
    row; 32 did not compile) that the TMA can fetch (`mla_tma_applicable`), and a Triton with
    Gluon's Hopper module."""
    if q_nope.device.type != "cuda" or q_nope.dtype not in (torch.float16, torch.bfloat16):
        return False
    if kv_rows.dtype != q_nope.dtype:  # an fp8 cache: the Triton kernel converts its tiles
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


def mla_seesaw_fp8_applicable(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor, page_size: int) -> bool:
    """Whether the fp8 variant of the seesaw kernel (`mla_decode_seesaw`) can read the fp8
    cache rows ``kv_rows`` (`MLA_FP8_DTYPES`): a CUDA device of compute capability 9.x,
    fp16/bf16 queries, kv_lora_rank 512 + rope 64, ``page_size % 64 == 0`` and rows the TMA
    can fetch (`mla_tma_applicable`), and a Triton with Gluon's Hopper module. Any head
    count (a program holds 64 heads; fewer are zero rows)."""
    if q_nope.device.type != "cuda" or q_nope.dtype not in (torch.float16, torch.bfloat16):
        return False
    if kv_rows.dtype not in MLA_FP8_DTYPES or q_nope.shape[2] != 512 or q_pe.shape[2] != 64:
        return False
    if torch.cuda.get_device_capability(q_nope.device)[0] != 9:
        return False
    if not mla_tma_applicable(kv_rows, q_nope.shape[2], page_size, 64):
        return False
    try:
        importlib.import_module("attnserve.attention.triton_ops.mla_decode_seesaw")
    except (ImportError, AttributeError):
        return False
    return True


def _token_rows(kv_buffer: torch.Tensor, width: int) -> torch.Tensor:
    """``kv_buffer`` as ``[num_slots, width]`` token rows; ValueError when it cannot be."""
    if kv_buffer.shape[-1] != width or kv_buffer.dim() not in (2, 3, 4) or kv_buffer.stride(-1) != 1:
        raise ValueError(
            f"kv_buffer must be [num_slots, 1, {width}] (kv_lora_rank + rope) with a contiguous last dim, "
            f"got shape {tuple(kv_buffer.shape)} strides {kv_buffer.stride()}"
        )
    try:
        return kv_buffer.view(-1, width)
    except RuntimeError as e:
        raise ValueError(f"kv_buffer {tuple(kv_buffer.shape)} cannot be viewed as token rows: {e}") from None


#: ``block_h,block_n,num_warps,num_stages`` of the 16-bit default (A/B runs of the engine; the
#: pointer kernel's tiles, e.g. ``16,32,4,5``); unset: `mla_decode_config`'s pick
MLA_DECODE_TILE_ENV = "ATTNSERVE_MLA_DECODE_TILE"


def mla_tile_override() -> Optional[MLADecodeConfig]:
    """The tiles ``ATTNSERVE_MLA_DECODE_TILE`` sets (read at every call), or None.

    Raises:
        ValueError: not four comma-separated integers (powers of two >= 16 for the first two).
    """
    import os

    raw = os.environ.get(MLA_DECODE_TILE_ENV, "").strip()
    if not raw:
        return None
    parts = raw.split(",")
    ok = len(parts) == 4 and all(p.strip().isdigit() and int(p) > 0 for p in parts)
    if ok:
        bh, bn, warps, stages = (int(p) for p in parts)
        ok = all(x >= 16 and x & (x - 1) == 0 for x in (bh, bn))
    if not ok:
        raise ValueError(f"{MLA_DECODE_TILE_ENV}={raw!r}: expected block_h,block_n,num_warps,num_stages "
                         "(block_h and block_n powers of two >= 16), e.g. 16,32,4,5")
    return MLADecodeConfig(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages)


def _default_config(q_nope: torch.Tensor, d_r: int, interpret: bool) -> MLADecodeConfig:
    """`mla_decode_config` for the shape, with the device's opt-in shared memory per block
    (`mla_tile_override` first, off the interpreter)."""
    smem = None
    if not interpret:  # torch caches the properties; older torch lacks the field
        override = mla_tile_override()
        if override is not None:
            return override
        smem = getattr(torch.cuda.get_device_properties(q_nope.device), "shared_memory_per_block_optin", None)
    return mla_decode_config(q_nope.shape[1], q_nope.shape[2], d_r, q_nope.dtype, interpret=interpret,
                             max_shared_mem=smem)


# an fp8 cache's default where the fp8 seesaw kernel applies, above `_TRANSPOSED_MAX_HEADS` heads
_SEESAW_FP8_CONFIG = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma", stage1="seesaw")
# an fp8 cache's default where the fp8 seesaw kernel applies and there are at most
# `_TRANSPOSED_MAX_HEADS` heads: the transposed kernel (`mla_decode_transposed`, one program of
# 16 heads; every further 16 heads re-read the whole cache). H100, e4m3 unless said, bf16
# queries, page 64, stage 1 + merge under a CUDA graph, the callers' split counts, one run
# (benchmarks/mla_fp8_transposed.py, results/h100-80gb-hbm3-mla-fp8-transposed-2026-11-25.json,
# NOTES "Session 12: MLA fp8 transposed kernel"), us, transposed 2 stages / 4 stages / fp8
# seesaw / bf16 default: 16 heads bs 128 x 4K 142.7 / 144.6 / 166.6 / 222.8 (e5m2 144.1 /
# seesaw 169.0); 16 heads bs 32 x 16K 145.9 / 149.7 / 169.6 / 225.2; 128 heads bs 32 x 16K
# 700.5 / 1068.6 / 329.4 / 270.8 (the seesaw kernel stays the default above 16 heads)
_TRANSPOSED_FP8_CONFIG = MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, stage1="transposed")
_TRANSPOSED_MAX_HEADS = 16
# an fp8 cache where the seesaw kernel does not apply takes the Triton pairs path up to this
# many heads (`_fp8_pairs_config`), else the Triton kernel's byte path
_PAIRS_MAX_HEADS = 32


def _fp8_pairs_config(num_heads: int) -> MLADecodeConfig:
    """The Triton pairs path's tiles for an fp8 cache and ``num_heads`` <= ``_PAIRS_MAX_HEADS``.

    Measured on an H100 (benchmarks/NOTES.md session 12; e4m3, bf16 queries, CUDA graphs):
    sweep (benchmarks/mla_fp8_pairs_sweep.py, page 64): 16 heads bs 128 x 4K 207 us with
    (block_h, block_n, num_warps) (16, 128, 8), 214 us (16, 64, 8), 234 us (16, 32, 4), 281
    us (16, 64, 16); 32 heads bs 64 x 8K 284 us with (32, 64, 8), 419 us with (16, 64, 8).
    Same run (benchmarks/fp8_kv.py): 16 heads bs 128 x 4K pairs 207 us, byte path 410 us,
    fp8 seesaw kernel 167 us, bf16 default 225 us; bs 32 x 16K 210 / - / 172 / 223 us; 128
    heads bs 32 x 16K pairs (32, 64, 8) 1078 us, byte path (TMA) 819 us, seesaw 321 us; pages
    of 32 tokens (no seesaw kernel): 16 heads bs 128 x 4K pairs 210 us against the byte
    path's 407 us, 64 heads bs 64 x 8K pairs 580 us against 437 us. So the fp8 Gluon
    kernels stay the default wherever they apply (`_pick_stage1`), this path serves the
    caches it does not up to 32 heads (pages that are not multiples of 64, sm_89), and the
    byte path's 64-head tiles the rest (``_PAIRS_MAX_HEADS``)."""
    if num_heads <= 16:
        return MLADecodeConfig(block_h=16, block_n=128, num_warps=8, num_stages=1, kv_pairs=True)
    return MLADecodeConfig(block_h=32, block_n=64, num_warps=8, num_stages=1, kv_pairs=True)


def _pick_stage1(config, q_nope, q_pe, kv_rows, page_size, interpret) -> tuple:
    """``(cfg, kind)``: ``config`` and `_stage1_kind`'s pick; config None takes the default
    for the shape. For an fp8 cache (not under the interpreter) that is, where
    `mla_seesaw_fp8_applicable` holds, the transposed kernel up to ``_TRANSPOSED_MAX_HEADS``
    heads and the fp8 seesaw kernel above, else the Triton pairs path
    (`_fp8_pairs_config`) for up to ``_PAIRS_MAX_HEADS`` heads where
    `mla_kv_pairs_applicable` holds, else the 16-bit default config (the Triton kernel's
    byte path)."""
    if config is None:
        if not interpret and kv_rows.dtype in MLA_FP8_DTYPES:
            if mla_seesaw_fp8_applicable(q_nope, q_pe, kv_rows, page_size):
                if q_nope.shape[1] <= _TRANSPOSED_MAX_HEADS:
                    return _TRANSPOSED_FP8_CONFIG, "transposed_fp8"
                return _SEESAW_FP8_CONFIG, "seesaw_fp8"
            if q_nope.shape[1] <= _PAIRS_MAX_HEADS and mla_kv_pairs_applicable(q_nope, q_pe, kv_rows):
                return _fp8_pairs_config(q_nope.shape[1]), "triton_pairs"
        config = _default_config(q_nope, q_pe.shape[2], interpret)
    return config, _stage1_kind(config, q_nope, q_pe, kv_rows, page_size, interpret)


def _stage1_kind(cfg, q_nope, q_pe, kv_rows, page_size, interpret) -> str:
    """Which stage 1 runs: for ``cfg.stage1 == "transposed"`` ``"transposed_fp8"`` (an fp8
    cache where `mla_seesaw_fp8_applicable` holds) or ``"triton"``; else ``cfg.stage1`` when
    it is a Gluon kernel and `mla_gluon_applicable` holds; for an fp8 cache ``"seesaw_fp8"`` when ``cfg.stage1`` is
    ``"seesaw"`` and `mla_seesaw_fp8_applicable` holds (the ``"gluon"`` kernel has no fp8
    variant), ``"triton_pairs"`` when ``cfg.kv_pairs`` and `mla_kv_pairs_applicable` hold;
    else ``"tma"`` (the Triton kernel with descriptor loads, where `mla_tma_applicable`) or
    ``"triton"``."""
    fp8 = not interpret and kv_rows.dtype in MLA_FP8_DTYPES
    if cfg.stage1 == "transposed":
        if fp8 and mla_seesaw_fp8_applicable(q_nope, q_pe, kv_rows, page_size):
            return "transposed_fp8"
        return "triton"
    if cfg.stage1 == "seesaw" and fp8 and mla_seesaw_fp8_applicable(q_nope, q_pe, kv_rows, page_size):
        return "seesaw_fp8"
    if cfg.kv_pairs and fp8 and mla_kv_pairs_applicable(q_nope, q_pe, kv_rows):
        return "triton_pairs"
    if cfg.stage1 != "triton" and not interpret and mla_gluon_applicable(q_nope, q_pe, kv_rows, page_size,
                                                                          cfg.block_n):
        return cfg.stage1
    if cfg.kv_load == "tma" and mla_tma_applicable(kv_rows, q_nope.shape[2], page_size, cfg.block_n):
        return "tma"
    return "triton"


def mla_stage1_kernel(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor, page_size: int,
                      config: Optional[MLADecodeConfig] = None) -> str:
    """The stage-1 kernel `mla_decode_fwd` runs for these inputs and ``config`` (None: the
    default pick, as in `mla_decode_fwd`): ``"seesaw"`` / ``"gluon"`` (the Gluon kernels),
    ``"seesaw_fp8"`` (the seesaw kernel reading an fp8 cache), ``"transposed_fp8"`` (the
    transposed kernel reading an fp8 cache), ``"triton_pairs"`` (the
    Triton kernel reading an fp8 cache as int16 pairs), ``"tma"`` (the Triton kernel with
    TMA loads of full tiles) or ``"triton"`` (pointer loads). Depends on the tensors'
    shapes, dtypes, strides, alignment and device and on ``page_size``, not on their values
    (nor on ``kv_scale``), so one answer holds for every call of a benchmark or a captured
    graph on the same buffers. An fp8 ``kv_buffer`` names ``"seesaw_fp8"``, ``"transposed_fp8"``,
    ``"triton_pairs"`` (see the module note) or the Triton kernel's byte path (``"tma"`` /
    ``"triton"``), never ``"seesaw"`` / ``"gluon"``; a 16-bit one never the fp8 kinds.

    ``q_nope`` / ``q_pe`` / ``kv_buffer`` as for `mla_decode_fwd`; raises ValueError when
    they are not 3-D / token rows of ``kv_lora_rank + rope``.
    """
    check_last_dim("q_nope", q_nope, 3)
    check_last_dim("q_pe", q_pe, 3)
    kv_rows = _token_rows(kv_buffer, q_nope.shape[2] + q_pe.shape[2])
    interpret = triton_interpreting()
    return _pick_stage1(config, q_nope, q_pe, kv_rows, int(page_size), interpret)[1]


def _stage1_descriptors(kind: str, kv_rows: torch.Tensor, d_c: int, d_r: int, block_n: int) -> tuple:
    """``(desc_c, desc_r)`` of the stage 1 ``kind`` (``kv_rows`` as placeholders where unused)."""
    if kind in ("seesaw", "seesaw_fp8", "transposed_fp8"):
        from attnserve.attention.triton_ops import mla_decode_seesaw

        return mla_decode_seesaw.seesaw_descriptor(kv_rows), kv_rows
    if kind == "gluon":
        from attnserve.attention.triton_ops import mla_decode_gluon

        return mla_decode_gluon.gluon_descriptors(kv_rows, d_c, d_r, block_n)
    if kind == "tma":
        return tma_descriptors(kv_rows, d_c, d_r, block_n)
    return kv_rows, kv_rows


def _launch_stage1(kind: str, args: MLAStage1Args, grid: tuple, constexprs: dict, cfg: MLADecodeConfig,
                   interpret: bool, out_scale: float) -> None:
    """Hand ``args`` to the launcher of the stage 1 ``kind`` (`_stage1_kind`); ``out_scale``
    (an fp8 cache's kv_scale; else 1.0) goes to the kernels that read fp8 (the Triton kernel
    and the seesaw kernel)."""
    if kind in ("seesaw", "seesaw_fp8"):
        from attnserve.attention.triton_ops.mla_decode_seesaw import launch_seesaw_stage1

        launch_seesaw_stage1(args, grid, constexprs, out_scale=out_scale)
    elif kind == "transposed_fp8":
        from attnserve.attention.triton_ops.mla_decode_transposed import launch_transposed_stage1

        launch_transposed_stage1(args, grid, constexprs, cfg.num_stages, out_scale=out_scale)
    elif kind == "gluon":
        from attnserve.attention.triton_ops.mla_decode_gluon import launch_gluon_stage1

        launch_gluon_stage1(args, grid, constexprs, cfg.num_stages)
    else:
        launch_triton_stage1(args, grid, constexprs, cfg, use_tma=kind == "tma", interpret=interpret,
                             out_scale=out_scale, kv_pairs=kind == "triton_pairs")


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
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Paged MLA decode with absorbed weights; writes ``o`` (and ``lse``) and returns ``o``.

    Args:
        q_nope: ``[bs, H, kv_lora_rank]`` fp16/bf16 (fp32 accepted), query already times W_UK.
        q_pe: ``[bs, H, rope]`` same dtype, rotary part of the query.
        kv_buffer: latent cache ``[num_slots, 1, kv_lora_rank + rope]`` (also accepted:
            ``[num_slots, D]`` or ``[num_pages, page_size, 1, D]`` views), same dtype as q,
            or fp8 (`MLA_FP8_DTYPES`: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``) with
            any query dtype; an entry means ``float(stored) * kv_scale``. An fp8 cache runs
            where `mla_seesaw_fp8_applicable` holds the transposed kernel (config None and
            up to 16 heads, or preferring ``"transposed"``) or the fp8 seesaw kernel (config
            None above 16 heads, or preferring ``"seesaw"``), else the Triton stage 1: its pairs path where
            `mla_kv_pairs_applicable` holds and the config is None (up to 32 heads) or sets
            ``kv_pairs``, else its byte path (TMA loads where `mla_tma_applicable` holds and
            the config asks for them, pointer loads elsewhere).
        block_kv_indices: int32 ``[bs, max_blocks]`` page ids, padded (e.g. with -1); must
            have at least ``cdiv(seq_lens[i], page_size)`` valid entries in row i.
        seq_lens: ``[bs]`` int32/int64 tokens per request (0 allowed: o = 0, lse = -inf).
        page_size: tokens per page (>= 1; 1 = token-level table).
        o: output ``[bs, H, kv_lora_rank]`` (any float dtype; last dim contiguous).
        sm_scale: softmax scale applied to the full 576-wide dot (of the true values: the
            kernel uses ``sm_scale * kv_scale`` on the stored ones).
        num_kv_splits: python int, or int32 ``[bs]`` device tensor (`mla_num_kv_splits_device`);
            clamped to ``[1, max_kv_splits]`` per request.
        max_kv_splits: grid size along the sequence (>= 1); fixed for CUDA graphs.
        workspace: >= `mla_workspace_size` (..., bs, max_kv_splits, H, kv_lora_rank) bytes,
            contiguous, any dtype; allocated here when None (not capturable then).
        lse: optional float32 ``[bs, H]``: natural-log sum-exp of the scaled scores.
        config: stage-1 tiles and preferred kernel (`MLADecodeConfig`); `mla_decode_config`'s
            pick when None. `mla_stage1_kernel` says which kernel runs.
        work: optional int32 ``[W]`` work list from `mla_num_kv_splits_device` (with
            ``num_kv_splits`` the tensor it filled): stage 1 then runs one program per
            list entry and head tile (grid ``(head tiles, W)``) instead of ``(head tiles,
            max_kv_splits, bs)``, so a long request can take many splits without a grid of
            empty programs for the others. ``max_kv_splits`` stays the workspace's split
            dimension and the merge's cap.
        kv_scale: host float > 0, an fp8 cache's per-tensor dequantisation scale (one for
            the whole latent row, key and value alike; fixed per layer, so a captured graph
            keeps the value it was captured with). Scores use ``sm_scale * kv_scale`` and
            each split's output is multiplied by ``kv_scale`` before the merge; ``lse`` is
            that of the true scores. Ignored (validated only) for a 16/32-bit cache, whose
            entries are the values themselves (`RadixAttention.k_scale`'s convention), so
            such a call runs exactly as without it, the Gluon kernels included.

    With ``max_kv_splits == 1`` the seesaw stage 1 writes every request itself (zeros for
    empty ones) and the merge kernel is not launched.

    Raises ValueError on shape/dtype/device mismatches, an empty batch (``bs == 0``) or a
    too-small workspace. No host sync: lengths and split counts are read on the device only.
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
    if q_pe.dtype != q_nope.dtype or (kv_buffer.dtype != q_nope.dtype and kv_buffer.dtype not in MLA_FP8_DTYPES):
        raise ValueError(f"dtype mismatch: q_nope {q_nope.dtype}, q_pe {q_pe.dtype}, kv_buffer {kv_buffer.dtype} "
                         f"(kv_buffer: the queries' dtype or one of {MLA_FP8_DTYPES})")
    if isinstance(kv_scale, torch.Tensor):  # float() of a device tensor would sync (and break graph capture)
        raise ValueError("kv_scale must be a host float, got a tensor")
    kv_scale = check_scale("kv_scale", kv_scale)
    if kv_buffer.dtype not in MLA_FP8_DTYPES:  # a 16/32-bit cache stores the values themselves
        kv_scale = 1.0
    if q_nope.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q_nope.dtype}")
    kv_rows = _token_rows(kv_buffer, d_c + d_r)
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
    o_part, lse_part = carve_workspace(workspace, bs, num_heads, max_kv_splits, d_c, o.device)
    cfg, kind = _pick_stage1(config, q_nope, q_pe, kv_rows, int(page_size), interpret)
    desc_c, desc_r = _stage1_descriptors(kind, kv_rows, d_c, d_r, cfg.block_n)
    # the stored values' scores: q . (kv_scale * x) = kv_scale * (q . x), folded here
    score_scale = sm_scale if kv_scale == 1.0 else float(sm_scale) * kv_scale
    args = MLAStage1Args.build(q_nope, q_pe, kv_rows, desc_c, desc_r, block_kv_indices, seq_lens, splits_ptr,
                               seq_lens if work is None else work, o_part, lse_part, o, lse, score_scale, splits_scalar)
    tiles = triton.cdiv(num_heads, cfg.block_h)
    grid = (tiles, max_kv_splits, bs) if work is None else (tiles, work.numel(), 1)
    constexprs = dict(D_C=d_c, D_R=d_r, BLOCK_N=cfg.block_n, PAGE_SIZE=int(page_size), MAX_KV_SPLITS=max_kv_splits,
                      PER_REQ_SPLITS=per_req, HAS_LSE=lse is not None, WORK_ITEMS=work is not None,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launch_stage1(kind, args, grid, constexprs, cfg, interpret, kv_scale)
    if kind in ("seesaw", "seesaw_fp8") and max_kv_splits == 1:  # stage 1 wrote o (and lse) of every request, empty ones included
        return o
    # merge tiles for the split count most requests have: max_kv_splits on a grid, the
    # uniform batch's count (split_sm_count // bs = (W - bs) // bs) with a work list; a
    # request with more splits loops over chunks
    typical = max_kv_splits if work is None else max(1, min(max_kv_splits, (work.numel() - bs) // bs))
    launch_merge(args, cfg.block_n, max_kv_splits, per_req, lse is not None, typical, cfg.merge_num_warps)
    return o
