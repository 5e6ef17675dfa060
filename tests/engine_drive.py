"""Drive an `Engine` synchronously in tests: add requests, step until idle, read the tokens."""

from __future__ import annotations

from typing import List


def greedy_generate(engine, prompts: List[List[int]], max_new: int = 24) -> List[List[int]]:
    """Greedy ``max_new`` tokens (EOS ignored) for each prompt, all admitted before the first step."""
    from attnserve.engine.sampling_params import SamplingParams

    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
            for p in prompts]
    while engine.has_work():
        engine.step()
    return [r.output_ids for r in reqs]
