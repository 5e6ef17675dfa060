"""`benchmarks/tp_decode.run_with_decode_timing`: the decode span timed inside one run (CPU,
tiny dummy Llama). It must give the tokens `LLM.generate` gives, a decode span inside the
run's wall, and one decode step for every token after the first."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
