"""The two-shot ceiling of the custom all-reduce, chosen at start-up by measurement.

`custom_all_reduce.default_config` carries thresholds measured on one host of each world size.
Hosts of the same kind differ: on four H100s (2026-11-27) NCCL took 1.06 ms for a 64 MiB
bfloat16 all-reduce, on four H200s 0.33 ms, while the symmetric-memory two-shot ran at the
same rate on both (``benchmarks/NOTES.md``). A tensor-parallel prefill of 8,192 tokens on a
hidden size of 4,096 all-reduces exactly such 64 MiB messages, twice a layer, so which of the
two carries them decides a quarter to half of that prefill on the slower host.

So the engine measures, once per group before any CUDA graph capture: for each size from twice
the default ceiling up to `CALIBRATION_MAX_BYTES` (doubling), the two-shot kernel and NCCL,
eagerly as a prefill launches them (`measure`); each rank's times are gathered and the slowest
rank's time per size counts. `pick_two_shot_ceiling` then raises the ceiling over every size,
from the smallest up, where two-shot took at most `WIN_MARGIN` of NCCL's time, and stops at the
first size where it did not. The symmetric buffer is allocated for `CALIBRATION_MAX_BYTES` so
that any outcome fits (48 MiB more than the default per GPU at 4 ranks).

``ATTNSERVE_ALLREDUCE_CALIBRATE=0`` keeps `default_config`; ``ATTNSERVE_TWO_SHOT_MAX_MB`` fixes
the ceiling and skips the measurement. (The issue this serves: issue 38, "NCCL above a size
threshold chosen by measurement".)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

#: ``ATTNSERVE_ALLREDUCE_CALIBRATE=0``: no start-up measurement (the measured defaults)
CALIBRATE_ENV = "ATTNSERVE_ALLREDUCE_CALIBRATE"
#: the largest message measured: a prefill chunk of 8,192 tokens x hidden 4,096 in bfloat16
#: (the default chunk on 80 GB cards, `engine.memory_sizing.GPU_MEMORY_TIERS`)
CALIBRATION_MAX_BYTES = 64 << 20
#: two-shot takes a size when its time is at most this share of NCCL's (the tables of
#: ``benchmarks/allreduce_bench.py`` repeat within ~5% from run to run)
WIN_MARGIN = 0.95
#: timed calls per size and algorithm (after one untimed call); ~1 ms each at 64 MiB
CALIBRATION_CALLS = 5


@dataclass(frozen=True)
class Calibration:
    """What the start-up measurement saw and chose (logged; `CustomAllReduce.calibration`).

    Attributes:
        sizes: message bytes measured (bfloat16 messages).
        two_shot_us / nccl_us: µs per call at each size, the slowest rank's.
        default_ceiling / ceiling: the two-shot ceiling before and after, in bytes.
    """

    sizes: List[int]
    two_shot_us: List[float]
    nccl_us: List[float]
    default_ceiling: int
    ceiling: int


def calibration_wanted(world_size: int) -> bool:
    """Whether `custom_all_reduce.init_custom_all_reduce` measures the two-shot ceiling: on
    unless ``ATTNSERVE_ALLREDUCE_CALIBRATE=0`` or ``ATTNSERVE_TWO_SHOT_MAX_MB`` is set, for the
    world sizes the two-shot kernel is built for, where the default ceiling is below
    `CALIBRATION_MAX_BYTES`."""
    import os

    from attnserve.distributed.custom_all_reduce import TWO_SHOT_MAX_ENV, TWO_SHOT_WORLD_SIZES, default_config
    from attnserve.env_options import env_flag

    if not env_flag(CALIBRATE_ENV) or os.environ.get(TWO_SHOT_MAX_ENV, "").strip():
        return False
    return world_size in TWO_SHOT_WORLD_SIZES and default_config(world_size).two_shot_max_bytes < CALIBRATION_MAX_BYTES


def candidate_sizes(default_ceiling: int, max_bytes: int = CALIBRATION_MAX_BYTES) -> List[int]:
    """``2 * default_ceiling``, ``4 * default_ceiling``, ... up to ``max_bytes`` (none when the
    default already reaches it).

    Raises:
        ValueError: ``default_ceiling`` is not positive.
    """
    if default_ceiling <= 0:
        raise ValueError(f"default_ceiling must be > 0, got {default_ceiling}")
    sizes, s = [], 2 * default_ceiling
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    return sizes


def pick_two_shot_ceiling(default_ceiling: int, sizes: Sequence[int], two_shot_us: Sequence[float],
                          nccl_us: Sequence[float], margin: float = WIN_MARGIN) -> int:
    """The largest size of the leading run of ``sizes`` (ascending) at which two-shot took at
    most ``margin`` of NCCL's time; ``default_ceiling`` when the first size already fails.

    Raises:
        ValueError: the three sequences differ in length, or ``sizes`` is not ascending.
    """
    if not len(sizes) == len(two_shot_us) == len(nccl_us):
        raise ValueError(f"{len(sizes)} sizes, {len(two_shot_us)} two-shot and {len(nccl_us)} NCCL times")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"sizes must ascend, got {list(sizes)}")
    ceiling = default_ceiling
    for size, t2, tn in zip(sizes, two_shot_us, nccl_us):
        if t2 > margin * tn:
            break
        ceiling = size
    return ceiling


def _time_calls(fn, x: torch.Tensor, align, calls: int) -> float:
    """µs per call of ``calls`` back-to-back ``fn(x)`` on the current stream. The start event is
    recorded behind ``align()`` (a tiny NCCL all-reduce): it completes once every rank has
    reached it, so the ranks' host skew stays out of the timing."""
    fn(x)  # untimed: first-use costs
    align()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def agreed_message(nbytes: int, device: torch.device, cpu_group: Any, rank: int) -> torch.Tensor:
    """A bfloat16 message of ``nbytes`` (ones) on ``device``, returned once every rank of
    ``cpu_group`` has allocated its own: the ranks agree (`custom_all_reduce.agree`) before any
    collective on the devices, so an allocation that fails on one rank raises on all of them
    instead of leaving the others waiting in an NCCL call that rank never makes.

    Raises:
        RuntimeError: on every rank, naming the first rank that could not allocate it.
    """
    from attnserve.distributed.custom_all_reduce import agree

    try:
        x, err = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device), None
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        x, err = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    why = agree(err, cpu_group, rank)
    if why is not None:
        raise RuntimeError(f"could not allocate the {nbytes >> 20} MiB calibration message ({why})")
    return x


