"""The start-up choice of the two-shot ceiling (`distributed.all_reduce_calibration`): the sizes
measured, the rule that picks the ceiling from the slowest rank's times, when the measurement
runs at all, and the whole `calibrate` on fake kernels. The timing on real GPUs is in
tests/gpu/test_custom_all_reduce_gpu.py."""

import pytest
import torch

from attnserve.distributed import all_reduce_calibration as cal
from attnserve.distributed.custom_all_reduce import TWO_SHOT_MAX_ENV, default_config

MIB = 1 << 20


def test_candidate_sizes_double_up_to_the_limit():
    assert cal.candidate_sizes(16 * MIB) == [32 * MIB, 64 * MIB]
    assert cal.candidate_sizes(4 * MIB) == [8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB]
    assert cal.candidate_sizes(64 * MIB) == []  # the default already reaches the limit
    assert cal.candidate_sizes(3, max_bytes=20) == [6, 12]
    with pytest.raises(ValueError, match="> 0"):
        cal.candidate_sizes(0)


@pytest.mark.parametrize("two,nccl,want", [
    ([185.0, 355.3], [193.5, 341.7], 16 * MIB),   # like four H200s: 0.956 at 32 MiB, NCCL ahead at 64
    ([180.0, 360.0], [560.0, 1060.0], 64 * MIB),  # a host whose NCCL runs at a third of the rate
    ([90.0, 400.0], [100.0, 1000.0], 64 * MIB),   # exactly the margin (0.9 <= 0.95) then far ahead
    ([96.0, 100.0], [100.0, 1000.0], 16 * MIB),   # 0.96 > 0.95 at 32 MiB: stop there, whatever follows
    ([100.0, 100.0], [200.0, 100.0], 32 * MIB),   # ahead at 32, not at 64
])
def test_pick_two_shot_ceiling(two, nccl, want):
    assert cal.pick_two_shot_ceiling(16 * MIB, [32 * MIB, 64 * MIB], two, nccl) == want


def test_pick_checks_its_inputs():
    with pytest.raises(ValueError, match="2 sizes, 1 two-shot"):
        cal.pick_two_shot_ceiling(1, [2, 4], [1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="ascend"):
        cal.pick_two_shot_ceiling(1, [4, 2], [1.0, 1.0], [2.0, 2.0])
    assert cal.pick_two_shot_ceiling(7, [], [], []) == 7


def test_calibration_wanted(monkeypatch):
    monkeypatch.delenv(cal.CALIBRATE_ENV, raising=False)
    monkeypatch.delenv(TWO_SHOT_MAX_ENV, raising=False)
    assert cal.calibration_wanted(2) and cal.calibration_wanted(4) and cal.calibration_wanted(8)
    assert not cal.calibration_wanted(3)  # no two-shot kernel for 3 ranks
    assert not cal.calibration_wanted(1)
    monkeypatch.setenv(TWO_SHOT_MAX_ENV, "32")  # a fixed ceiling: nothing to measure
    assert not cal.calibration_wanted(4)
    monkeypatch.delenv(TWO_SHOT_MAX_ENV)
    monkeypatch.setenv(cal.CALIBRATE_ENV, "0")
    assert not cal.calibration_wanted(4)
    for world in (2, 4, 8):  # the rule only ever raises the defaults
        assert default_config(world).two_shot_max_bytes < cal.CALIBRATION_MAX_BYTES


def test_calibrate_takes_the_slowest_rank(monkeypatch):
    """`calibrate` on fake timings: rank 1's NCCL is slow at 32 MiB only, rank 0's two-shot is
    slow at 64 MiB; the gathered maxima decide, and every rank gets the same answer."""
    sizes = cal.candidate_sizes(16 * MIB)
    per_rank = [[(100.0, 300.0), (580.0, 600.0)],   # rank 0: (two-shot, NCCL) per size
                [(110.0, 320.0), (200.0, 520.0)]]   # rank 1

    def fake_gather(out, obj, group=None):
        out[:] = [None, None] if obj is None else per_rank  # the message's agreement, then the times

    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", fake_gather)
    monkeypatch.setattr(cal, "_time_calls", lambda fn, x, align, calls: 1.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    class FakeCustom:
        buffer = torch.empty(0)
        rank = 0

        def two_shot_in_place(self, x):
            raise AssertionError("timed through _time_calls")

    two, nccl = cal.measure(FakeCustom(), None, None, sizes)
    assert two == [110.0, 580.0] and nccl == [320.0, 600.0]
    got = cal.calibrate(FakeCustom(), None, None, 16 * MIB)
    assert got.sizes == sizes and got.default_ceiling == 16 * MIB
    assert got.ceiling == 32 * MIB  # 110 <= 0.95 x 320; 580 > 0.95 x 600
    assert cal.calibrate(FakeCustom(), None, None, 64 * MIB) is None  # nothing above the default


def test_a_rank_without_memory_for_the_message_fails_every_rank_before_any_timing(monkeypatch):
    """When one rank cannot allocate the test message, `measure` raises on every rank (the
    agreement over the CPU group) before any collective on the devices is timed."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj, "OutOfMemoryError: 64 MiB"]))
    timed = []
    monkeypatch.setattr(cal, "_time_calls", lambda fn, x, align, calls: timed.append(x.numel()) or 1.0)

    class FakeCustom:
        buffer = torch.empty(0)
        rank = 0

    with pytest.raises(RuntimeError,
                       match=r"could not allocate the 64 MiB calibration message \(rank 1: OutOfMemoryError"):
        cal.measure(FakeCustom(), None, None, cal.candidate_sizes(16 * MIB))
    assert timed == []
