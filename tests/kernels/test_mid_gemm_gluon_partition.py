"""CPU checks of the Gluon mid GEMM's host side (`attnserve.models.layers.mid_gemm_gluon`).

The kernel itself needs an sm_90 GPU (tests/gpu/test_mid_gemm_gluon_gpu.py); here: the
stream-K partition that its loader and consumers compute (`stream_k_segments` mirrors their
loop bounds), the slot fixup (`slot_plan` mirrors `_gather` and the consumer's choice of its
own slot: every (tile, K step) once, each written slot read once by the tile's last
arriver, whatever the arrival order, and summed in one fixed order), the config validation,
the launch geometry and the operand checks.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
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
    slot_plan,
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
                GluonMidGemmConfig(block_k=32), GluonMidGemmConfig(num_stages=1), GluonMidGemmConfig(grid=-1),
                GluonMidGemmConfig(split_k=-1)]:
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
    assert (g["grid"], g["n_tiles"], g["k_steps"], g["m1"], g["m2"], g["partials"]) == (132, 48, 64, 128, 16, True)
    assert (g["ws_rows"], g["ws_cols"], g["counters"]) == (2 * 132 * 128, 144, 96)
    g = launch_geometry(17, 1000, 1000, GluonMidGemmConfig(256, 128, 3, 2, grid=500), 132)
    assert (g["grid"], g["n_tiles"], g["k_steps"], g["ws_rows"], g["ws_cols"]) == (32, 4, 8, 2 * 32 * 256, 32)
    assert m_pieces(200) == (256, 0) and launch_geometry(200, 64, 64, GluonMidGemmConfig(), 132)["ws_cols"] == 256
    # split-K: S x tiles CTAs (capped at the units); S = 1 and grids dividing the tiles: no slots
    g = launch_geometry(144, 4096, 4096, GluonMidGemmConfig(128, 64, 6, 2, split_k=4), 132)
    assert (g["grid"], g["partials"], g["ws_rows"]) == (128, True, 2 * 128 * 128)
    assert launch_geometry(144, 1024, 128, GluonMidGemmConfig(128, 64, 6, 2, split_k=8), 132)["grid"] == 16
    for cfg in (GluonMidGemmConfig(64, 64, 6, 1, split_k=1), GluonMidGemmConfig(64, 64, 6, 1, grid=32)):
        g = launch_geometry(144, 4096, 4096, cfg, 132)
        assert not g["partials"] and g["ws_rows"] == 1
    g = launch_geometry(144, 4096, 4096, GluonMidGemmConfig(128, 64, 4, 2, split_k=2), 132, gated=True)
    assert (g["grid"], g["ws_rows"]) == (64, 2 * 64 * 2 * 128)
    with pytest.raises(ValueError, match="int32"):
        launch_geometry(256, 1 << 20, 1 << 16, GluonMidGemmConfig(128, 64, 4, 2, grid=1 << 16), 132)


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


def test_workspace_grows_and_shares():
    ws = GluonMidGemmWorkspace()
    cpu = torch.device("cpu")
    a, ca = ws.get(cpu, 128, 144, 4)
    assert a.shape == (128, 144) and a.dtype == torch.float32 and ca.dtype == torch.int32 and ca.abs().sum() == 0
    b, cb = ws.get(cpu, 64, 144, 2)  # smaller: a prefix of the same buffers
    assert b.data_ptr() == a.data_ptr() and cb.data_ptr() == ca.data_ptr() and b.shape == (64, 144)
    c, cc = ws.get(cpu, 256, 144, 8)  # larger: a new pair, the old one kept alive
    assert c.data_ptr() != a.data_ptr() and cc.shape == (8,) and cc.abs().sum() == 0
    assert len(ws.counters()) == 2 and len(ws.buffers["cpu"]) == 2
    d, cd = ws.get(cpu, 8, 144, 100)  # more counters only: grows the counters, keeps the slot size
    assert cd.shape == (100,) and ws.buffers["cpu"][-1][0].numel() >= 256 * 144
    assert GluonMidGemmWorkspace().get(cpu, 128, 144, 4)[0].data_ptr() != a.data_ptr()


def _kernel_slot(c, t, n_tiles, k_steps, grid):
    """The consumer's own-slot formula: ``2 pid + (u0 < t k_steps)``."""
    return 2 * c + int(c * n_tiles * k_steps // grid < t * k_steps)


@pytest.mark.parametrize("n_tiles,k_steps", SHAPES)
def test_slot_plan(n_tiles, k_steps):
    """Per split tile: the plan's contributors are exactly the CTAs with a partial segment on
    it, in CTA order, their shares add to k_steps, each in the slot the CTA itself writes; no
    slot is written twice in a launch (at most two partial segments a CTA: first and last);
    whole tiles are absent from the plan."""
    total = n_tiles * k_steps
    for grid in sorted({min(g, total) for g in GRIDS} | {min(s * n_tiles, total) for s in (1, 2, 3, 4, 6, 8)}):
        segs = stream_k_segments(n_tiles, k_steps, grid)
        plan = slot_plan(n_tiles, k_steps, grid)
        partial = {}
        written = set()
        for c, cta in enumerate(segs):
            assert all(lo == 0 and hi == k_steps for _, lo, hi in cta[1:-1]), "a middle segment must be whole"
            for i, (t, lo, hi) in enumerate(cta):
                if lo == 0 and hi == k_steps:
                    continue
                assert i in (0, len(cta) - 1)
                slot = _kernel_slot(c, t, n_tiles, k_steps, grid)
                assert slot == 2 * c + (i > 0) and slot not in written
                written.add(slot)
                partial.setdefault(t, []).append((c, slot, hi - lo))
        assert plan == partial
        read = [slot for parts in plan.values() for _, slot, _ in parts]
        assert sorted(read) == sorted(written), "every written slot read exactly once"
        assert all(len(p) >= 2 and sum(s for _, _, s in p) == k_steps for p in plan.values())
        # `_gather` reads slot 2c for every contributor after the first
        assert all(slot == 2 * c for p in plan.values() for c, slot, _ in p[1:])
        if n_tiles % grid == 0:
            assert plan == {}
        assert max((s for s in written), default=-1) < 2 * grid


@pytest.mark.parametrize("n_tiles,k_steps,grid", [(8, 32, 132), (48, 64, 132), (32, 48, 128), (16, 48, 132),
                                                  (7, 5, 13), (3, 7, 20), (32, 224, 132), (5, 3, 15)])
def test_slot_fixup_simulated(n_tiles, k_steps, grid):
    """The whole fixup on float32 data: each CTA's partial sums go to its slots, counters add
    K steps in a random arrival order, the arrival that completes k_steps (exactly one a
    tile, the last) sums the plan's slots in order. The result matches the float64 sum and
    is bit-identical across arrival orders (the sum order is fixed)."""
    rng = np.random.default_rng(n_tiles * 1000 + k_steps)
    prod = rng.standard_normal((n_tiles, k_steps, 4)).astype(np.float32)  # per-unit products, 4 outputs
    ref = prod.astype(np.float64).sum(axis=1)
    plan = slot_plan(n_tiles, k_steps, grid)
    results = []
    for trial in range(6):
        slots, counter, out, finisher = {}, [0] * n_tiles, {}, {}
        events = []
        for c, cta in enumerate(stream_k_segments(n_tiles, k_steps, grid)):
            for t, lo, hi in cta:
                part = np.zeros(4, np.float32)
                for k in range(lo, hi):
                    part = part + prod[t, k]
                events.append((c, t, lo, hi, part))
        random.Random(trial).shuffle(events)
        for c, t, lo, hi, part in events:
            if lo == 0 and hi == k_steps:
                out[t] = part
                continue
            slot = _kernel_slot(c, t, n_tiles, k_steps, grid)
            assert slot not in slots
            slots[slot] = part
            counter[t] += hi - lo
            if counter[t] == k_steps:
                assert t not in finisher and all(s in slots for _, s, _ in plan[t]), "finisher before a contributor"
                finisher[t] = c
                tot = np.zeros(4, np.float32)
                for _, s, _ in plan[t]:
                    tot = tot + slots.pop(s)
                out[t] = tot
                counter[t] = 0
        assert sorted(out) == list(range(n_tiles)) and not slots and counter == [0] * n_tiles
        got = np.stack([out[t] for t in range(n_tiles)])
        assert np.abs(got - ref).max() <= 1e-5 * k_steps * np.abs(prod).max()
        results.append(got)
    assert all(np.array_equal(r, results[0]) for r in results), "the fixup's sum must not depend on arrival order"


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
    assert (g["n_tiles"], g["ws_rows"], g["counters"]) == (112, 2 * 132 * 2 * 128, 224)


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