def measure(custom: Any, device_group: Any, cpu_group: Any, sizes: Sequence[int],
            calls: int = CALIBRATION_CALLS) -> tuple:
    """Time two-shot and NCCL on bfloat16 messages of ``sizes`` bytes (views of one message
    of the largest size, `agreed_message`); a collective of the group (every rank calls it
    with the same sizes).

    Returns:
        ``(two_shot_us, nccl_us)``: per size, the slowest rank's µs per call.

    Raises:
        RuntimeError: on every rank, when any rank could not allocate the message.
    """
    import torch.distributed as dist

    device = custom.buffer.device
    tiny = torch.zeros(1, device=device)

    def align():
        dist.all_reduce(tiny, group=device_group)

    def nccl(x):
        dist.all_reduce(x, group=device_group)

    message = agreed_message(max(sizes), device, cpu_group, custom.rank)
    mine = []
    for size in sizes:
        x = message[: size // 2]
        mine.append((_time_calls(custom.two_shot_in_place, x, align, calls), _time_calls(nccl, x, align, calls)))
    del x, message
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the test messages' blocks go back before the KV pool is sized from free memory
    every: list = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(every, mine, group=cpu_group)
    two = [max(rank_times[i][0] for rank_times in every) for i in range(len(sizes))]
    nccl_us = [max(rank_times[i][1] for rank_times in every) for i in range(len(sizes))]
    return two, nccl_us


def calibrate(custom: Any, device_group: Any, cpu_group: Any, default_ceiling: int,
              max_bytes: int = CALIBRATION_MAX_BYTES) -> Optional[Calibration]:
    """Measure (`measure`) and choose (`pick_two_shot_ceiling`) the two-shot ceiling of
    ``custom``, whose buffer must hold ``max_bytes``; None when there is nothing to measure
    (the default already reaches ``max_bytes``). A collective of the group; every rank
    computes the same choice from the same gathered times."""
    sizes = candidate_sizes(default_ceiling, max_bytes)
    if not sizes:
        return None
    two, nccl_us = measure(custom, device_group, cpu_group, sizes)
    return Calibration(sizes=sizes, two_shot_us=two, nccl_us=nccl_us, default_ceiling=default_ceiling,
                       ceiling=pick_two_shot_ceiling(default_ceiling, sizes, two, nccl_us))
