"""Serving-limit flags at their edges: SGLang's ``--chunked-prefill-size -1`` (prompts prefilled
whole), a page larger than the KV pool, and a pool that is not a whole number of pages."""

import pytest

from attnserve.engine.engine import Engine
from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server_args import ServerArgs

TINY = dict(model="llama-tiny", load_format="dummy", device="cpu")  # 512-token context, 256-token vocabulary


def _prompts(lengths, seed=0):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _extend_steps(llm):
    """Record every prefill step's (request lengths) as the scheduler launches them."""
    steps = []
    sched = llm.engine.scheduler
    launch = sched._launch

    def recording(batch):
        if batch.forward_mode.is_extend():
            steps.append(list(batch.extend_lens))
        return launch(batch)

    sched._launch = recording
    return steps


def test_chunked_prefill_minus_one_prefills_every_prompt_whole():
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = _prompts([200, 200, 200, 60])
    with LLM(**TINY, max_total_tokens=4096) as base:
        expected = [o.token_ids for o in base.generate(prompts, sp)]
    with LLM(**TINY, max_total_tokens=4096, chunked_prefill_size=-1) as llm:
        limits = llm.engine.model_runner.serving_limits
        assert limits.chunked_prefill_size == 512 and not limits.chunk_prompts  # the step budget: the context
        steps = _extend_steps(llm)
        outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == expected
    # 200 + 200 fit the 512-token budget; the third prompt would be split there, so it waits
    # for the next step (where the fourth joins it), and no prompt is ever cut
    assert steps == [[200, 200], [200, 60]]


def test_chunked_prefill_splits_prompts_otherwise():
    with LLM(**TINY, max_total_tokens=4096, chunked_prefill_size=300) as llm:
        steps = _extend_steps(llm)
        llm.generate(_prompts([200, 200]), SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert steps == [[200, 100], [100]]


def test_page_larger_than_the_pool_is_refused_and_pools_are_whole_pages():
    with pytest.raises(ValueError, match=r"--page-size 100000 is larger than the KV pool"):
        Engine(ServerArgs(**TINY, page_size=100000))  # the CPU default pool is 32,768 tokens
    engine = Engine(ServerArgs(**TINY, page_size=4, max_total_tokens=10))
    try:  # rounded down to whole pages, and the limits say what the pool holds
        assert engine.model_runner.max_total_num_tokens == 8
        assert engine.model_runner.serving_limits.max_total_tokens == 8
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kwargs,match", [
    (dict(context_length=0), "--context-length must be >= 1"),
    (dict(context_length=-5), "--context-length must be >= 1"),
    (dict(chunked_prefill_size=-2), "--chunked-prefill-size must be >= 1, or -1"),
    (dict(log_level="bogus"), "--log-level must be one of"),
])
def test_flag_values_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**TINY, **kwargs).check()


def test_schedule_conservativeness_reaches_the_scheduler():
    engine = Engine(ServerArgs(**TINY, max_total_tokens=512, schedule_conservativeness=2.0))
    try:
        policy = engine.scheduler.policy
        assert (policy.init_ratio, engine.scheduler.new_token_ratio) == (1.0, 1.0)
        assert policy.min_ratio == pytest.approx(0.14)
    finally:
        engine.shutdown()
