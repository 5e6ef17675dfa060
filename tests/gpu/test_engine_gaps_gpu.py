"""`EngineProbe` + `engine_gaps.analyse` on a CUDA engine with graphs: the trace's kernels are
linked to their launch calls, graph kernels to the ``forward.graph_replay`` range, and the
per-step arithmetic holds. Dummy SmolLM2-shape weights, greedy, every request ends by length."""

import random

import pytest

pytestmark = [pytest.mark.cuda]


def test_probe_window_on_cuda_graph_decode(tmp_path):
    from attnserve import LLM, SamplingParams
    from attnserve.bench.engine_gaps import analyse, load_trace
    from attnserve.bench.engine_probe import EngineProbe, ProfileWindow

    rnd = random.Random(0)
    prompts = [[rnd.randrange(100, 40000) for _ in range(rnd.randrange(20, 200))] for _ in range(16)]
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM("smollm2-135m", load_format="dummy", device="cuda", context_length=1024, max_running_requests=32,
             max_total_tokens=40000) as llm:
        assert llm.engine.model_runner.cuda_graph_runner is not None
        llm.generate(prompts, sp)  # warm-up
        llm.engine.scheduler.flush_prefix_cache()
        plain = [o.token_ids for o in llm.generate(prompts, sp)]
        llm.engine.scheduler.flush_prefix_cache()
        win = ProfileWindow("decode", 10, 12, lead=3, tail=2)
        probe = EngineProbe(llm.engine, [win], str(tmp_path)).install()
        probe.arm()
        probed = [o.token_ids for o in llm.generate(prompts, sp)]
        probe.uninstall()
    assert probed == plain  # same batches, bf16, graphs: the probe changes no result
    rep = analyse(load_trace(win.trace_path), probe.infos, 10, 22)
    sm = rep.summary
    assert sm["device_timeline"] == "cuda"
    assert sm["launch_attributed_share"] >= 0.9  # kernels carry the correlation id of their launch
    assert sm["modes"] == {"decode": 12} and sm["mean_batch"] == 16
    assert sm["device_us_per_step_by_launch_phase"].get("forward.graph_replay", 0) > 0
    assert sm["device_us_per_step_by_class"].get("attention", 0) > 0
    assert sm["device_us_per_step_by_class"].get("gemm", 0) > 0
    for s in rep.steps:
        assert 0 < s["busy_us"] <= s["wall_us"] + 1e-6
        assert s["idle_us"] == pytest.approx(s["wall_us"] - s["busy_us"], abs=1e-6)
        assert s["kernel_us"] > 0
    assert sum(g["dur_us"] for g in rep.gaps) == pytest.approx(sum(s["idle_us"] for s in rep.steps), rel=1e-9,
                                                              abs=1e-3)
