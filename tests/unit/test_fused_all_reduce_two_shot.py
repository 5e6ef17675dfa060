"""Two-shot fused all-reduce + add + RMSNorm under the Triton interpreter.

The interpreter runs one simulated rank, and within it one program, at a time, and the
kernel waits twice for every rank, so each call is run as its stages (the kernel's ``STAGE``):
every rank's scatter, then every rank's reduction and all-gather, then every rank's norm. The
flags, the arrival count and the epoch are the kernel's own (nothing staged by the test). Over
back-to-back calls of changing sizes (1, 3, 8 and 13 rows: fewer rows than ranks, uneven
splits, empty pieces) and dtypes, at two and four ranks, each rank's output and in-place
residual must equal the pull kernel's bit for bit (each rank with its own residual), and be
within a bound of a float64 reference; both halves are used in turn. GPU runs:
tests/gpu/test_fused_all_reduce_two_shot_gpu.py.
"""

import os

import pytest
import torch

from attnserve.distributed import fused_all_reduce as far
from attnserve.distributed import fused_all_reduce_two_shot as ts
from attnserve.distributed.fused_all_reduce import FusedRegion
from attnserve.distributed.fused_all_reduce_two_shot import TwoShotRegion
from test_fused_all_reduce_push import EPS as PUSH_EPS, _pull as push_pull

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
EPS = PUSH_EPS  # the epsilon the shared pull reference uses
HIDDEN = 24  # BLOCK 32: the norm's masked tail is exercised
MAX_ROWS = 13


def _pull(world, xs, residual, w, offset):
    """The pull kernel's (out, residual) for these partial sums (`test_fused_all_reduce_push._pull`)."""
    return push_pull(world, xs, residual, w, offset, MAX_ROWS * HIDDEN * 4)


def _float64(xs, residual, w, offset):
    s = sum(x.double() for x in xs) + residual.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * (w.double() + offset), s


# (dtype, rows, weight offset): back to back, both halves twice, sizes up and down
CALLS = [(torch.bfloat16, 13, 0.0), (torch.float32, 3, 1.0), (torch.bfloat16, 1, 0.0), (torch.float32, 8, 0.0),
         (torch.float32, 13, 0.0), (torch.bfloat16, 8, 0.0), (torch.bfloat16, 3, 0.0)]


@interpreter
@pytest.mark.parametrize("world", [2, 4])
def test_two_shot_matches_pull_over_back_to_back_calls(monkeypatch, world):
    monkeypatch.setattr(far, "MAX_PROGRAMS", 3)  # chunks and rows strided over programs
    region = TwoShotRegion.after(1000, MAX_ROWS * HIDDEN * 4, world)
    bufs = [torch.zeros(region.end, dtype=torch.uint8) for _ in range(world)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    counters = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    gen = torch.Generator().manual_seed(world)
    for epoch, (dtype, rows, offset) in enumerate(CALLS, start=1):
        xs = [(torch.randn(rows, HIDDEN, generator=gen) * 4).to(dtype) for _ in range(world)]
        # each rank its own residual: the kernel adds the own one, as the pull kernel does
        residuals = [torch.randn(rows, HIDDEN, generator=gen).to(dtype) for _ in range(world)]
        w = torch.randn(HIDDEN, generator=gen).to(dtype)
        ress = [r.clone() for r in residuals]
        x_in = [x.clone() for x in xs]
        args = lambda r: (x_in[r], ress[r], w, EPS, offset, ptrs, counters[r], r, region)  # noqa: E731
        for r in range(world):
            ts._launch(*args(r), stage=1, chunk=16)
        for r in range(world):
            ts._launch(*args(r), stage=2, chunk=16)
        outs = [ts._launch(*args(r), stage=3, chunk=16) for r in range(world)]
        tol = 1e-5 if dtype == torch.float32 else 4 * 2.0 ** -7  # interpreter bf16: truncation per add
        for r in range(world):
            want_out, want_res = _pull(world, xs, residuals[r], w, offset)
            assert torch.equal(outs[r], want_out), (epoch, r)
            assert torch.equal(ress[r], want_res), (epoch, r)
            assert torch.equal(x_in[r], xs[r])  # the partial sums are read, not written
            ref_out, ref_res = _float64(xs, residuals[r], w, offset)
            scale = 1 + ref_res.abs()
            assert float(((ress[r].double() - ref_res).abs() / scale).max()) < world * tol, (epoch, r)
            assert float(((outs[r].double() - ref_out).abs() / (1 + ref_out.abs())).max()) < (world + 2) * tol
            assert counters[r].tolist() == [epoch, 0], (epoch, r)
        for b in bufs:
            flags = b[region.flags_offset:region.flags_offset + world * 8].view(torch.int64)
            assert flags.tolist() == [2 * epoch] * world
            # this call's sum sits in half epoch % 2 of every rank's gather area
            start = region.gather_offset + (epoch % 2) * region.slot_bytes
            gathered = b[start:start + rows * HIDDEN * dtype.itemsize].view(dtype).view(rows, HIDDEN)
            assert torch.equal(gathered, _pull(world, xs, torch.zeros_like(xs[0]), w, offset)[1])


def test_region_layout_and_pieces():
    region = TwoShotRegion.after(1000, 1000, 4)
    assert region.offset == 1024 and region.slot_bytes == 1024
    assert region.gather_offset == region.offset + 2 * 4 * 1024
    assert region.flags_offset == region.gather_offset + 2 * 1024 and region.end == region.flags_offset + 256
    assert ts.piece_elements(13 * 24, 4) == 80  # 78 -> 80: 16-element pieces; the last is short (72)
    assert ts.piece_elements(24, 4) == 16  # one row over four ranks: ranks 2 and 3 own nothing
    assert ts.piece_elements(64 * 4096, 4) == 64 * 1024


def test_two_shot_min_bytes_and_selection():
    assert ts.two_shot_min_bytes(4, {}) == ts.DEFAULT_MIN_BYTES
    assert ts.two_shot_min_bytes(2, {}) == ts.NEVER  # same bytes as one-shot at two ranks
    assert ts.two_shot_min_bytes(2, {ts.TWO_SHOT_MIN_ENV: "64"}) == 64 << 10
    assert ts.two_shot_min_bytes(8, {ts.TWO_SHOT_MIN_ENV: "0"}) == 0
    for bad in ("-1", "lots"):
        with pytest.raises(ValueError, match=ts.TWO_SHOT_MIN_ENV):
            ts.two_shot_min_bytes(4, {ts.TWO_SHOT_MIN_ENV: bad})
    region = TwoShotRegion.after(0, 1 << 20, 4, min_bytes=64 << 10)
    assert region.takes(torch.zeros(8, 4096, dtype=torch.bfloat16))  # 64 KB
    assert not region.takes(torch.zeros(7, 4096, dtype=torch.bfloat16))


def test_two_shot_refuses_what_the_pull_kernel_refuses():
    region = TwoShotRegion.after(0, 1024, 2)
    x, w = torch.zeros(4, 64), torch.ones(64)
    assert ts.two_shot_unsupported_reason(x, x.clone(), w, region) is None
    assert "bytes" in ts.two_shot_unsupported_reason(torch.zeros(8, 64), torch.zeros(8, 64), w, region)
    assert "dtypes" in ts.two_shot_unsupported_reason(x.half(), x.half(), w, region)
    ptrs = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="counters must be int64"):
        ts.fused_all_reduce_add_rmsnorm_two_shot(x, x.clone(), w, 1e-6, 0.0, ptrs, torch.zeros(2), 0, region)
    with pytest.raises(ValueError, match="fused_all_reduce_add_rmsnorm_two_shot"):
        ts.fused_all_reduce_add_rmsnorm_two_shot(x.half(), x.half(), w, 1e-6, 0.0, ptrs,
                                                 torch.zeros(2, dtype=torch.int64), 0, region)


