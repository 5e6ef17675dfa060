"""Launch tuning of the paged decode kernels (`decode_attention`): the one place it lives.

`decode_config` picks stage 1's tile (keys per tile, query-head block, warps, software
pipelining stages, fp8 V pairs) from the head size, GQA group, KV dtype, the device and, for
large batches, the number of stage-1 programs per SM. Every number here was measured; the
sources are cited next to the constants and in `decode_config`'s docstring.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import triton

from attnserve.env_options import env_flag
from attnserve.mem_cache.kv_quant import FP8_DTYPES


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of stage 1 (see `decode_config`).

    block_n: keys per tile (also the split alignment); block_h: query heads per program
    (1 = per-head kernel without ``tl.dot``, else >= 16 rows for ``tl.dot``); num_warps /
    num_stages: Triton launch options; stage2_warps: warps of the merge kernel; v_pairs: an
    fp8 V buffer is read as int16 pairs of adjacent columns and converted in registers
    (``V_PAIRS`` of stage 1; CUDA, 16-bit queries and ``Dv`` a power of two >= 32 only,
    else ignored); merge_block: splits stage 2 merges per step (`decode_merge`; 1 = one at
    a time, the loop before the small-batch rule); pdl: launch both stages with
    programmatic dependent launch where `attnserve.pdl.pdl_enabled` holds
    (ignored elsewhere); maxnreg: registers per thread that stage 1 may use (Triton's
    ``maxnreg`` launch option, PTX ``.maxnreg``; 0 = the compiler's choice, the default and
    the only value the default tiles use); merge_heads: query heads per stage-2 program
    (`decode_merge`; 1 = one program per (request, head), the only value outside the batch
    tiles); whole_dk: a K head size that is not a power of two is read as one tile of the
    next power of two, its tail masked (96 -> 128), instead of a power-of-two main tile and a
    remainder tile with their own gathers and dots (96 -> 64 + 32, `_split_dims`).
    """

    block_n: int
    block_h: int
    num_warps: int
    num_stages: int
    stage2_warps: int = 2
    v_pairs: bool = False
    merge_block: int = 32
    pdl: bool = False
    maxnreg: int = 0
    merge_heads: int = 1
    whole_dk: bool = False


#: (block_n, num_stages, num_warps) of stage 1 for an fp8 cache on an H100 / H200 below the batch
#: tiles (`decode_config`). 128 keys / 5 stages keep two K/V buffers (the 256 / 3 tile before it
#: kept one; see `FP8_TILE_VARIANTS`). H100, Llama-3-8B heads, `benchmarks/decode_fp8_variants.py`
#: (benchmarks/NOTES.md, 2026-11-27 seventh): 64 x 640 keys 45.0 -> 41.6 us, 8 x 4096 35.1 -> 33.9 us;
#: the old tile stays selectable as ``ATTNSERVE_DECODE_FP8_TILE=sb256``.
FP8_HOPPER_TILE = (128, 5, 4)
#: device names (``torch.cuda.get_device_name`` substrings) that take `FP8_HOPPER_TILE` with V pairs
FP8_PAIRS_DEVICES = ("H100", "H200")

