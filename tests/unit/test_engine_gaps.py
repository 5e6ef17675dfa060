"""`attnserve.bench.engine_gaps` (interval arithmetic, trace attribution), `EngineProbe` and
``benchmarks/profile_engine_gaps.py`` on a CPU engine."""

import json
import sys
from pathlib import Path

import pytest

from attnserve.bench.engine_gaps import (
    StepInfo,
    analyse,
    covered_length,
    idle_gaps,
    kernel_class,
    parse_trace,
    union_intervals,
)

ABS = 1e-9  # the hand-made times below are small integers: sums of them are exact in float64


def test_union_covered_and_gaps_on_hand_made_intervals():
    iv = [(5, 7), (0, 2), (1, 3), (3, 4), (10, 12), (11, 11.5), (20, 19)]  # overlap, touch, nest, inverted
    merged = union_intervals(iv)
    assert merged == [(0, 4), (5, 7), (10, 12)]
    for lo, hi in [(0, 12), (1, 11), (-3, 30), (4, 5), (6, 6.5)]:
        cov = covered_length(merged, lo, hi)
        gaps = idle_gaps(merged, lo, hi)
        assert sum(b - a for a, b in gaps) == pytest.approx((hi - lo) - cov, abs=ABS)
        assert all(lo <= a < b <= hi for a, b in gaps)
    assert covered_length(merged, 1, 11) == pytest.approx(3 + 2 + 1)
    assert idle_gaps(merged, 1, 11) == [(4, 5), (7, 10)]
    assert idle_gaps(merged, -3, 30) == [(-3, 0), (4, 5), (7, 10), (12, 30)]
    assert idle_gaps(merged, 6, 6.5) == []


def test_kernel_classes():
    assert kernel_class("_decode_stage1_kernel") == "attention"
    assert kernel_class("nvjet_sm90_tst_64x144_64x8_2x1_v_bz_splitK_TNT") == "gemm"
    assert kernel_class("_mid_gemm_kernel") == "gemm"
    assert kernel_class("_fused_add_rmsnorm_kernel") == "norm_rope"
    assert kernel_class("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy") == "memcpy"
    assert kernel_class("void at::native::vectorized_gather_kernel<16, long>") == "other"


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _cuda_like_trace():
    """Two engine steps of a made-up CUDA run (µs):

    step 0 [100, 200): prepare_inputs.h2d [110, 120) launches a memcpy (corr 1) that runs
    [112, 114); forward.graph_replay [120, 130) launches one graph (corr 2) whose kernels
    run [131, 150) and [152, 170) (an in-graph gap of 2); process_results.wait_ids
    [140, 175) then sample [180, 190) launches an argmax (corr 3) at 185 that runs [186, 190).
    step 1 [200, 260): forward.graph_replay [205, 215) launches a graph (corr 4) at 210 whose
    kernel runs [212, 240); sample [242, 252) launches a GEMM at 245 that runs [250, 255).
    """
    ev = [
        _x("user_annotation", "engine.step#0", 100, 100),
        _x("user_annotation", "prepare_inputs.h2d", 110, 10),
        _x("cuda_runtime", "cudaMemcpyAsync", 111, 1, correlation=1),
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 112, 2, tid=7, correlation=1),
        _x("user_annotation", "forward.graph_replay", 120, 10),
        _x("cuda_runtime", "cudaGraphLaunch", 125, 2, correlation=2),
        _x("kernel", "_decode_stage1_kernel", 131, 19, tid=7, correlation=2),
        _x("kernel", "_mid_gemm_kernel", 152, 18, tid=7, correlation=2),
        _x("user_annotation", "process_results.wait_ids", 140, 35),
        _x("cuda_runtime", "cudaEventSynchronize", 141, 33),
        _x("user_annotation", "sample", 180, 10),
        _x("cuda_driver", "cuLaunchKernel", 185, 1, correlation=3),
        _x("kernel", "argmax_kernel", 186, 4, tid=7, correlation=3),
        _x("user_annotation", "engine.step#1", 200, 60),
        _x("user_annotation", "forward.graph_replay", 205, 10),
        _x("cuda_runtime", "cudaGraphLaunch", 210, 1, correlation=4),
        _x("kernel", "_rmsnorm_kernel", 212, 28, tid=7, correlation=4),
        _x("user_annotation", "sample", 242, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 245, 1, correlation=5),
        _x("kernel", "nvjet_gemm", 250, 5, tid=7, correlation=5),
        _x("gpu_user_annotation", "sample", 250, 5, tid=7),  # not device work: ignored
    ]
    return {"traceEvents": ev}


