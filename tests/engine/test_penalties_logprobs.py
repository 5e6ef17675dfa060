"""Logit controls and logprobs through the whole engine (real SmolLM2, float32, CPU; issue 35):
``frequency_penalty`` cuts repetition, logprob lists are well formed, the same outputs with
and without overlap scheduling (the penalty counts are updated on the device, ahead of the
host) and through retraction, requests without extras unaffected by those with them, and
prompt logprobs unchanged by chunked prefill and by a cached prefix (which they bypass).

Engines come from the shared cache (`conftest.llm_factory`), with the flags of
``test_overlap_retract.py``, so the suite builds no extra engine for this file."""

import dataclasses
import math

import pytest

from attnserve.engine.sampling_params import SamplingParams as SP

REPETITIVE = "one two one two one two one two one two one two one two"
PROMPTS = ["What is the capital of France?", "List the days of the week.", "Count from one to ten in words.",
           "Name three colours.", "Tell me a fact about the moon.", "Why?"]
#: plain-text prompts of ~40 tokens without a shared prefix, so that 6 of them overflow a small pool
LONG = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined "
    "movable metal type, oil-based ink and a wooden press into a system that",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light energy into "
    "chemical energy stored in sugars, releasing oxygen as a by-product, and it",
    "In the middle of the ocean, far from any coast, a small research vessel drifted slowly while its crew "
    "measured the temperature of the water at different depths and noticed",
    "Learning to play the violin takes patience: the beginner must first learn how to hold the bow, how to "
    "place the fingers on the strings, and how to listen carefully so that",
    "The old lighthouse keeper climbed the spiral staircase every evening at dusk, carrying a can of oil and a "
    "cloth, because the lamp at the top had to be cleaned and lit before",
    "Modern compilers translate high-level source code into machine instructions through several stages, "
    "including parsing, semantic analysis, optimisation and code generation, and each",
]


def _repeats(ids):
    return len(ids) - len(set(ids))


