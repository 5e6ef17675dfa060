"""How many split-K partitions each request of a decode batch gets, and the split grid.

Stage 1 of `decode_attention.decode_attention_fwd` runs on the grid ``(bs, head_programs,
G)``; program ``(b, h, z)`` computes splits ``z, z + G, ...`` of request ``b`` while they are
below the request's split count ``num_kv_splits[b]``; the others exit at once. So ``G``
(`decode_grid_splits`, host-known, CUDA-graph capturable) bounds the parallelism of one
request, and the per-request counts (`compute_num_kv_splits`, computed on the device from
the lengths, no host synchronisation) decide which programs work.

Why the counts look at the whole batch: at a few resident stage-1 programs per SM (two
for the 3-stage 128-key bf16 tile: 228 registers, 74 KB of shared memory with Triton 3.6
on an H100, not the ~192 KB once written here), the kernel's time is the busiest SM's
list of programs. With equal requests that is a matter of whole waves (a
4.4-wave grid costs a fifth wave; issue 21, `benchmarks/NOTES.md`). With ragged lengths the
programs differ in size, and a long request left in one split finishes alone at the end
while the other SMs idle, so long requests are split more than short ones, and the grid
leaves room for that (16 waves, >= 3 programs a request). Programs without a split cost
~0.1 us of an SM each, and nothing while they fill the last wave's idle SMs.

Measured on an H100 (`benchmarks/decode_ragged.py`, Hq 32, Hkv 8, D 128, bf16, page 1,
CUDA graphs, 2026-11-26, `benchmarks/results/h100-decode-ragged*-2026-11-26.json`; us,
before -> now, SGLang's Triton decode as its backend runs it in brackets): 64 requests
uniform in [128, 8192] 452 -> 407 (479), 256 such 1546 -> 1516 (1702), log-normal lengths
(median 1K, 128..32K) 64: 209 -> 190 (234), 256: 669 -> 599 (671); equal lengths 64 x 1K /
64 x 8K / 8 x 32K / 256 x 2K unchanged within 0.1%. The 64 x 1K batch is what bounds the
grid: at 9 programs a request (4,096 without work) it costs 3 us more, at 5 (2,048) nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Split-count policy constants (tuning, not state).
_SPLIT_WAVES = 4  # whole-wave budget of stage-1 programs for equal-length batches
_GRID_WAVES = 16  # the split grid axis holds at least this many waves of programs ...
_MIN_GRID_SPLITS = 3  # ... and at least this many programs per request
_MIN_SPLIT_TOKENS = 128  # never cut a request into splits shorter than this (non-deterministic mode)
_RAGGED_FACTOR = 1.0  # ragged batches: one split per this multiple of the mean length (see below)
# A batch is ragged when its longest request is >= 5/4 of the mean (SGLang's Triton backend
# treats lengths within 0.8x of the longest as equal, `get_num_kv_splits_triton`).
_RAGGED_NUM = tl.constexpr(5)
_RAGGED_DEN = tl.constexpr(4)
#: environment override of `_RAGGED_FACTOR` for the triton backend (`ragged_factor_from_env`)
RAGGED_FACTOR_ENV = "ATTNSERVE_DECODE_RAGGED_FACTOR"
#: small batches (`compute_num_kv_splits`'s ``small_split_tokens``): keys per split when every
#: request's one-tile splits fit in one wave of stage-1 programs (the 16-bit tile of
#: `decode_tuning.decode_config` on an H100 / H200; fp8 tiles round splits up to theirs)
SMALL_SPLIT_TOKENS = 128


@triton.jit
def _split_bounds(kv_len, num_splits, max_splits, ALIGN: tl.constexpr):
    """Split length (a multiple of ALIGN) and number of non-empty splits; stage 1 and stage
    2 of `decode_attention` both use this so that they agree on the split boundaries.
    ``num_splits`` is clamped to ``1..max_splits`` so a bad value can never write past the
    scratch buffers."""
    num_splits = tl.minimum(tl.maximum(num_splits, 1), max_splits)
    per = tl.cdiv(kv_len, num_splits)
    per = tl.maximum(tl.cdiv(per, ALIGN) * ALIGN, ALIGN)
    return per, tl.cdiv(kv_len, per)


def ragged_factor_from_env() -> float:
    """`compute_num_kv_splits`'s ``ragged_factor`` for the triton backend: `_RAGGED_FACTOR`,
    or the number in ``ATTNSERVE_DECODE_RAGGED_FACTOR`` (0 turns the ragged rule off; read
    when a backend is built, so an engine A/B needs one process per value).

    Raises:
        ValueError: the variable is not a number in 0..64.
    """
    from attnserve.env_options import env_float

    return env_float(RAGGED_FACTOR_ENV, _RAGGED_FACTOR, 0.0, 64.0, "0 = no ragged rule")


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 off CUDA (the interpreter's pretend GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def decode_grid_splits(bs: int, head_programs: int, max_kv_splits: int, num_sms: int,
                       waves: int = _GRID_WAVES) -> int:
    """Size ``G`` of stage 1's split grid axis: ``max(cdiv(num_sms * waves, bs *
    head_programs), 3)`` (enough programs for ``waves`` waves, and a long request of a big
    batch can still be cut in 3), clamped to ``1..max_kv_splits``. Programs loop over splits
    ``pid, pid + G, ...``, so a smaller axis only serialises work, it never changes results
    (deterministic mode relies on this). Host ints in, host int out."""
    want = max(triton.cdiv(num_sms * waves, max(1, bs * head_programs)), _MIN_GRID_SPLITS)
    return max(1, min(max_kv_splits, want))


@triton.jit
def _num_kv_splits_kernel(
    seq_lens_ptr,
    out_ptr,
    bs,
    split_cap,
    target_units,
    min_split_tokens,
    split_tile_size,
    ragged_factor,
    small_split_tokens,
    small_units,
    DETERMINISTIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    if DETERMINISTIC:
        for base in range(0, bs, BLOCK):
            m = base + offs < bs
            n = tl.load(seq_lens_ptr + base + offs, mask=m, other=0).to(tl.int32)
            s = tl.minimum(tl.maximum(tl.cdiv(n, split_tile_size), 1), split_cap)
            tl.store(out_ptr + base + offs, s, mask=m)
    else:
        total = tl.zeros([BLOCK], dtype=tl.int64)
        longest = tl.zeros([BLOCK], dtype=tl.int32)
        tiles = tl.zeros([BLOCK], dtype=tl.int64)
        small_tok = tl.maximum(small_split_tokens, 1)
        for base in range(0, bs, BLOCK):
            m = base + offs < bs
            n = tl.load(seq_lens_ptr + base + offs, mask=m, other=0).to(tl.int32)
            total += n.to(tl.int64)
            longest = tl.maximum(longest, n)
            tiles += tl.maximum(tl.cdiv(n, small_tok), 1).to(tl.int64) * m.to(tl.int64)
        tokens = tl.sum(total, 0)
        n_max = tl.max(longest, 0)
        # Small batch: every request cut into `small_split_tokens` splits still fits in
        # `small_units` (request, split) programs (one wave), so each program takes one tile.
        small = (small_split_tokens > 0) & (tl.sum(tiles, 0) <= small_units)
        # Whole waves: about `tokens / target_units` tokens a split, rounded down so that an
        # equal-length batch stays within `target_units` splits (a rounded-up count adds up
        # to one split per request, i.e. a partial extra wave).
        per = tl.maximum(tl.cdiv(tokens, target_units), min_split_tokens).to(tl.int32)
        # Ragged: one split per `ragged_factor` x the mean length, rounded to nearest.
        ragged = (ragged_factor > 0) & (n_max.to(tl.int64) * bs * _RAGGED_DEN > tokens * _RAGGED_NUM)
        mean_part = (tokens.to(tl.float32) / bs * ragged_factor).to(tl.int32)
        rag_len = tl.maximum(mean_part, min_split_tokens)
        for base in range(0, bs, BLOCK):
            m = base + offs < bs
            n = tl.load(seq_lens_ptr + base + offs, mask=m, other=0).to(tl.int32)
            s = n // per
            s = tl.where(ragged, tl.maximum(s, (2 * n + rag_len) // (2 * rag_len)), s)
            s = tl.where(small, tl.cdiv(n, small_tok), s)
            s = tl.minimum(tl.maximum(s, 1), split_cap)
            tl.store(out_ptr + base + offs, s, mask=m)


def compute_num_kv_splits(
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    num_sms: int,
    num_kv_heads: int,
    deterministic: bool = False,
    split_tile_size: int = 256,
    *,
    waves: int = _SPLIT_WAVES,
    min_split_tokens: int = _MIN_SPLIT_TOKENS,
    ragged_factor: float = _RAGGED_FACTOR,
    grid_waves: int = _GRID_WAVES,
    small_split_tokens: int = 0,
) -> torch.Tensor:
    """Per-request split counts for `decode_attention_fwd`, computed on the device.

    Default (throughput) mode, with ``T = sum(seq_lens)``, ``U = max(1, num_sms * waves //
    num_kv_heads)`` (request, split) units and the split grid ``G = decode_grid_splits(bs,
    num_kv_heads, max_kv_splits, num_sms, grid_waves)``:

    * whole waves: ``f[i] = seq_lens[i] // t`` with ``t = max(min_split_tokens, cdiv(T, U))``.
      Rounding down keeps an equal-length batch within ``waves`` waves of stage-1 programs:
      at 8 x 32K on an H100 (U = 66, t = 3,972) a rounded-up count gives 9 splits, 576
      programs = 4.4 waves, while 8 splits are ~7% (bf16) to ~16% (fp8) faster (issue 21).
    * ragged batches (the longest request is >= 5/4 of the mean ``T / bs``): also
      ``r[i] = round(seq_lens[i] / (ragged_factor * T / bs))`` (the unit at least
      ``min_split_tokens``), so requests longer than the mean get proportionally more
      splits and short ones one; otherwise ``r[i] = 0``. (Under the whole-wave rule alone a
      request of ``1.99 t`` tokens stays one program twice the size of the others and the
      batch waits for it, issue 33.) The factor is 1.0 (`_RAGGED_FACTOR`): at 0.5, the first
      choice (it beat 0.25 and 1.0 on a 4-wave grid), every request of the mixed workload's
      decode batches (`benchmarks/decode_ragged.py`'s ``mixed<step>`` cases: 95-255 requests of
      200-1,722 keys) got ~2 splits whose program overhead cost 1-3.5%; at 1.0 on the 16-wave
      grid they get one, and only requests well above the mean are cut. One H100, µs at 0.5 /
      1.0 / 1.5: mixed100 256.1 / 247.2 / 246.2, mixed400 265.4 / 259.4 / 259.4, mixed700
      184.0 / 181.8 / 181.9, tail256 592.5 / 583.6 / 580.6, ragged256 1510.0 / 1500.2 / 1529.5,
      tail64 191.3 / 190.0 / 185.8, ragged64 408.9 / 413.9 / 450.4, equal lengths within 0.1%
      (benchmarks/results/h100-80gb-hbm3-decode-ragged-factor-sweep-2026-11-28.json). 1.5 loses
      10% on 64 long requests (one program each, 1.3 waves).
    * ``num_kv_splits[i] = clamp(max(f[i], r[i]), 1, min(G, max_kv_splits))``: never more
      splits than stage 1 has programs for the request (more would only be serialised), so
      every split is its own program and ``sum(num_kv_splits) <= bs * G``, the grid's
      whole rows (``>= grid_waves`` waves). Equal-length batches get exactly ``f`` (``G >=
      U / bs`` when ``grid_waves >= waves``) and so the whole-wave grid of stage 1.
    * small batches (``small_split_tokens = t_s > 0``, off by default; the triton backend
      passes `SMALL_SPLIT_TOKENS` unless ``ATTNSERVE_DECODE_SMALL_BATCH=0``): when
      ``sum(max(cdiv(seq_lens[i], t_s), 1)) <= num_sms // num_kv_heads``, i.e. one-tile
      splits for every request fit in one wave of stage-1 programs, ``num_kv_splits[i] =
      clamp(cdiv(seq_lens[i], t_s), 1, min(G, max_kv_splits))`` instead. At batch 1 the
      rules above give 576 keys 4 splits, which stage 1's tile alignment (`_split_bounds`,
      128-key tiles) turns into 3 splits of 256, 256 and 64 keys, two tiles in a row for
      most programs of a kernel that leaves 100+ SMs idle; one tile a program halves the
      bytes each SM must stream at the cost of a wider merge (`decode_merge`). The
      decision is made on the device every step, so it is CUDA-graph safe.

    The counts grow with the length (``f`` and ``r`` both do), are >= 1 and <=
    ``max_kv_splits``; the result depends on the whole batch.

    Deterministic mode: ``num_kv_splits[i] = clamp(cdiv(seq_lens[i], split_tile_size), 1,
    max_kv_splits)`` depends on the request alone, so its output is bitwise identical in
    any batch (split boundaries and merge order depend only on its length). Choose
    ``max_kv_splits >= cdiv(max_context_len, split_tile_size)``: otherwise requests longer
    than ``max_kv_splits * split_tile_size`` are cut into ``max_kv_splits`` longer splits;
    results stay batch-invariant, but their split boundaries (and so their rounding) then
    differ from those under a larger ``max_kv_splits``, and long requests get less
    parallelism.

    Args:
        seq_lens: int32/int64 ``[bs]`` keys per request (after any window trimming).
        num_kv_splits: int32 ``[>= bs]`` output.
        max_kv_splits: host int, the scratch capacity of `decode_attention_fwd`.
        num_sms: streaming multiprocessors of the GPU (host int).
        num_kv_heads: stage-1 head programs per request (KV heads on this rank).
        deterministic: batch-invariant split counts (see above).
        split_tile_size: tokens per split in deterministic mode.
        waves / min_split_tokens / ragged_factor / grid_waves: tuning of the default mode
            (``ragged_factor <= 0`` turns the ragged term off; ``grid_waves`` must match the
            ``waves`` of the `decode_grid_splits` that sizes the launch, else only speed
            changes).
        small_split_tokens: keys per split of the small-batch rule (0: off; ignored in
            deterministic mode, whose counts must not depend on the batch).

    Returns:
        ``num_kv_splits``.

    Raises:
        ValueError: on a bad ``seq_lens`` / ``num_kv_splits`` tensor or a count below 1.
    """
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be 1-D int32/int64, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    bs = seq_lens.shape[0]
    if num_kv_splits.dim() != 1 or num_kv_splits.shape[0] < bs or num_kv_splits.dtype != torch.int32:
        raise ValueError(f"num_kv_splits must be int32 [>= {bs}], got {tuple(num_kv_splits.shape)} {num_kv_splits.dtype}")
    if max_kv_splits < 1 or num_sms < 1 or num_kv_heads < 1 or split_tile_size < 1 or grid_waves < 1:
        raise ValueError("max_kv_splits, num_sms, num_kv_heads, split_tile_size and grid_waves must be >= 1")
    if small_split_tokens < 0:
        raise ValueError(f"small_split_tokens must be >= 0 (0: off), got {small_split_tokens}")
    if bs == 0:
        return num_kv_splits
    target_units = max(1, (num_sms * waves) // num_kv_heads)
    if deterministic:
        split_cap = int(max_kv_splits)
    else:
        split_cap = decode_grid_splits(bs, num_kv_heads, max_kv_splits, num_sms, grid_waves)
    _num_kv_splits_kernel[(1,)](
        seq_lens,
        num_kv_splits,
        bs,
        split_cap,
        target_units,
        int(min_split_tokens),
        int(split_tile_size),
        float(ragged_factor),
        int(small_split_tokens),
        max(1, num_sms // num_kv_heads),
        DETERMINISTIC=bool(deterministic),
        BLOCK=min(1024, max(16, triton.next_power_of_2(bs))),
    )
    return num_kv_splits
