"""`attnserve.engine.step_trace`: the opt-in per-step trace (issue 33, item 5) on a CPU engine
and its summary on hand-made rows."""

import pytest

from attnserve.engine.step_trace import ENV, attach_step_trace, read_trace, summarize_trace


def _row(t, mode, arrived=0, extend_reqs=0, extend_tokens=0, running=0):
    r = {"t": t, "dt": 1.0, "mode": mode, "bs": max(extend_reqs, running), "extend_reqs": extend_reqs,
         "extend_tokens": extend_tokens, "arrived": arrived, "running": running, "waiting": 0, "returned": 0}
    if arrived:
        r["arrive_t"] = [t - 0.5, t - 0.25]
    return r


def test_summary_skips_the_warmup_burst_and_counts_the_trickle():
    rows = [_row(1, "extend", 2, 2, 20, 2), _row(2, "decode", running=2), _row(3, None),  # warm-up of 2
            _row(10, "extend", 1, 1, 100, 1), _row(11, "decode", running=1), _row(12, "decode", running=1),
            _row(13, "extend", 3, 3, 250, 4), _row(14, "decode", running=4), _row(15, None)]
    s = summarize_trace(rows, 4)
    assert s["steps"] == 5 and s["extend_steps"] == 2 and s["decode_steps"] == 3
    assert s["arrival_steps"] == 4  # the steps at t=10 .. t=13
    assert s["arrival_ms"] == pytest.approx(1e3 * (12.75 - 9.5))
    assert s["extend_tokens"] == 350 and s["mean_extend_tokens"] == 175 and s["max_running"] == 4
    assert s["seconds"] == pytest.approx(14 - (10 - 1))
    with pytest.raises(ValueError):
        summarize_trace(rows, 7)


def test_off_by_default_and_one_row_per_step_on_a_cpu_engine(tmp_path, monkeypatch):
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    monkeypatch.delenv(ENV, raising=False)
    llm = LLM("qwen3-tiny", load_format="dummy", device="cpu", chunked_prefill_size=64)
    try:
        engine = llm.engine
        assert "step" not in vars(engine) and attach_step_trace(engine) is None  # off: nothing attached
        trace = attach_step_trace(engine, str(tmp_path / "t"))
        assert "step" in vars(engine)
        prompts = [[5 + i] * n for i, n in enumerate((40, 30, 20))]
        steps0 = engine.scheduler.num_steps
        llm.generate(prompts, [SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)] * 3)
        trace.close()
        rows = read_trace(trace.path)
        launched = [r for r in rows if r["mode"] is not None]
        assert len(launched) == engine.scheduler.num_steps - steps0
        assert rows[0]["arrived"] == 3 and sum(r["arrived"] for r in rows) == 3
        ext = [r for r in launched if r["extend_reqs"]]
        assert [r["extend_tokens"] for r in ext] == [64, 26]  # 90 prompt tokens in 64-token chunks
        assert sum(r["mode"] == "decode" for r in launched) >= 3  # 4 tokens each: the first comes with prefill
        s = summarize_trace(rows, 3)
        assert s["extend_steps"] == 2 and s["arrival_steps"] == 1 and s["max_running"] == 3
    finally:
        llm.engine.shutdown()