def test_cuda_like_trace_attribution():
    trace = parse_trace(_cuda_like_trace()["traceEvents"])
    assert trace.device == "cuda" and [s[0] for s in trace.steps] == [0, 1]
    infos = {0: StepInfo("decode", 4, 400, 4), 1: StepInfo("decode", 4, 404, 4)}
    rep = analyse(trace, infos, 0, 2)
    s0, s1 = rep.steps
    # step 0 [100, 200): busy 2 + 19 + 18 + 4 = 43; step 1 [200, 260): the last step ends at its own end
    assert s0["wall_us"] == pytest.approx(100) and s0["busy_us"] == pytest.approx(43)
    assert s1["wall_us"] == pytest.approx(60) and s1["busy_us"] == pytest.approx(28 + 5)
    assert s0["kernel_us"] == pytest.approx(43) and s1["kernel_us"] == pytest.approx(33)
    assert s0["wait_us"] == pytest.approx(35) and s0["host_us"] == pytest.approx(100)
    assert s1["gpu_wall_us"] is None and s0["gpu_wall_us"] == pytest.approx(212 - 112)
    for s in rep.steps:
        assert s["idle_us"] == pytest.approx(s["wall_us"] - s["busy_us"], abs=ABS)
    total_idle = sum(s["idle_us"] for s in rep.steps)
    assert sum(g["dur_us"] for g in rep.gaps) == pytest.approx(total_idle, abs=ABS)
    by_start = {round(g["start_us"]): g for g in rep.gaps}  # start relative to the window (100)
    assert by_start[50]["kind"] == "in_graph" and by_start[50]["dur_us"] == pytest.approx(2)
    late = by_start[70]  # device idle [170, 186): the argmax was launched at 185, 15 µs late
    assert late["kind"] == "between_launches" and late["resumed_by"] == "sample"
    assert late["launch_call"] == "cuLaunchKernel" and late["host_late_us"] == pytest.approx(15)
    assert late["host_at_start"] == "process_results.wait_ids / cudaEventSynchronize"
    graph = by_start[90]  # [190, 212): the graph was launched at 210
    assert graph["resumed_by"] == "forward.graph_replay" and graph["host_late_us"] == pytest.approx(20)
    sm = rep.summary
    assert sm["steps"] == 2 and sm["modes"] == {"decode": 2} and sm["launch_attributed_share"] == 1.0
    assert sm["mean_wall_ms"] == pytest.approx(0.080) and sm["mean_busy_ms"] == pytest.approx(0.038)
    assert sm["idle_share"] == pytest.approx(84 / 160)
    assert sm["idle_us_per_step_by_kind"]["in_graph"] == pytest.approx(1.0)
    cls = sm["device_us_per_step_by_class"]
    assert cls["attention"] == pytest.approx(19 / 2) and cls["gemm"] == pytest.approx((18 + 5) / 2)
    assert cls["memcpy"] == pytest.approx(1) and cls["sampling"] == pytest.approx(2)
    assert sm["largest_gaps"][0]["dur_us"] == max(g["dur_us"] for g in rep.gaps)
    assert sm["top_idle_causes"][0]["total_us_per_step"] >= sm["top_idle_causes"][-1]["total_us_per_step"]
    assert sm["device_us_per_step_by_launch_phase"]["forward.graph_replay"] == pytest.approx((19 + 18 + 28) / 2)
    with pytest.raises(ValueError, match="not in the trace"):
        analyse(trace, infos, 5, 7)


