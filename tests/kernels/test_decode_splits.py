"""The decode split heuristic (`decode_splits`): properties on random batches and
hand-computed cases (Triton interpreter on CPU, or the GPU when there is one)."""

from __future__ import annotations

import math

import pytest
import torch

from attnserve.attention.triton_ops.decode_splits import compute_num_kv_splits, decode_grid_splits

H100_SMS, KV_HEADS = 132, 8


def _splits(lens, device, max_kv_splits=32, num_sms=H100_SMS, heads=KV_HEADS, **kw):
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.full((len(lens) + 2,), -7, dtype=torch.int32, device=device)  # 2 guard entries
    compute_num_kv_splits(seq, out, max_kv_splits, num_sms, heads, **kw)
    got = out.cpu().tolist()
    assert got[len(lens):] == [-7, -7], "wrote past bs"
    return got[: len(lens)]


def _old_floor(lens, max_kv_splits, num_sms=H100_SMS, heads=KV_HEADS, waves=4, min_split=128):
    """The whole-wave rule alone (issue 21): clamp(n // max(min_split, cdiv(T, U)), 1, max)."""
    per = max(-(-sum(lens) // max(1, num_sms * waves // heads)), min_split)
    return [min(max(n // per, 1), max_kv_splits) for n in lens]


def _batches(gen):
    """Random batches: uniform lengths in a range, long tails (log-normal), equal lengths,
    and ones with empty requests; sizes 1..300."""
    out = []
    for _ in range(6):
        bs = int(torch.randint(1, 300, (1,), generator=gen))
        lo = int(torch.randint(0, 2000, (1,), generator=gen))
        out.append(torch.randint(lo, lo + 8192, (bs,), generator=gen).tolist())
        tail = torch.exp(torch.randn(bs, generator=gen) * 1.2 + math.log(1000)).clamp(1, 65536)
        out.append(tail.to(torch.int64).tolist())
        out.append([int(torch.randint(1, 40000, (1,), generator=gen))] * bs)
    out.append([0, 0, 5, 0])
    out.append([0])
    return out


@pytest.mark.parametrize("num_sms,heads,max_kv_splits,grid_waves", [(132, 8, 32, 4), (132, 2, 16, 8), (8, 1, 64, 4),
                                                                   (78, 4, 8, 16)])
def test_split_counts_properties(num_sms, heads, max_kv_splits, grid_waves, gen, device):
    """>= 1 split, <= max_kv_splits and <= the grid axis G (each split its own program, so the
    splits fill at most the grid's whole rows, >= grid_waves waves); a longer request never
    gets fewer splits; equal lengths give the whole-wave rule (<= max(U, bs) splits)."""
    for lens in _batches(gen):
        bs = len(lens)
        got = _splits(lens, device, max_kv_splits, num_sms, heads, grid_waves=grid_waves)
        grid = decode_grid_splits(bs, heads, max_kv_splits, num_sms, grid_waves)
        assert grid * bs * heads >= min(num_sms * grid_waves, bs * heads * max_kv_splits)
        assert all(1 <= s <= min(grid, max_kv_splits) for s in got), (lens, got)
        assert sum(got) <= bs * grid
        order = sorted(range(bs), key=lambda i: lens[i])
        assert all(got[a] <= got[b] for a, b in zip(order, order[1:])), "not monotone in the length"
        if len(set(lens)) == 1:
            assert got == _old_floor(lens, max_kv_splits, num_sms, heads)
            assert sum(got) <= max(num_sms * 4 // heads, bs)


def test_ragged_batch_splits_long_requests(device):
    """64 requests on an H100 (132 SMs, 8 KV heads), 48 x 2000 + 16 x 5000 tokens:
    T = 176,000, mean 2,750 (the longest is 1.8x the mean: ragged), U = 132 * 4 // 8 = 66,
    t = cdiv(T, U) = 2,667 so the whole-wave rule gives every request 1 split; the ragged
    unit is 1.0 * 2,750 (the default factor): round(5000 / 2750) = 2, round(2000 / 2750) = 1;
    at factor 0.5 (unit 1,375) 4 and 1; the grid axis is cdiv(132 * 16, 64 * 8) = 5 (16 waves,
    the default), at least 3 (2 at 4 waves)."""
    lens = [2000] * 48 + [5000] * 16
    assert _old_floor(lens, 32) == [1] * 64
    assert decode_grid_splits(64, KV_HEADS, 32, H100_SMS) == 5
    assert _splits(lens, device) == [1] * 48 + [2] * 16
    assert _splits(lens, device, ragged_factor=0.5) == [1] * 48 + [4] * 16
    assert _splits(lens, device, ragged_factor=0.5, grid_waves=4) == [1] * 48 + [3] * 16
    assert _splits(lens, device, ragged_factor=0.0) == [1] * 64  # the whole-wave rule alone


def test_equal_and_near_equal_batches_keep_whole_waves(device):
    """8 x 32K: t = cdiv(262144, 66) = 3,972 -> 8 splits (512 programs, 3.9 waves; 9 would be
    4.4). 63 x 8192 + 1 x 100 is not ragged (the longest is 1.02x the mean): t = cdiv(516196,
    66) = 7,822 -> 1 split each, not 2."""
    assert _splits([32768] * 8, device) == [8] * 8
    assert _splits([8192] * 63 + [100], device) == [1] * 64
    # lengths within 5/4 of the mean are treated as equal
    near = [8192 - 37 * i for i in range(64)]
    assert _splits(near, device) == _old_floor(near, 32)


def test_single_and_huge_batches(device):
    """bs 1 x 300: t = max(cdiv(300, 66), 128) = 128 -> 2 splits (not below 128 tokens); 512
    x 2048 (more requests than units): 1 split each; at bs 2 the grid axis (cdiv(2112, 16)
    = 132) does not cap a long request: max_kv_splits 32 decides."""
    assert _splits([300], device, max_kv_splits=64) == [2]
    assert _splits([2048] * 512, device, max_kv_splits=16) == [1] * 512
    assert _splits([65536, 128], device) == [32, 1]


def test_deterministic_counts_depend_on_the_request_alone(device):
    lens = [1, 100, 1000, 4000, 8192, 0]
    got = _splits(lens, device, max_kv_splits=16, deterministic=True, split_tile_size=256)
    assert got == [1, 1, 4, 16, 16, 1]  # cdiv(n, 256) clamped to 1..16
    assert _splits(lens[3:4], device, max_kv_splits=16, deterministic=True, split_tile_size=256) == [16]


def test_grid_splits_and_errors(device):
    assert decode_grid_splits(64, 8, 32, 132) == 5  # 16 waves: cdiv(2112, 512)
    assert decode_grid_splits(16, 8, 32, 132, waves=4) == 5  # cdiv(528, 128)
    assert decode_grid_splits(256, 8, 32, 132) == 3  # cdiv(2112, 2048) = 2, at least 3
    assert decode_grid_splits(64, 8, 32, 132, waves=4) == 3  # cdiv(528, 512) = 2, at least 3
    assert decode_grid_splits(1, 8, 32, 132) == 32  # capped by max_kv_splits
    assert decode_grid_splits(4096, 8, 2, 132) == 2  # at least 3, capped by max_kv_splits
    seq = torch.ones(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="int32"):
        compute_num_kv_splits(seq, torch.ones(4, dtype=torch.int64, device=device), 8, 132, 8)
    with pytest.raises(ValueError, match=">= 1"):
        compute_num_kv_splits(seq, torch.ones(4, dtype=torch.int32, device=device), 8, 132, 8, grid_waves=0)