def test_custom_all_reduce_routes_large_messages_to_two_shot_in_twoshot_mode(monkeypatch):
    """`CustomAllReduce.fused_all_reduce_add_rmsnorm` in twoshot mode: messages of at least
    ``min_bytes`` (within the one-shot range) go to the two-shot kernel with its counters
    ``[2:4]``, smaller ones to the pull kernel with the whole counters; larger than one-shot: None."""
    from attnserve.distributed import fused_all_reduce_push as fp
    from attnserve.distributed.custom_all_reduce import FUSED, CustomAllReduce, CustomAllReduceConfig
    from attnserve.distributed.fused_all_reduce import FusedAllReduce

    assert fp.fusion_mode_from_env({fp.FUSION_MODE_ENV: "TwoShot"}) == "twoshot"
    cfg = CustomAllReduceConfig(one_shot_max_bytes=2048, two_shot_max_bytes=8192)
    region = FusedRegion.after(cfg.buffer_bytes, cfg.one_shot_max_bytes, 4)
    two = TwoShotRegion.after(region.end, cfg.one_shot_max_bytes, 4, min_bytes=1024)
    seen = []
    monkeypatch.setattr(ts, "fused_all_reduce_add_rmsnorm_two_shot",
                        lambda x, res, w, eps, off, ptrs, counters, rank, reg: seen.append(
                            ("twoshot", tuple(x.shape), counters.data_ptr(), reg)) or x * 0)
    monkeypatch.setattr(far, "fused_all_reduce_add_rmsnorm", lambda x, res, w, eps, off, ptrs, counters, rank, reg,
                        lamport=None: seen.append(("pull", tuple(x.shape), counters.data_ptr(), lamport)) or x * 0)
    custom = CustomAllReduce(rank=2, world_size=4, group_name="g", config=cfg, buffer=torch.empty(0),
                             scratch=torch.empty(0))
    counters = torch.zeros(4, dtype=torch.int64)
    custom.fusion = FusedAllReduce(region, torch.zeros(4, dtype=torch.int64), counters, two_shot=two)
    assert custom.fusion.mode == "twoshot"
    w = torch.ones(64)
    for rows in (2, 4, 8, 9):  # 512, 1024 (the threshold), 2048 (the one-shot limit), 2304 bytes
        x = torch.zeros(rows, 64)
        assert (custom.fused_all_reduce_add_rmsnorm(x, x.clone(), w, 1e-6) is None) == (rows == 9)
    pull, two_shot = counters.data_ptr(), counters[2:].data_ptr()
    assert seen == [("pull", (2, 64), pull, None), ("twoshot", (4, 64), two_shot, two),
                    ("twoshot", (8, 64), two_shot, two)]
    assert custom.calls[FUSED] == 3