#: opt-in shared memory per block from which 3-stage 128-key tiles fit (H100/H200: 227 KB)
_BIG_SMEM = 200 * 1024
#: stage-1 programs (requests x head programs) per SM from which a batch takes the batch tiles
BATCH_PROGRAMS_PER_SM = 8
#: (block_n, num_stages, num_warps, maxnreg) of stage 1 for a 16-bit cache at >= BATCH_PROGRAMS_PER_SM
#: programs per SM (the layout of `FP8_TILE_VARIANTS`; maxnreg 0: no cap)
BATCH_TILE = (128, 2, 4, 0)
#: a 16-bit cache of head size 128 with at most this many KV heads (per rank) takes 2 stages below
#: the batch tiles on `FEW_KV_HEADS_DEVICES` (`_tile_config`; ``ATTNSERVE_DECODE_FEW_KV_HEADS=0`` turns it off)
FEW_KV_HEADS = 4
#: device names (``torch.cuda.get_device_name`` substrings) where the few-KV-heads rule was measured to gain
FEW_KV_HEADS_DEVICES = ("H200",)
#: environment switch of the few-KV-heads rule (read at every `decode_config` call)
FEW_KV_HEADS_ENV = "ATTNSERVE_DECODE_FEW_KV_HEADS"
#: head sizes whose 16-bit cache takes `WHOLE_DK_TILE` on GPUs with the big shared memory (`_tile_config`)
WHOLE_DK_HEAD_SIZES = (96,)
#: (block_n, num_stages, num_warps, maxnreg) of stage 1 for those head sizes, K read as one padded
#: tile (``DecodeConfig.whole_dk``), at every batch size. H200, Phi-3-mini heads (32 KV heads of 96),
#: stage 1 + 2 in CUDA graphs with the KV rotated past the L2, the engine's split rule
#: (``decode_batch_sweep.py --head-shapes``, ``results/h200-decode-head-shapes-2026-11-28.json``),
#: µs, the tile before (128 keys, 3 stages below the batch tiles and 2 at them; K as 64 + 32) -> this:
#: 1 x 2048 18.0 -> 14.8, 8 x 4096 114.4 -> 109.3, 32 x 800 104.9 -> 88.8, 96 x 800 321.5 -> 255.6,
#: 144 x 800 482.3 -> 372.3, 256 x [200, 1800] 985.2 -> 820.1 (0.70-0.73 -> 0.84-0.90 of copy at 32-256
#: requests). Reading K whole alone gave most of it (the same old tiles: 270.3 at 96 x 800, 819.5 at
#: 256); the 32-key / 5-stage tile (two K/V buffers) the rest. Not measured on an H100.
WHOLE_DK_TILE = (32, 5, 4, 0)
#: environment switch of the whole-K rule of decode and extend (read at every `decode_config` /
#: `extend_tuning.extend_config` call; ``0`` turns it off)
WHOLE_DK_ENV = "ATTNSERVE_WHOLE_DK"
#: (block_n, num_stages, num_warps, maxnreg) of stage 1 for an fp8 cache on an H100 / H200 at that
#: many programs (V pairs): two K/V buffers with registers capped at 168, so 3 programs fit an SM
#: (the ``db128r168`` variant). H100, Llama-3-8B heads, `benchmarks/decode_fp8_variants.py`, two runs
#: against the 128 / 4 tile before it (benchmarks/NOTES.md, 2026-11-27 seventh): 144 x 800 keys
#: x1.015 / x1.010, 256 requests of [200, 1800] x1.017 / x1.017 (below the batch tiles the cap lost
#: 3-4% at 1-32 requests, so the small-batch tile `FP8_HOPPER_TILE` keeps the registers).
FP8_HOPPER_BATCH_TILE = (128, 5, 4, 168)
#: query heads per stage-2 program at the batch tiles (`decode_config`, `decode_merge`): there
#: nearly every request has one split and its stage-2 programs only return. H100, CUDA-graph
#: decode steps of 800 keys a request (`benchmarks/profile_step.py`, stage 2 µs a step for 1 / 8
#: / 16 heads a program; results/h100-80gb-hbm3-profile-step-merge-heads-*-2026-11-27.json):
#: Llama-3-8B 144 requests 126.7 / 63.5 / 49.8, 256 requests 197.1 / 75.7 / 53.8; Qwen3-0.6B
#: (16 heads) 144: 71.0 / 41.4 / 41.3, 256: 101.6 / 43.4 / 42.4. Busy GPU time a step -0.5 to -0.8%.
BATCH_MERGE_HEADS = 16
#: environment override of `BATCH_MERGE_HEADS` (an int >= 1; 1 = a program per head, as before)
MERGE_HEADS_ENV = "ATTNSERVE_DECODE_MERGE_HEADS"
#: environment switch of the small-batch rule (`small_batch_rule_enabled`)
SMALL_BATCH_ENV = "ATTNSERVE_DECODE_SMALL_BATCH"
#: opt-in switch (`decode_config`): launch both stages with PDL at every batch size, not only
#: when stage 1 fits in one wave (not measured at large batches yet; default off)
PDL_ALL_ENV = "ATTNSERVE_DECODE_PDL_ALL"
#: environment variable naming an opt-in fp8 V-pairs tile (`fp8_tile_variant`)
FP8_TILE_ENV = "ATTNSERVE_DECODE_FP8_TILE"
#: Opt-in fp8 V-pairs tiles of stage 1 on an H100 / H200, (block_n, num_stages, num_warps,
#: maxnreg), used for small and large batches alike (`fp8_tile_variant`). Offline sm_90a
#: compiles with Triton 3.6 (benchmarks/NOTES.md, "fp8-KV decode: offline instruction
#: analysis"): the default tiles (256/3 and 128/4) keep ONE shared-memory buffer of K and V,
#: because the gathered loads' index load takes one of the pipeline stages (stages between
#: loads = ceil((num_stages - 2) / 2)); each program then waits for its next tile after
#: computing the current one. 5 stages give two buffers (the next tile's copy stays in
#: flight during the current tile's compute), 7 give three.
FP8_TILE_VARIANTS = {
    "db128": (128, 5, 4, 0),      # 2 K/V buffers, 185 regs, 75 KB: 2 programs per SM
    "tb128": (128, 7, 4, 0),      # 3 K/V buffers, 188 regs, 108 KB: 2 programs per SM
    "db128r168": (128, 5, 4, 168),  # 2 buffers, capped at 168 regs (8 B stack): 3 programs per SM
    "db64": (64, 5, 4, 0),        # 2 buffers, 143 regs, 40 KB: 3 programs per SM
    "sb256": (256, 3, 4, 0),      # the small-batch default before 2026-11-27 (one 64 KB K/V buffer)
}
#: environment variable naming an opt-in 16-bit-cache tile (`bf16_tile_variant`)
BF16_TILE_ENV = "ATTNSERVE_DECODE_BF16_TILE"
#: Opt-in stage-1 tiles for a 16-bit cache on GPUs with the big shared memory, same layout
#: as `FP8_TILE_VARIANTS`. The same single-buffer rule holds for the 16-bit tiles (128/3 and
#: the batch tile 128/2 keep one K/V buffer); bf16 reaches 0.87-0.93 of the copy rate through
#: 2-3 programs per SM instead. Candidates (not yet timed; smem = buffers x 2 x block_n x 256 B
#: at d 128): 128 keys / 5 stages, two 64 KB buffers (1-2 programs per SM); 64 keys / 5 and 7
#: stages, two or three 32 KB buffers (2-3 programs per SM).
BF16_TILE_VARIANTS = {
    "db128": (128, 5, 4, 0),
    "db64": (64, 5, 4, 0),
    "tb64": (64, 7, 4, 0),
    # 64 keys at 2 / 4 stages: the best tiles of an H200 sweep at 64 x 800 and 144 x 800
    # (``decode_batch_sweep.py --quick``, 2026-11-28)
    "sb64": (64, 2, 4, 0),
    "qb64": (64, 4, 4, 0),
}


