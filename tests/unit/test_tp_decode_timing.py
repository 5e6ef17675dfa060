"""`benchmarks/tp_decode.run_with_decode_timing`: the decode span timed inside one run (CPU,
tiny dummy Llama). It must give the tokens `LLM.generate` gives, a decode span inside the
run's wall, and one decode step for every token after the first."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams


def _tp_decode():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tp_decode.py"
    spec = importlib.util.spec_from_file_location("tp_decode_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_span_timed_inside_one_run():
    run_with_decode_timing = _tp_decode().run_with_decode_timing
    llm = LLM("llama-tiny", load_format="dummy", device="cpu")
    try:
        new_tokens = 12
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        prompts = [[1 + i, 2, 3, 4 + 2 * i, 5] for i in range(5)]
        ref = [o.token_ids for o in llm.generate(prompts, sp)]
        wall, decode_s, steps = run_with_decode_timing(llm, prompts, sp)
        assert 0.0 < decode_s < wall
        # the first token comes from the prefill; overlap may launch one step past the end
        assert new_tokens - 1 <= steps <= new_tokens
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref  # nothing left behind
    finally:
        llm.shutdown()


def test_variant_summary_takes_each_variants_median_over_rounds():
    """Rows of two variants in three alternating rounds (and one row of another request count):
    one summary per (model, tp, requests, env), medians of its rounds, rounds listed in order."""
    variant_summary = _tp_decode().variant_summary
    rows = []
    for rnd, (a, b) in enumerate([(0.40, 0.35), (0.38, 0.37), (0.50, 0.36)]):
        for env, prefill in (({"X": "0"}, a), ({"X": "1", "Y": "2"}, b)):
            rows.append(dict(model="m", tp=4, requests=64, env=env, prefill_s=prefill, wall_s=prefill + 1.0,
                             decode_ms_per_step_in_run=3.0 + rnd, output_tokens_per_s=100.0 * (rnd + 1)))
    rows.append(dict(model="m", tp=4, requests=1, env={"X": "0"}, prefill_s=0.02, wall_s=0.3,
                     decode_ms_per_step_in_run=2.0, output_tokens_per_s=400.0))
    out = variant_summary(rows)
    assert [(s["requests"], s["env"], s["rounds"]) for s in out] == [
        (64, {"X": "0"}, 3), (64, {"X": "1", "Y": "2"}, 3), (1, {"X": "0"}, 1)]
    assert out[0]["prefill_s"] == 0.40 and out[0]["prefill_s_runs"] == [0.40, 0.38, 0.50]
    assert out[1]["prefill_s"] == 0.36 and out[1]["wall_s"] == pytest.approx(1.36)
    assert out[0]["decode_ms_per_step_in_run"] == 4.0 and out[1]["output_tokens_per_s"] == 200.0
    assert out[2]["prefill_s"] == 0.02
