"""Push-mode ("Lamport") fused all-reduce + add + RMSNorm under the Triton interpreter.

The interpreter runs one simulated rank at a time and a rank's launch spins until every
peer has pushed, so each call is run as the ranks would interleave on GPUs: ranks ``0..W-2``
run the push-only stage, rank ``W-1`` the whole kernel (push, clear, wait, reduce: the GPU
path), then ranks ``0..W-2`` the rest. A sequence of calls of changing sizes and dtypes goes
through all three phases twice; every call's outputs must equal the pull kernel's bit for bit
(up to the sign of a zero sum, checked where it differs), and after every call each rank's
Lamport region must hold exactly that call's data with everything else back at the sentinel
(the clear of the previous call's phase). GPU runs: tests/gpu/test_custom_all_reduce_gpu.py.
"""

import os

import pytest
import torch

from attnserve.distributed import fused_all_reduce as far
from attnserve.distributed import fused_all_reduce_push as fp
from attnserve.distributed.fused_all_reduce import FusedRegion, fused_all_reduce_add_rmsnorm
from attnserve.distributed.fused_all_reduce_push import LamportRegion

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
EPS = 1e-5


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _sentinel_image(lam: LamportRegion) -> torch.Tensor:
    img = torch.zeros(lam.end, dtype=torch.uint8)
    lam.fill_sentinels(img)
    return img[lam.offset:]


def _pull(world, xs, residual, w, offset, rows_max_bytes):
    """The pull kernel's (out, residual) for these partial sums, run as rank 0 with the
    peers' halves and flags staged (as tests/unit/test_fused_all_reduce.py does)."""
    region = FusedRegion.after(0, rows_max_bytes, world)
    bufs = [torch.zeros(region.end, dtype=torch.uint8) for _ in range(world)]
    for q, b in enumerate(bufs):
        start = region.data_offset + region.half_bytes  # epoch 1 -> half 1
        b[start:start + xs[q].numel() * xs[q].element_size()].view(xs[q].dtype).copy_(xs[q].view(-1))
        b[region.flags_offset:region.end].view(torch.int64).fill_(1)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    res = residual.clone()
    out = fused_all_reduce_add_rmsnorm(xs[0].clone(), res, w, EPS, offset, ptrs, torch.zeros(2, dtype=torch.int64),
                                       0, region)
    return out, res


def _same_up_to_zero_sign(a: torch.Tensor, b: torch.Tensor) -> bool:
    nonzero = a != 0
    return torch.equal(a, b) and torch.equal(_bits(a)[nonzero], _bits(b)[nonzero])


# (dtype, rows): phases 1, 2, 0, 1, 2, 0; the dtype changes; calls 4 and 6 are larger than
# the calls that used their phase before (the clear must have covered what they read)
CALLS = [(torch.bfloat16, 3), (torch.float32, 5), (torch.bfloat16, 1), (torch.bfloat16, 5), (torch.float32, 2),
         (torch.bfloat16, 2)]


def _run_call(args, world, splits):
    """One call on every simulated rank, interleaved as GPUs would run it (see the module doc)."""
    outs = [None] * world
    if splits == 1:
        for r in range(world - 1):
            fp._launch(*args(r), stage=1)
        outs[world - 1] = fp.fused_all_reduce_add_rmsnorm_push(*args(world - 1))  # the GPU path
        for r in range(world - 1):
            outs[r] = fp._launch(*args(r), stage=2)
        return outs
    # split rows: a program also waits for the other programs of its row (a later program
    # under the interpreter), so every stage runs on every rank before the next one
    for r in range(world):
        fp._launch(*args(r), stage=1)
    for r in range(world):
        fp._launch(*args(r), stage=2)
    for r in range(world):
        outs[r] = fp._launch(*args(r), stage=3)
    return outs