def small_batch_rule_enabled() -> bool:
    """Whether the small-batch decode rule is on (default; ``ATTNSERVE_DECODE_SMALL_BATCH=0``,
    ``false``, ``no`` or ``off`` turns it off, read at every call so one process can time
    both): stage 2 merges `decode_merge.MAX_SPLIT_BLOCK` splits per step instead of one,
    batches of at most one stage-1 program per SM at one split a request launch both stages
    with PDL (`decode_config`), and the triton backend passes
    `decode_splits.SMALL_SPLIT_TOKENS` to `compute_num_kv_splits` (one-tile splits while they
    fit in one wave). Off, decode launches as before the rule (the same stage-2 operations
    in the same order; stage 1 issues its q and metadata loads together either way)."""
    return env_flag(SMALL_BATCH_ENV)


def _tile_variant(env: str, table: dict) -> Optional[Tuple[int, int, int, int]]:
    """The entry of ``table`` named by the environment variable ``env`` (read at every call
    so one process can time several), or None when it is unset, empty or ``default``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    raw = os.environ.get(env, "").strip().lower()
    if raw in ("", "default"):
        return None
    if raw not in table:
        raise ValueError(f"{env}={raw!r}: expected 'default' or one of {sorted(table)}")
    return table[raw]


def fp8_tile_variant() -> Optional[Tuple[int, int, int, int]]:
    """The opt-in fp8 V-pairs tile named by ``ATTNSERVE_DECODE_FP8_TILE`` (one of
    `FP8_TILE_VARIANTS`), or None (the measured tiles of `_tile_config`); see `_tile_variant`."""
    return _tile_variant(FP8_TILE_ENV, FP8_TILE_VARIANTS)


def bf16_tile_variant() -> Optional[Tuple[int, int, int, int]]:
    """The opt-in 16-bit-cache tile named by ``ATTNSERVE_DECODE_BF16_TILE`` (one of
    `BF16_TILE_VARIANTS`), or None (the measured tiles of `_tile_config`); see `_tile_variant`."""
    return _tile_variant(BF16_TILE_ENV, BF16_TILE_VARIANTS)


def batch_merge_heads() -> int:
    """Query heads per stage-2 program at the batch tiles: `BATCH_MERGE_HEADS`, or the int in
    ``ATTNSERVE_DECODE_MERGE_HEADS`` (read at every call, so one process can time several).

    Raises:
        ValueError: the variable is not an int >= 1.
    """
    from attnserve.env_options import env_int

    return env_int(MERGE_HEADS_ENV, BATCH_MERGE_HEADS, 1, 1 << 16, "1 = one stage-2 program per head")


def decode_config(head_dim: int, group_size: int, dtype: torch.dtype, is_hip: bool = False,
                   max_shared_mem: int = 0, device_name: str = "", batch_size: int = 0,
                   num_kv_heads: int = 0, num_sms: int = 0) -> DecodeConfig:
    """The one place decode tuning lives: the tiles of `_tile_config` plus the small-batch
    rule (`small_batch_rule_enabled`). With the rule on, stage 2 merges up to 32 splits a
    step (``merge_block``), and a batch whose stage-1 programs at one split a request fit
    in one wave (``batch_size * num_kv_heads * head blocks <= num_sms``, all three known)
    sets ``pdl`` (every batch with ``ATTNSERVE_DECODE_PDL_ALL=1``, opt-in), and a batch at the
    batch tiles (``BATCH_PROGRAMS_PER_SM`` stage-1 programs per SM) merges `batch_merge_heads`
    query heads per stage-2 program; off, ``merge_block`` is 1, ``pdl`` False and
    ``merge_heads`` 1 (the kernels as before). Arguments as in `_tile_config`.

    Why (H100, torch.profiler over CUDA-graph replays, no PDL, 2026-11-27): at batch 1 with
    ~576 keys stage 1 took ~7 us and stage 2 ~2 us per layer for Llama-3-8B heads at tp 1
    and at tp 4, for 2.4 / 0.6 MB of KV (~1 / 0.2 us at the copy rate): a chain of
    dependent loads and two launches, not bandwidth. Measured with the rule
    (`benchmarks/decode_small_batch.py --quick`, one H100, 2026-11-27,
    ``results/h100-80gb-hbm3-decode-small-batch-2026-11-27.json``): batch 1 x 576 keys
    9.83 -> 7.00 us a layer (Llama-3-8B heads), 7.74 -> 5.95 (its tp-4 heads), 9.43 -> 6.79
    (Qwen3-0.6B); batch 1 x 8192 21.9 -> 18.6; batch 8 within 2%; geomean 0.85 over 12 cases.
    """
    cfg = _tile_config(head_dim, group_size, dtype, is_hip, max_shared_mem, device_name, batch_size,
                       num_kv_heads, num_sms)
    if not small_batch_rule_enabled():
        return replace(cfg, merge_block=1, pdl=False)
    programs = batch_size * num_kv_heads * _head_blocks(cfg.block_h, group_size)
    if _at_batch_tiles(programs, num_sms):
        cfg = replace(cfg, merge_heads=batch_merge_heads())
    if env_flag(PDL_ALL_ENV, default=False):
        # stage 1 lets stage 2 launch once its last programs have started, so stage 2's
        # launch overlaps stage 1's last wave instead of following it
        return replace(cfg, pdl=True)
    return replace(cfg, pdl=num_sms > 0 and 0 < programs <= num_sms)


def _tile_config(head_dim: int, group_size: int, dtype: torch.dtype, is_hip: bool, max_shared_mem: int,
                 device_name: str, batch_size: int, num_kv_heads: int, num_sms: int) -> DecodeConfig:
    """Stage-1 tiles of `decode_config`.

    Args:
        head_dim: K head size (``Dk``; 576 for MLA).
        group_size: query heads per KV head (1 = MHA).
        dtype: KV dtype.
        is_hip: AMD GPUs (no software pipelining with gathers; wave64).
        max_shared_mem: the device's opt-in shared memory per block in bytes (0: unknown).
        device_name: ``torch.cuda.get_device_name`` ("" when unknown); fp8 caches on an
            H100 / H200 (`FP8_PAIRS_DEVICES`) get their own tiles (below).
        batch_size / num_kv_heads / num_sms: the launch's requests and KV heads and the
            device's SMs; any 0 (unknown, or a batch-invariant caller) keeps the small-batch
            tiles. From `BATCH_PROGRAMS_PER_SM` stage-1 programs per SM at one split a
            request (``batch_size * num_kv_heads * head blocks``) the batch tiles apply (below).

    Large batches (`benchmarks/decode_batch_sweep.py`, H100, 2026-11-27, CUDA graphs, Hkv 8,
    d 128, µs, small-batch tile -> batch tile): 144 requests of 800 keys, Llama-3-8B heads
    178.9 -> 172.9 (bf16, 0.88 -> 0.91 of the copy rate), 111.7 -> 105.1 (e4m3); Qwen3-0.6B
    heads 175.9 -> 170.0 (bf16), 108.7 -> 101.6 (e4m3); 256 requests uniform in [200, 1800]
    keys 374.0 -> 370.3 (bf16), 215.3 -> 209.4 (e4m3); 256 x 800 within 0.2%. At 64 x 800
    (3.9 programs per SM) no tile beat the small-batch one by more than 0.5%.

    Few KV heads (one rank's heads under tensor parallelism, or models such as Qwen2.5-7B with 4):
    below the batch tiles, 2 stages instead of 3 where ``num_kv_heads <= FEW_KV_HEADS``, head size
    128, a 16-bit cache, on `FEW_KV_HEADS_DEVICES`. Measured on an H200 (``decode_batch_sweep.py
    --stages-ab``, stage 1 + 2 in CUDA graphs with the KV rotated past the L2, the engine's split
    rule; ``results/h200-decode-stages-ab-2026-11-28.json``), µs 3 -> 2 stages, same bits: 2 KV
    heads (Llama-3-8B at tp 4) 8 x 4K 18.7 -> 16.4, 64 x 576 19.7 -> 18.6, 64 x 800 24.3 -> 21.8,
    144 x 800 49.2 -> 38.2, 256 x [200, 1800] 83.7 -> 84.3, batch 1 6.0 -> 6.0; 4 KV heads (tp 2)
    1.03-1.08x at every batch from 8; 8 KV heads (tp 1) 2 stages *lose* 4-10% (8 x 4K 41.6 -> 43.2,
    64 x 800 62.5 -> 69.1), so the rule stops at 4. Not measured on an H100 (where the 2026-11-27
    sweep above kept 3 stages at 8 heads), so H100s keep 3. End to end on one H200 (Qwen2.5-7B
    shape, 4 KV heads, `bench.offline`'s random workload, one run each): 11.07 -> 11.01 s.

    Head size 96 (Phi-3-mini, Phi-3.5-mini) with a 16-bit cache: `WHOLE_DK_TILE` at every batch,
    K read whole (``ATTNSERVE_WHOLE_DK=0`` turns it off); measurements at the constant.

    Measured on an H100 (benchmarks/decode_sweep.py, 2026-11-21, bf16, d 64 and 128, bs 1/8,
    contexts 512/4096, inside CUDA graphs): 128-key tiles with 3 stages are within 7% of
    the best of 72 configurations in every case, and 16-26% faster than 64-key tiles with
    2 stages at batch 1 (SmolLM2 bs 1 ctx 512: 5.4 vs 6.3 µs; Llama-3-8B: 7.1 vs 8.4 µs).
    The guard ``max_shared_mem >= _BIG_SMEM`` dates from a Triton that kept 3 buffers of
    them (~192 KB at d 128); Triton 3.6 keeps one buffer of K and V at 3 or 4 stages (74 KB,
    228 registers: 2 programs per SM; offline sm_90a compile, benchmarks/NOTES.md).
    """
    wide = head_dim > 128 or dtype == torch.float32
    if not wide and not is_hip and max_shared_mem >= _BIG_SMEM:
        cap = 64
        block_h = max(16, min(cap, triton.next_power_of_2(group_size)))
        fp8_hopper = dtype in FP8_DTYPES and any(name in device_name for name in FP8_PAIRS_DEVICES)
        variant = fp8_tile_variant() if fp8_hopper else (None if dtype in FP8_DTYPES else bf16_tile_variant())
        if variant is not None:  # opt-in (FP8_ / BF16_TILE_VARIANTS), small and large batches alike
            block_n, stages, warps, maxnreg = variant
            return DecodeConfig(block_n=block_n, block_h=block_h, num_warps=warps, num_stages=stages,
                                v_pairs=fp8_hopper, maxnreg=maxnreg)
        if head_dim in WHOLE_DK_HEAD_SIZES and dtype not in FP8_DTYPES and env_flag(WHOLE_DK_ENV):
            block_n, stages, warps, maxnreg = WHOLE_DK_TILE
            return DecodeConfig(block_n=block_n, block_h=block_h, num_warps=warps, num_stages=stages,
                                maxnreg=maxnreg, whole_dk=True)
        programs = batch_size * num_kv_heads * _head_blocks(block_h, group_size)
        if _at_batch_tiles(programs, num_sms) and (fp8_hopper or dtype not in FP8_DTYPES):
            block_n, stages, warps, maxnreg = FP8_HOPPER_BATCH_TILE if fp8_hopper else BATCH_TILE
            return DecodeConfig(block_n=block_n, block_h=block_h, num_warps=warps, num_stages=stages,
                                v_pairs=fp8_hopper, maxnreg=maxnreg)
        if fp8_hopper:
            # V as int16 pairs (`FP8_HOPPER_TILE`: 128 keys / 5 stages since 2026-11-27; from
            # sessions 11-12 a 256-key / 3-stage tile, benchmarks/fp8_decode_sweep.py --pairs-ab,
            # benchmarks/NOTES.md), e4m3 pairs against the 128-key / 5-stage byte path below:
            # H200 bs 64 x 8K 325.6 -> 281.6 us, 8 x 32K 171.4 -> 145.2 us;
            # H100 bs 64 x 8K 403.0 -> 391.5 us, 8 x 32K 204.0 -> 201.1 us, 1 x 8K 14.6 -> 13.4 us.
            return DecodeConfig(block_n=FP8_HOPPER_TILE[0], block_h=block_h, num_warps=FP8_HOPPER_TILE[2],
                                num_stages=FP8_HOPPER_TILE[1], v_pairs=True)
        # other GPUs with the shared memory: fp8 tiles are half the bytes, 5 stages keep as much
        # in flight (H100 before session 12, e4m3, d 128, benchmarks/fp8_decode_sweep.py: bs 64
        # x 8K 430 -> 408 us, 8 x 32K 261 -> 244 us; 256-key byte tiles were slower)
        if dtype in FP8_DTYPES:
            return DecodeConfig(block_n=128, block_h=block_h, num_warps=4, num_stages=5)
        few = (head_dim == 128 and 0 < num_kv_heads <= FEW_KV_HEADS and env_flag(FEW_KV_HEADS_ENV)
               and any(name in device_name for name in FEW_KV_HEADS_DEVICES))
        return DecodeConfig(block_n=128, block_h=block_h, num_warps=4, num_stages=2 if few else 3)
    block_n = 32 if (wide or is_hip) else 64
    if head_dim > 256:
        block_n = 16
    # Even MHA (group 1) goes through tl.dot with 16 padded rows: the tensor-core work is
    # far below the memory time, and the dot path keeps ~105 registers and cp.async
    # pipelining on sm90, where the per-head reduction path (block_h=1) needs ~250
    # registers and is not pipelined.
    cap = 64 if head_dim <= 128 else (32 if head_dim <= 256 else 16)
    block_h = max(16, min(cap, triton.next_power_of_2(group_size)))
    num_warps = 4 if head_dim <= 256 else 8
    num_stages = 1 if is_hip else 2
    return DecodeConfig(block_n=block_n, block_h=block_h, num_warps=num_warps, num_stages=num_stages)


def _at_batch_tiles(programs: int, num_sms: int) -> bool:
    """Whether ``programs`` stage-1 programs at one split a request (requests x KV heads x
    head blocks) reach `BATCH_PROGRAMS_PER_SM` per SM of a device with ``num_sms`` (0:
    unknown, never): the batch tiles of `_tile_config` and stage 2's head blocks."""
    return num_sms > 0 and programs >= BATCH_PROGRAMS_PER_SM * num_sms


def _head_blocks(block_h: int, group: int) -> int:
    """Stage-1 programs per KV head: ``cdiv(group, block_h)`` query-head blocks (block_h
    below 16 is raised to 16 for ``tl.dot``; 1 for the per-head MHA kernel)."""
    if block_h == 1:
        return 1 if group == 1 else group
    return triton.cdiv(group, max(16, block_h))