def _mixed_params(eos):
    """Requests with and without extras side by side (all run to a known length)."""
    n = 10
    return [
        SP(max_new_tokens=n, temperature=0.0, ignore_eos=True),  # no extras
        SP(max_new_tokens=n, temperature=0.0, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5,
           repetition_penalty=1.2, logprobs=True, top_logprobs=3),
        SP(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5),
        SP(max_new_tokens=n, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5),  # exactly 6 tokens
        SP(max_new_tokens=n, temperature=0.8, seed=7, ignore_eos=True, frequency_penalty=2.0,
           logit_bias={28: -100.0}),
        SP(max_new_tokens=n, temperature=0.0, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def mixed(llm):
    """``(params, outputs)`` of the default engine (no overlap, a large pool)."""
    params = _mixed_params(llm.engine.scheduler.eos_token_ids[0])
    return params, llm.generate(LONG, params)


def _summary(outs):
    return [(o.token_ids, o.finish_reason) for o in outs]


def _assert_close_logprobs(a, b):
    for x, y in zip(a, b):
        assert (x.output_token_logprobs is None) == (y.output_token_logprobs is None)
        if x.output_token_logprobs is not None:
            assert x.output_token_logprobs == pytest.approx(y.output_token_logprobs, abs=1e-4)
            assert [[t for t, _ in top] for top in x.output_top_logprobs] == \
                   [[t for t, _ in top] for top in y.output_top_logprobs]


def test_frequency_penalty_reduces_repeats(llm):
    base = llm.generate(REPETITIVE, SP(max_new_tokens=16, temperature=0.0, ignore_eos=True))[0]
    pen = llm.generate(REPETITIVE, SP(max_new_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=2.0))[0]
    assert _repeats(base.token_ids) >= 12  # the model loops on this prompt ...
    assert _repeats(pen.token_ids) < _repeats(base.token_ids) // 2  # ... and the penalty breaks the loop


def test_logprob_lists_are_well_formed(llm):
    outs = llm.generate(PROMPTS[:3], [SP(max_new_tokens=10, temperature=0.0, logprobs=True, top_logprobs=5),
                                      SP(max_new_tokens=10, temperature=0.9, seed=3, logprobs=True, top_logprobs=4),
                                      SP(max_new_tokens=10, temperature=0.0, logprobs=True)], chat=True)
    for o, k, greedy in zip(outs, (5, 4, 0), (True, False, True)):
        assert len(o.output_token_logprobs) == len(o.output_top_logprobs) == len(o.token_ids)
        assert o.prompt_token_logprobs is None
        for tok, lp, top in zip(o.token_ids, o.output_token_logprobs, o.output_top_logprobs):
            assert len(top) == k and lp <= 0
            vals = [v for _, v in top]
            assert vals == sorted(vals, reverse=True) and sum(math.exp(v) for v in vals) <= 1 + 1e-5
            if k and greedy:
                assert top[0] == (tok, pytest.approx(lp, abs=1e-6))
            elif k:
                assert lp <= top[0][1] + 1e-6


def test_same_outputs_with_overlap_and_without_interference(llm, llm_factory, mixed):
    params, ref = mixed
    eos = llm.engine.scheduler.eos_token_ids[0]
    assert len(ref[3].token_ids) == 6 and ref[3].token_ids[-1] == eos and ref[3].finish_reason == "stop"
    assert eos not in ref[3].token_ids[:5]  # min_tokens held the biased EOS off
    assert 28 not in ref[4].token_ids
    alone = llm.generate([LONG[i] for i in (0, 5)], params[0])
    assert _summary(alone) == _summary([ref[0], ref[5]])  # the extras of others change nothing
    overlap = llm_factory(disable_overlap_schedule=False)
    assert overlap.engine.scheduler.overlap
    got = overlap.generate(LONG, params)
    assert _summary(got) == _summary(ref)
    _assert_close_logprobs(got, ref)
    controls = overlap.engine.scheduler.extras.controls
    assert sorted(controls.free) == list(range(controls.capacity)) and controls.capacity > 0  # all given back


def test_retraction_keeps_counts_and_logprobs(llm_factory, mixed):
    """A pool far below the batch's worst case: requests are retracted and prefill again;
    their penalty slots and logprob lists carry over, so outputs equal the large pool's."""
    from attnserve.engine.scheduler import AdmissionPolicy

    params, ref = mixed
    small = llm_factory(disable_overlap_schedule=False, max_total_tokens=192, page_size=4)
    sched = small.engine.scheduler
    sched.policy = AdmissionPolicy(init_ratio=0.05, min_ratio=0.01)  # admit optimistically
    sched.new_token_ratio = sched.policy.init_ratio
    before = sched.stats.num_retractions
    got = small.generate(LONG, params)
    assert sched.stats.num_retractions > before
    assert _summary(got) == _summary(ref)
    _assert_close_logprobs(got, ref)


def test_prompt_logprobs_chunked_and_past_the_cache(llm):
    eng = llm.engine
    ids = eng.tokenize(PROMPTS[4], chat=True)
    sp = SP(max_new_tokens=2, temperature=0.0, prompt_logprobs=True, top_logprobs=2)
    ref = llm.generate(ids, sp)[0]
    assert len(ref.prompt_token_logprobs) == len(ids) and ref.prompt_token_logprobs[0] is None
    assert all(lp <= 0 for lp in ref.prompt_token_logprobs[1:]) and ref.output_token_logprobs is None
    assert all(len(top) == 2 for top in ref.prompt_top_logprobs[1:])
    llm.generate(ids, SP(max_new_tokens=1, temperature=0.0))  # the prompt is now in the prefix cache
    runner = eng.model_runner
    limits = runner.serving_limits
    runner.serving_limits = dataclasses.replace(limits, chunked_prefill_size=5)
    try:
        got = llm.generate([ids, ids], [sp, SP(max_new_tokens=2, temperature=0.0)])
    finally:
        runner.serving_limits = limits
    assert got[0].cached_tokens == 0 and got[1].cached_tokens > 0  # only the logprob request computes it all
    assert got[0].token_ids == ref.token_ids
    assert got[0].prompt_token_logprobs[1:] == pytest.approx(ref.prompt_token_logprobs[1:], abs=1e-4)
    assert [[t for t, _ in top] for top in got[0].prompt_top_logprobs[1:]] == \
           [[t for t, _ in top] for top in ref.prompt_top_logprobs[1:]]


def test_bad_logit_bias_leaves_the_engine_untouched(llm):
    with pytest.raises(ValueError, match="logit_bias key 49152"):
        llm.generate(["a", "b"], [SP(max_new_tokens=2), SP(max_new_tokens=2, logit_bias={49152: 1.0})])
    assert not llm.engine.has_work()
