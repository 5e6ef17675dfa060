"""Continuous batching: results do not depend on what else is in the batch."""

import pytest

from attnserve.engine.sampling_params import SamplingParams

PROMPTS = [
    "Hi",
    "What is two plus two?",
    "Tell me a fact about the moon and another about the sun, please.",
    "List the days of the week.",
    "The quick brown fox",
    "Write one sentence about cats that mentions whiskers, naps and sunshine.",
    "Why?",
    "Count from one to ten in words, separated by commas, and then say done.",
]


@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_equals_alone(llm_factory, page_size):
    llm = llm_factory(page_size=page_size)
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    together = llm.generate(PROMPTS, sp, chat=True)
    for prompt, out in zip(PROMPTS, together):
        alone = llm.generate([prompt], sp, chat=True)[0]
        assert out.token_ids == alone.token_ids, prompt
    alloc = llm.engine.model_runner.token_to_kv_pool_allocator
    tree = llm.engine.scheduler.tree_cache
    # every finished request gave its KV back (to the allocator, or cached and unlocked)
    assert alloc.available_size() + tree.evictable_size() == alloc.size and tree.protected_size() == 0


def test_chunked_and_mixed_prefill_match(llm_factory):
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    base = [o.token_ids for o in llm_factory().generate(PROMPTS, sp, chat=True)]
    chunked = llm_factory(chunked_prefill_size=7, enable_mixed_chunk=True, page_size=4)
    assert [o.token_ids for o in chunked.generate(PROMPTS, sp, chat=True)] == base


def test_small_kv_pool_queues_instead_of_failing(llm_factory):
    """With room for ~2 requests at a time the rest wait; all finish with the same tokens."""
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    base = [o.token_ids for o in llm_factory().generate(PROMPTS, sp, chat=True)]
    small = llm_factory(max_total_tokens=160)
    assert [o.token_ids for o in small.generate(PROMPTS, sp, chat=True)] == base


def test_stop_strings_tokens_and_seeds(llm):
    out = llm.generate(["What is the capital of France?"], SamplingParams(max_new_tokens=32, temperature=0.0,
                                                                          stop=["Paris"]), chat=True)[0]
    assert out.finish_reason == "stop" and out.matched_stop == "Paris" and "Paris" not in out.text
    greedy = llm.generate(["Say hello."], SamplingParams(max_new_tokens=8, temperature=0.0), chat=True)[0]
    stop_id = greedy.token_ids[2]
    out = llm.generate(["Say hello."], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                      stop_token_ids=[stop_id]), chat=True)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id and len(out.token_ids) <= 3
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = llm.generate(["Tell me a story."], sp, chat=True)[0]
    b = llm.generate(["Tell me a story.", "Other request"], [sp, SamplingParams(max_new_tokens=5)], chat=True)[0]
    assert a.token_ids == b.token_ids  # seeded sampling is batch-independent
    assert len(a.token_ids) == 12 and a.finish_reason == "length"