def test_probe_changes_nothing_and_restores_the_engine(tmp_path):
    from attnserve import LLM, SamplingParams
    from attnserve.bench.engine_probe import EngineProbe, ProfileWindow

    llm = LLM("qwen3-tiny", load_format="dummy", device="cpu")
    try:
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
        sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        plain = [o.token_ids for o in llm.generate(prompts, sp)]
        sched, runner = llm.engine.scheduler, llm.engine.model_runner
        with pytest.raises(ValueError, match="overlap"):
            EngineProbe(llm.engine, [ProfileWindow("a", 0, 3), ProfileWindow("b", 2, 2, lead=0)], str(tmp_path))
        win = ProfileWindow("w", 2, 2, lead=1, tail=1)
        probe = EngineProbe(llm.engine, [win], str(tmp_path)).install()
        assert "step" in vars(sched) and "forward" in vars(runner)
        probe.arm()
        probed = [o.token_ids for o in llm.generate(prompts, sp)]
        probe.uninstall()
        assert probed == plain  # greedy: the probe does not change what the engine computes
        assert win.recorded == [1, 2, 3, 4] and Path(win.trace_path).is_file()
        assert {i: probe.infos[i].mode for i in win.recorded} == {i: "decode" for i in win.recorded}
        assert all(probe.infos[i].batch_size == 2 for i in win.recorded)
        for obj, attr in [(sched, "step"), (sched, "_process"), (runner, "forward"), (sched.packer, "pack")]:
            assert attr not in vars(obj)
    finally:
        llm.shutdown()


def test_profile_engine_gaps_script_on_cpu(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_engine_gaps

    rc = profile_engine_gaps.main([
        "--models", "qwen3-tiny", "--device", "cpu", "--num-prompts", "4", "--random-input-len", "24",
        "--random-output-len", "16", "--random-range-ratio", "0.5", "--warmup-output-len", "2",
        "--prefill-window", "0", "3", "--decode-window", "5", "4", "--lead", "1", "--tail", "1",
        "--out", str(tmp_path), "--no-baseline"])
    assert rc == 0
    (path,) = tmp_path.glob("cpu-profile-engine-gaps-*.json")
    res = json.loads(path.read_text())
    for key in ("date", "device", "torch", "args", "rows"):
        assert key in res
    row = res["rows"][0]
    assert row["model"] == "qwen3-tiny" and row["profiled_engine_steps"] >= 9
    pre, dec = row["windows"]["prefill"], row["windows"]["decode"]
    assert pre["summary"]["modes"].get("extend", 0) >= 1
    assert [s["step"] for s in dec["steps"]] == [5, 6, 7, 8] and dec["summary"]["modes"] == {"decode": 4}
    for w in (pre, dec):
        sm, steps = w["summary"], w["steps"]
        assert sm["device_timeline"] == "cpu"
        for s in steps:
            assert 0 <= s["busy_us"] <= s["wall_us"] + 1e-6
            assert s["idle_us"] == pytest.approx(s["wall_us"] - s["busy_us"], abs=1e-6)
            assert s["largest_gap_us"] <= s["idle_us"] + 1e-6
        n = len(steps)
        assert sm["mean_wall_ms"] * n == pytest.approx(sum(s["wall_us"] for s in steps) / 1e3)
        assert sm["mean_idle_ms"] == pytest.approx(sm["mean_wall_ms"] - sm["mean_busy_ms"])
        assert 0 <= sm["idle_share"] < 1
        assert sum(sm["idle_us_per_step_by_kind"].values()) == pytest.approx(sm["mean_idle_ms"] * 1e3, rel=1e-6)
        assert {"launch", "forward", "sample"} <= set(sm["host_us_per_step_by_phase"])
        assert all(st["batch_size"] >= 1 for st in steps if st["mode"] == "decode")