def _check_calls(world, hidden, calls, max_splits, want_splits):
    """Run ``calls`` ((dtype, rows) each) through the push kernel on ``world`` simulated ranks;
    every call must give the pull kernel's bits (up to zero signs), leave the counters and each
    region as the protocol says, and cut its rows as ``want_splits`` (one per call) says."""
    offset = 0.0
    max_bytes = max(rows for _, rows in calls) * hidden * 4
    lam = LamportRegion.after(1000, max_bytes, world, max_splits)
    bufs = [torch.zeros(lam.end, dtype=torch.uint8) for _ in range(world)]
    for b in bufs:
        lam.fill_sentinels(b)
    clean = _sentinel_image(lam)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    counters = [torch.zeros(fp.PUSH_COUNTERS, dtype=torch.int64) for _ in range(world)]
    gen = torch.Generator().manual_seed(11)
    zero_sign_seen = False
    for epoch, (dtype, rows) in enumerate(calls, start=1):
        splits = fp.row_splits(rows, hidden, max_splits, world)[0]
        assert splits == want_splits[epoch - 1], (epoch, splits)
        xs = [(torch.randn(rows, hidden, generator=gen) * 4).to(dtype) for _ in range(world)]
        residual = torch.randn(rows, hidden, generator=gen).to(dtype)
        w = torch.randn(hidden, generator=gen).to(dtype)
        if epoch == 2:  # -0.0 partials: pushed as +0.0; an all -0.0 sum plus a -0.0 residual
            for x in xs:
                x[0, :4] = -0.0
                x[rows - 1, 5] = -0.0
            residual[0, :4] = -0.0
        want_out, want_res = _pull(world, xs, residual, w, offset, max_bytes)
        ress = [residual.clone() for _ in range(world)]
        args = lambda r: (xs[r], ress[r], w, EPS, offset, ptrs, counters[r], r, lam)  # noqa: E731
        outs = _run_call(args, world, splits)
        phase = epoch % 3
        for r in range(world):
            assert _same_up_to_zero_sign(outs[r], want_out), (epoch, r)
            assert _same_up_to_zero_sign(ress[r], want_res), (epoch, r)
            n_vec = (rows * hidden * dtype.itemsize + 15) // 16
            word = -(1 << 31) if dtype == torch.float32 else -(1 << 31) | (1 << 15)
            assert counters[r][:fp.CALL_COUNTERS].tolist() == [epoch, 0, n_vec, lam.slot_offset(dtype, phase, 0), word]
            assert not bool(counters[r][fp.CALL_COUNTERS:fp.ROW_FLAGS_AT].any())  # the gap to the flags' line
            if splits > 1:  # this call's programs raised their flags
                flags = counters[r][fp.ROW_FLAGS_AT:fp.ROW_FLAGS_AT + rows * splits]
                assert flags.tolist() == [epoch] * (rows * splits)
        if epoch == 2:
            # pull: -0 + -0 + -0 + (-0) = -0; push: +0 throughout (the only difference)
            assert bool((_bits(want_res[0, :4]) == _bits(torch.tensor(-0.0))).all())
            assert bool((_bits(ress[0][0, :4]) == 0).all())
            zero_sign_seen = True
        # every rank's region: this call's data in its phase, the rest at the sentinel
        want_img = clean.clone()
        for s in range(world):
            start = lam.slot_offset(dtype, phase, s) - lam.offset
            pushed = _bits(xs[s]).view(-1).clone()
            pushed[pushed == _bits(torch.tensor(-0.0, dtype=dtype))] = 0
            want_img[start:start + pushed.numel() * dtype.itemsize].view(pushed.dtype).copy_(pushed)
        for r in range(world):
            assert torch.equal(bufs[r][lam.offset:], want_img), (epoch, r)
    assert zero_sign_seen


@interpreter
def test_push_matches_pull_and_restores_sentinels_over_calls(monkeypatch):
    monkeypatch.setattr(far, "MAX_PROGRAMS", 2)  # rows strided over 2 programs; the clear too
    _check_calls(3, 32, CALLS, 1, [1] * len(CALLS))


