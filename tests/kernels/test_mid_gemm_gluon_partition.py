"""CPU checks of the Gluon mid GEMM's host side (`attnserve.models.layers.mid_gemm_gluon`).

The kernel itself needs an sm_90 GPU (tests/gpu/test_mid_gemm_gluon_gpu.py); here: the
stream-K partition that its loader and consumers compute (`stream_k_segments` mirrors their
loop bounds), the config validation, the launch geometry and the operand checks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attnserve.models.layers.mid_gemm import m_pieces
from attnserve.models.layers.mid_gemm_gluon import (
    SMEM_LIMIT,
    GluonMidGemmConfig,
    GluonMidGemmWorkspace,
    default_gluon_config,
    launch_geometry,
    operand_problems,
    stream_k_segments,
)

# (n_tiles, k_steps) of the benchmark's shapes at block_n 64/128/256, block_k 64/128, plus odd ones
SHAPES = sorted({(-(-n // bn), -(-k // bk)) for n, k in [(6144, 4096), (4096, 4096), (4096, 14336), (4096, 1024),
                                                        (1024, 2048), (1024, 3072), (1000, 1000), (8, 8)]
                 for bn in (64, 128, 256) for bk in (64, 128)} | {(1, 1), (1, 7), (7, 1), (3, 5), (5, 3), (97, 13)})
GRIDS = (1, 2, 3, 7, 64, 114, 132, 133, 264)


def _unit_owner(n_tiles, k_steps, grid):
    """Unit -> CTA by the definition (CTA c owns [c T // G, (c + 1) T // G))."""
    total = n_tiles * k_steps
    return [max(c for c in range(grid) if c * total // grid <= u) for u in range(total)]


@pytest.mark.parametrize("n_tiles,k_steps", SHAPES)
def test_stream_k_covers_every_unit_once(n_tiles, k_steps):
    total = n_tiles * k_steps
    for grid in sorted({min(g, total) for g in GRIDS} | {n_tiles, min(2 * n_tiles, total)}):
        segs = stream_k_segments(n_tiles, k_steps, grid)
        assert len(segs) == grid
        seen = {}
        sizes = []
        for c, cta in enumerate(segs):
            assert cta, f"CTA {c} of {grid} has no work"
            units = [t * k_steps + k for t, lo, hi in cta for k in range(lo, hi)]
            assert units == list(range(units[0], units[-1] + 1)), "a CTA's units must be contiguous, in order"
            sizes.append(len(units))
            for t, lo, hi in cta:
                assert 0 <= t < n_tiles and 0 <= lo < hi <= k_steps
            for u in units:
                assert u not in seen, f"unit {u} covered twice (CTAs {seen[u]}, {c})"
                seen[u] = c
        assert sorted(seen) == list(range(total))
        assert max(sizes) - min(sizes) <= 1, "stream-K ranges must be equal to within one unit"
        if total <= 2000 and grid <= 140:
            owner = _unit_owner(n_tiles, k_steps, grid)
            assert all(seen[u] == owner[u] for u in range(total))


@pytest.mark.parametrize("n_tiles,k_steps", SHAPES)
def test_stream_k_tile_completion(n_tiles, k_steps):
    """The epilogue's rule: a segment spanning all K steps is the tile's only one (written
    directly); the partial segments of a tile add up to exactly k_steps, so the counter
    reaches k_steps once, at the last arrival, whatever the arrival order."""
    total = n_tiles * k_steps
    for grid in sorted({min(g, total) for g in GRIDS}):
        by_tile = {}
        for cta in stream_k_segments(n_tiles, k_steps, grid):
            for t, lo, hi in cta:
                by_tile.setdefault(t, []).append((lo, hi))
        assert sorted(by_tile) == list(range(n_tiles))
        for t, parts in by_tile.items():
            if any(lo == 0 and hi == k_steps for lo, hi in parts):
                assert len(parts) == 1
            else:
                steps = [hi - lo for lo, hi in parts]
                assert sum(steps) == k_steps and len(parts) >= 2
                for order in itertools.islice(itertools.permutations(steps), 24):
                    running = list(itertools.accumulate(order))
                    assert running.count(k_steps) == 1 and running[-1] == k_steps
        if grid == n_tiles:  # data-parallel: every tile whole
            assert all(len(p) == 1 for p in by_tile.values())


def test_stream_k_rejects_bad_arguments():
    for args in [(0, 4, 1), (4, 0, 1), (2, 2, 0), (2, 2, 5)]:
        with pytest.raises(ValueError):
            stream_k_segments(*args)


def test_config_validation():
    GluonMidGemmConfig().validate(144)
    for bad in [GluonMidGemmConfig(block_n=96), GluonMidGemmConfig(block_n=128, num_consumers=3),
                GluonMidGemmConfig(block_n=512, num_consumers=2), GluonMidGemmConfig(block_k=96),
                GluonMidGemmConfig(block_k=32), GluonMidGemmConfig(num_stages=1), GluonMidGemmConfig(grid=-1)]:
        with pytest.raises(ValueError):
            bad.validate()
    with pytest.raises(ValueError, match="shared memory"):
        GluonMidGemmConfig(128, 128, 6, 2).validate(144)  # 6 x (128 + 144) x 256 B > 227 KB
    with pytest.raises(ValueError, match="accumulator"):
        GluonMidGemmConfig(256, 64, 3, 2).validate(256)  # 128 rows x 256 columns / 128 threads = 256
    with pytest.raises(ValueError, match="outside"):
        GluonMidGemmConfig().validate(257)


def test_config_arithmetic():
    cfg = GluonMidGemmConfig(128, 64, 6, 2)
    assert cfg.smem_bytes(144) == 6 * (128 + 128 + 16) * 64 * 2
    assert cfg.acc_regs(144) == 64 * 144 // 128
    assert GluonMidGemmConfig(256, 64, 4, 2).acc_regs(144) == 144


@pytest.mark.parametrize("m", range(1, 257))
def test_default_config_fits(m):
    cfg = default_gluon_config(m)
    cfg.validate(m)
    assert cfg.smem_bytes(m) <= SMEM_LIMIT and cfg.num_stages >= 3


def test_launch_geometry():
    g = launch_geometry(144, 6144, 4096, GluonMidGemmConfig(128, 64, 6, 2), 132)
    assert (g["grid"], g["n_tiles"], g["k_steps"], g["m1"], g["m2"]) == (132, 48, 64, 128, 16)
    assert (g["ws_rows"], g["ws_cols"], g["counters"]) == (6144, 144, 96)
    g = launch_geometry(17, 1000, 1000, GluonMidGemmConfig(256, 128, 3, 2, grid=500), 132)
    assert (g["grid"], g["n_tiles"], g["k_steps"], g["ws_rows"], g["ws_cols"]) == (32, 4, 8, 1024, 32)
    assert m_pieces(200) == (256, 0) and launch_geometry(200, 64, 64, GluonMidGemmConfig(), 132)["ws_cols"] == 256


def test_operand_problems():
    x = torch.zeros(144, 1024, dtype=torch.bfloat16)
    w = torch.zeros(4096, 1024, dtype=torch.bfloat16)
    assert operand_problems(x, w, check_device=False) == []
    assert operand_problems(x, w, torch.zeros(4096, dtype=torch.bfloat16), check_device=False) == []
    assert any("multiple of 8" in p for p in operand_problems(torch.zeros(144, 1001, dtype=torch.bfloat16),
                                                              torch.zeros(64, 1001, dtype=torch.bfloat16),
                                                              check_device=False))
    assert operand_problems(torch.zeros(257, 1024, dtype=torch.bfloat16), w, check_device=False)
    assert operand_problems(x.float(), w.float(), check_device=False)
    assert operand_problems(x, w[:, :512], check_device=False)
    assert operand_problems(x, w.t().contiguous().t(), check_device=False)  # not contiguous
    assert operand_problems(x, w, torch.zeros(100, dtype=torch.bfloat16), check_device=False)
    assert any("sm_90" in p for p in operand_problems(x, w))  # CPU tensors


def test_workspace_cache_is_per_object():
    ws = GluonMidGemmWorkspace()
    a = ws.get(torch.device("cpu"), 128, 144, 4)
    assert ws.get(torch.device("cpu"), 128, 144, 4)[0] is a[0]
    assert a[0].abs().sum() == 0 and a[1].abs().sum() == 0 and a[1].dtype == torch.int32
    assert ws.get(torch.device("cpu"), 256, 144, 4)[0] is not a[0]
    assert GluonMidGemmWorkspace().get(torch.device("cpu"), 128, 144, 4)[0] is not a[0]


def test_gated_config_arithmetic():
    cfg = GluonMidGemmConfig(128, 64, 4, 2)
    assert cfg.smem_bytes(144, gated=True) == 4 * (2 * 128 + 144) * 64 * 2
    assert cfg.acc_regs(144, gated=True) == 2 * 64 * 144 // 128
    cfg.validate(144, gated=True)
    with pytest.raises(ValueError, match="accumulator"):
        cfg.validate(192, gated=True)  # 192 > 160 registers of accumulators
    GluonMidGemmConfig(64, 64, 4, 1).validate(192, gated=True)
    with pytest.raises(ValueError, match="shared memory"):
        GluonMidGemmConfig(128, 64, 6, 2).validate(144, gated=True)
    g = launch_geometry(144, 14336, 4096, cfg, 132, gated=True)
    assert (g["n_tiles"], g["ws_rows"], g["counters"]) == (112, 2 * 14336, 224)


@pytest.mark.parametrize("m", range(1, 193))
def test_default_gated_config_fits(m):
    cfg = default_gluon_config(m, gated=True)
    cfg.validate(m, gated=True)
    assert cfg.num_stages >= 3


def test_gated_rejects_unknown_activation():
    from attnserve.models.layers.mid_gemm_gluon import gluon_mid_linear_gated

    x = torch.zeros(144, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="activation"):
        gluon_mid_linear_gated(x, torch.zeros(256, 1024, dtype=torch.bfloat16), "relu")
    with pytest.raises(ValueError):  # CPU tensors: refused before any launch
        gluon_mid_linear_gated(x, torch.zeros(256, 1024, dtype=torch.bfloat16), "silu")
