"""The FP8 mid GEMM's wide tile sweep (``benchmarks/fp8_mid_sweep.py``, issue 37): its plan
for the Llama-3-8B shapes at 64 rows, and one shape's full flow on a tiny weight under the
Triton interpreter with a stand-in timer (the GPU timing is the lead's run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_mid_sweep as sw  # noqa: E402

from attnserve.models.layers.mid_gemm import m_pieces  # noqa: E402
from attnserve.models.layers.quantization.fp8_mid_gemm import SMEM_BUDGET  # noqa: E402


def test_plan_fits_shared_memory_waves_and_budget():
    """Stage 1: the reference first, every config fits `SMEM_BUDGET` with 3..6 stages, its
    programs cover the 132 SMs at least once (split-K tiles) and no split is empty or under 4
    K steps; the whole plan fits the default 150 s at `SECONDS_PER_CONFIG`."""
    for _, n, k, gated in sw.WIDE_SHAPES["llama-3-8b"]:
        plan = sw.plan_stage1(64, n, k, gated)
        assert plan[0] == sw.reference_config(64, n, k, gated) and len(set(plan)) == len(plan) >= 8
        cols = n // 2 if gated else n
        for cfg in plan[1:]:
            per_stage = ((2 if gated else 1) * cfg.block_n + sum(m_pieces(64))) * cfg.block_k
            assert 3 <= cfg.num_stages <= 6 and cfg.num_stages * per_stage <= SMEM_BUDGET, cfg
            programs = -(-cols // cfg.block_n) * cfg.split_k
            assert programs >= 132 or cfg.split_k == 1, cfg
            steps = -(-k // cfg.block_k)
            per = -(-steps // cfg.split_k)
            assert per * (cfg.split_k - 1) < steps and per >= 4, cfg
        stage2 = sw.plan_stage2(plan[1:4], 64, gated, plan)
        assert stage2 and not set(stage2) & set(plan)
        assert stage2[0].use_tma != plan[1].use_tma  # TMA first
    est = sw.estimate("llama-3-8b", [64])
    assert (est["stage1"] + est["stage2_max"]) * sw.SECONDS_PER_CONFIG <= 150


def test_sweep_shape_flow_on_interpreter():
    """One tiny gated shape end to end: every candidate checked against the reference tile's
    output (none mismatched or failed: the interpreter computes them all), the best 5 sorted,
    the table line naming the best, the row JSON-serialisable; stage 2 trimmed to a budget."""
    fake = iter(range(1000, 0, -1))
    logs = []
    row = sw.sweep_shape("tiny", 2 * 96, 1024, True, 20, budget_s=1e6, copy_tb_s=3.0, log=logs.append, device="cpu",
                         timer=lambda fn, copies, replays: float(next(fake)), sms=4)
    assert row["failed"] == {} and row["mismatch"] == {}, (row["failed"], row["mismatch"])
    assert len(row["candidates"]) == row["stage1"] + row["stage2_run"] and row["stage2_run"] == row["stage2_planned"]
    us = [b["us"] for b in row["best5"]]
    assert len(us) == 5 and us == sorted(us)
    best = row["best5"][0]["label"]
    cfg = row["candidates"][best]["cfg"]
    assert row["table_line"].startswith(f"table_key(192, 1024, True): ({cfg['block_n']}, {cfg['block_k']}, ")
    assert any(line.startswith("  paste: ") for line in logs)
    json.dumps(row)
    trimmed = sw.sweep_shape("tiny", 64, 1024, False, 20, budget_s=0.0, copy_tb_s=3.0, log=logs.append,
                             device="cpu", timer=lambda fn, copies, replays: 1.0, sms=4)
    assert trimmed["stage2_run"] == 0 < trimmed["stage2_planned"]
    assert torch.isfinite(torch.tensor(row["best5"][0]["tb_s"]))