@interpreter
def test_split_rows_match_pull_between_one_program_calls(monkeypatch):
    """Hidden 80 in programs of 32 columns (3 a row, the last one past the row's end: the flags'
    power-of-two vector is masked) at 1 and 2 rows, 2 a row at 3 rows, one a row at 5 rows (8 programs
    at most): the two kernels share the phases, the clear and the counters."""
    monkeypatch.setattr(far, "MAX_PROGRAMS", 8)
    monkeypatch.setattr(fp, "MIN_SPLIT_COLS", 16)
    calls = [(torch.bfloat16, 1), (torch.float32, 3), (torch.bfloat16, 5), (torch.bfloat16, 2),
             (torch.float32, 1), (torch.bfloat16, 3)]
    _check_calls(3, 80, calls, 4, [3, 2, 1, 3, 3, 2])


def test_row_splits():
    """The programs a row: powers of two of columns, capped by the setting, the programs and the
    width; never at two ranks."""
    assert fp.row_splits(1, 8192, 8, 4) == (8, 1024)
    assert fp.row_splits(1, 4096, 16, 4) == (16, 256)
    assert fp.row_splits(8, 4096, 8, 3) == (8, 512)
    assert fp.row_splits(64, 4096, 8, 4) == (2, 2048)  # 128 programs at most
    assert fp.row_splits(65, 4096, 8, 4) == (1, 4096)
    assert fp.row_splits(1, 5120, 8, 8) == (5, 1024)  # the last chunk ends at 8,192 > 5,120
    assert fp.row_splits(1, 4096, 1, 4) == (1, 4096)
    assert fp.row_splits(1, 300, 8, 4) == (1, 512)  # fewer than two chunks of 256 columns
    assert fp.row_splits(1, 4096, 6, 4) == (4, 1024)  # rounded down to a power of two
    assert fp.row_splits(1, 8192, 8, 2) == (1, 8192)  # two ranks: one program a row


def test_row_splits_from_env(monkeypatch):
    monkeypatch.delenv(fp.ROW_SPLITS_ENV, raising=False)
    assert fp.row_splits_from_env() == fp.DEFAULT_ROW_SPLITS
    for raw, want in ((" 4 ", 4), ("1", 1), ("", fp.DEFAULT_ROW_SPLITS)):
        monkeypatch.setenv(fp.ROW_SPLITS_ENV, raw)
        assert fp.row_splits_from_env() == want
    for bad in ("0", "-2", "two", "1.5", "1000"):
        monkeypatch.setenv(fp.ROW_SPLITS_ENV, bad)
        with pytest.raises(ValueError, match="ATTNSERVE_PUSH_ROW_SPLITS"):
            fp.row_splits_from_env()


def test_lamport_region_layout_and_sentinels():
    lam = LamportRegion.after(1000, 1000, 4)
    assert lam.offset == 1024 and lam.slot_bytes == 1024
    assert lam.end == lam.offset + 2 * 3 * 4 * 1024
    offsets = sorted(lam.slot_offset(d, p, s) for d in (torch.float32, torch.bfloat16) for p in range(3)
                     for s in range(4))
    assert offsets == [lam.offset + i * lam.slot_bytes for i in range(24)]  # disjoint, dense
    buf = torch.zeros(lam.end, dtype=torch.uint8)
    lam.fill_sentinels(buf)
    f32 = buf[lam.slot_offset(torch.float32, 0, 0):lam.slot_offset(torch.bfloat16, 0, 0)].view(torch.float32)
    b16 = buf[lam.slot_offset(torch.bfloat16, 0, 0):lam.end].view(torch.bfloat16)
    assert bool((f32 == 0).all()) and bool(torch.signbit(f32).all())  # every element -0.0
    assert bool((b16 == 0).all()) and bool(torch.signbit(b16).all())
    assert bool((buf[:lam.offset] == 0).all())  # nothing before the region touched


def test_fusion_mode_from_env():
    assert fp.fusion_mode_from_env({}) == "push"
    assert fp.fusion_mode_from_env({fp.FUSION_MODE_ENV: ""}) == "push"
    assert fp.fusion_mode_from_env({fp.FUSION_MODE_ENV: " Pull "}) == "pull"
    assert fp.fusion_mode_from_env({fp.FUSION_MODE_ENV: "Push"}) == "push"
    with pytest.raises(ValueError, match="ATTNSERVE_ALLREDUCE_FUSION_MODE='lamport'"):
        fp.fusion_mode_from_env({fp.FUSION_MODE_ENV: "lamport"})


def test_push_refuses_what_the_pull_kernel_refuses():
    lam = LamportRegion.after(0, 1024, 2)
    x, w = torch.zeros(4, 64), torch.ones(64)
    assert fp.push_unsupported_reason(x, x.clone(), w, lam) is None
    assert "bytes" in fp.push_unsupported_reason(torch.zeros(8, 64), torch.zeros(8, 64), w, lam)
    assert "dtypes" in fp.push_unsupported_reason(x.half(), x.half(), w, lam)
    ptrs = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="counters must be int64"):
        fp.fused_all_reduce_add_rmsnorm_push(x, x.clone(), w, 1e-6, 0.0, ptrs, torch.zeros(2, dtype=torch.int64),
                                             0, lam)
    with pytest.raises(ValueError, match="fused_all_reduce_add_rmsnorm_push"):
        fp.fused_all_reduce_add_rmsnorm_push(x.half(), x.half(), w, 1e-6, 0.0, ptrs,
                                             torch.zeros(fp.PUSH_COUNTERS, dtype=torch.int64), 0, lam)


def test_custom_all_reduce_routes_push_mode_to_the_push_kernel(monkeypatch):
    """`CustomAllReduce.fused_all_reduce_add_rmsnorm` takes the same messages in both
    modes; with a Lamport region the launch goes to the push kernel with the push counters."""
    from attnserve.distributed.custom_all_reduce import FUSED, CustomAllReduce, CustomAllReduceConfig
    from attnserve.distributed.fused_all_reduce import FusedAllReduce

    cfg = CustomAllReduceConfig(one_shot_max_bytes=1024, two_shot_max_bytes=4096)
    region = FusedRegion.after(cfg.buffer_bytes, cfg.one_shot_max_bytes, 2)
    lam = LamportRegion.after(region.end, cfg.one_shot_max_bytes, 2)
    seen = []
    monkeypatch.setattr(fp, "fused_all_reduce_add_rmsnorm_push",
                        lambda x, res, w, eps, off, ptrs, counters, rank, lamport: seen.append(
                            (tuple(x.shape), counters.numel(), rank, lamport)) or x * 0)
    custom = CustomAllReduce(rank=1, world_size=2, group_name="g", config=cfg, buffer=torch.empty(0),
                             scratch=torch.empty(0))
    custom.fusion = FusedAllReduce(region, torch.zeros(2, dtype=torch.int64),
                                   torch.zeros(fp.PUSH_COUNTERS, dtype=torch.int64), lamport=lam)
    assert custom.fusion.mode == "push"
    x, w = torch.zeros(4, 64), torch.ones(64)
    assert custom.fused_all_reduce_add_rmsnorm(x, x.clone(), w, 1e-6) is not None
    big = torch.zeros(8, 64)  # two-shot size: the caller's fallback, as in pull mode
    assert custom.fused_all_reduce_add_rmsnorm(big, big.clone(), w, 1e-6) is None
    assert seen == [((4, 64), fp.PUSH_COUNTERS, 1, lam)] and custom.calls[FUSED] == 1
    assert FusedAllReduce(region, torch.zeros(2), torch.zeros(2)).mode == "pull"
