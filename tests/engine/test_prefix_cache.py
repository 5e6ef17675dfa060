"""Prefix caching end to end (real weights, fp32, CPU): outputs identical with and without
the radix cache, ``cached_tokens`` equal to what was reused, the pool whole afterwards."""

import pytest

from attnserve.engine.sampling_params import SamplingParams

SYSTEM = ("You are a meticulous assistant. Answer in one short sentence, mention the most "
          "important fact first, and never use lists or headings in the answer. ")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name a large mammal.",
             "What do bees make?"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def _chat(llm, turns):
    return llm.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)


def _ids(tok_out):
    return list(tok_out["input_ids"]) if isinstance(tok_out, dict) or hasattr(tok_out, "keys") else list(tok_out)


def _assert_whole(llm):
    sched = llm.engine.scheduler
    alloc = llm.engine.model_runner.token_to_kv_pool_allocator
    assert not sched.has_work()
    assert sched.tree_cache.protected_size() == 0
    assert alloc.available_size() + sched.tree_cache.evictable_size() == alloc.size


def _common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _workload(llm, ps=1):
    """Shared system prompt, exact repeats, a fully cached prompt and a three-turn chat.

    Returns the token ids of every answer and each request's ``cached_tokens``, and checks
    ``cached_tokens`` against what the earlier requests left in the tree: at least the
    longest common prefix with an earlier prompt + output minus its last token (always
    cached), at most with the whole output (cached when an overlap step computed it), cut
    to whole pages and leaving one prompt token to compute."""
    assert llm.engine.scheduler.flush_prefix_cache()  # engines are shared across test modules
    tokens, cached, seen = [], [], []

    def run(prompts):
        outs = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, outs):
            lo = max([_common(p[:-1], s + out[:-1]) for s, out in seen] + [0]) // ps * ps
            hi = max([_common(p[:-1], s + out) for s, out in seen] + [0]) // ps * ps
            if llm.engine.scheduler.radix_enabled:
                assert lo <= o.cached_tokens <= hi, (o.cached_tokens, lo, hi)
            tokens.append(o.token_ids)
            cached.append(o.cached_tokens)
        seen.extend((p, o.token_ids) for p, o in zip(prompts, outs))
        return outs

    shared = [_ids(_chat(llm, [{"role": "user", "content": SYSTEM + q}])) for q in QUESTIONS]
    run(shared[:1])
    run(shared)  # shared prefix (and one exact repeat)
    run(shared[1:2])  # entirely cached prompt
    history = [{"role": "user", "content": SYSTEM + QUESTIONS[0]}]
    for follow_up in ("And of Italy?", "And of Spain?", "Thanks!"):
        out = run([_ids(_chat(llm, history))])[0]
        history += [{"role": "assistant", "content": llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)},
                    {"role": "user", "content": follow_up}]
    return tokens, cached


@pytest.fixture(scope="module")
def reference(llm_factory):
    llm = llm_factory(disable_radix_cache=True)
    tokens, cached = _workload(llm)
    assert cached == [0] * len(cached)
    return tokens


@pytest.mark.parametrize("kw", [dict(), dict(page_size=16), dict(page_size=16, chunked_prefill_size=40),
                                dict(chunked_prefill_size=7, disable_overlap_schedule=False)],
                         ids=["page1", "page16", "page16-chunk40", "page1-chunk7-overlap"])
def test_outputs_identical_and_cached_tokens(llm_factory, reference, kw):
    llm = llm_factory(**kw)
    ps = kw.get("page_size", 1)
    tokens, cached = _workload(llm, ps)
    assert tokens == reference
    first = _ids(_chat(llm, [{"role": "user", "content": SYSTEM + QUESTIONS[0]}]))
    assert cached[0] == 0 and cached[1] == (len(first) - 1) // ps * ps  # exact repeat: all but one token
    assert min(cached[2:5]) > 30 and cached[5] >= cached[2]  # system prompt shared; then fully cached
    assert cached[-1] > cached[-3] > 0 and cached[-2] >= cached[-3]  # each chat turn reuses the last
    _assert_whole(llm)
    stats = llm.engine.scheduler.stats
    assert stats.cached_prompt_tokens >= sum(cached)


def test_gemma3_sliding_window_with_cache(llm_factory):
    """Gemma 3 (sliding-window layers, window 512) with a cached prefix longer than the
    window: same tokens as without the cache."""
    pytest.importorskip("gguf")
    long_system = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(60))
    outs = {}
    for disable in (True, False):
        llm = llm_factory(model="gemma3-270m", disable_radix_cache=disable)
        llm.engine.scheduler.flush_prefix_cache()
        prompts = [llm.tokenizer.encode(long_system + " Question: " + q) for q in QUESTIONS[:2]]
        assert len(prompts[0]) > 560  # past the 512-token window
        first = llm.generate(prompts[:1], GREEDY)
        rest = llm.generate(prompts, GREEDY)
        outs[disable] = [o.token_ids for o in first + rest]
        if not disable:
            assert rest[0].cached_tokens == len(prompts[0]) - 1 and rest[1].cached_tokens > 500
            _assert_whole(llm)
    assert outs[False] == outs[True]


@pytest.mark.parametrize("model,page_size", [("deepseek-v2-tiny", 1), ("deepseek-v2-tiny", 16),
                                             ("llama-tiny", 16)])
def test_random_weight_models_with_cache(llm_factory, model, page_size):
    """MLA (DeepSeek-V2 latent pool) and GQA shapes with random weights: a shared 40-token
    prefix, an exact repeat and a fully cached prompt give the same tokens as without the
    cache, and the pool is whole afterwards."""
    import random

    rnd = random.Random(page_size)
    prefix = [rnd.randrange(3, 200) for _ in range(40)]
    prompts = [prefix + [rnd.randrange(3, 200) for _ in range(n)] for n in (5, 9, 17)]
    prompts += [prompts[0], prompts[1][:30]]
    outs = {}
    for disable in (True, False):
        llm = llm_factory(model=model, load_format="dummy", page_size=page_size, disable_radix_cache=disable)
        llm.engine.scheduler.flush_prefix_cache()
        first = llm.generate(prompts[:1], GREEDY)
        rest = llm.generate(prompts[1:], GREEDY)
        outs[disable] = [o.token_ids for o in first + rest]
        if not disable:
            assert rest[0].cached_tokens >= 40 // page_size * page_size  # the shared prefix
            assert rest[-2].cached_tokens == (len(prompts[0]) - 1) // page_size * page_size  # exact repeat
            assert rest[-1].cached_tokens == 29 // page_size * page_size  # a prompt wholly in the tree
            _assert_whole(llm)
    assert outs[False] == outs[True]


def test_abort_mid_prefill_and_small_pool(llm_factory):
    """A request aborted between two prefill chunks leaves the tree consistent (its
    computed chunks stay cached and serve the next request); a prompt larger than the pool
    is refused with a clear error and the engine goes on."""
    llm = llm_factory(chunked_prefill_size=16, disable_overlap_schedule=False)
    eng, sched = llm.engine, llm.engine.scheduler
    assert sched.flush_prefix_cache()
    prompt = _ids(_chat(llm, [{"role": "user", "content": SYSTEM + QUESTIONS[2]}]))
    req = eng.add_request(prompt, GREEDY)
    while req.kv_len < 40:
        eng.step()
    assert req.is_prefilling
    assert eng.abort_request(req.rid)
    sched.flush()
    sched.forget(req.rid)
    _assert_whole(llm)
    assert sched.tree_cache.evictable_size() >= 32  # the finished chunks were kept
    again = llm.generate([prompt], GREEDY)[0]
    assert again.cached_tokens >= 32
    assert again.token_ids == llm_factory(disable_radix_cache=True).generate([prompt], GREEDY)[0].token_ids
    small = llm_factory(max_total_tokens=48)
    with pytest.raises(ValueError, match="KV pool"):
        small.generate([prompt], GREEDY)
    assert small.generate(["Hi"], SamplingParams(max_new_tokens=4, temperature=0.0))[0].token_ids
    _assert_whole(small)


def test_requests_arriving_together_compute_a_shared_prefix_once(llm_factory):
    """Eight requests that share a 64-token prefix nobody has cached yet arrive in one
    batch: the in-batch check holds the duplicates back one step, so the prefix is
    computed once and seven requests read it from the cache."""
    import random

    llm = llm_factory(model="llama-tiny", load_format="dummy")
    sched = llm.engine.scheduler
    assert sched.flush_prefix_cache()
    rnd = random.Random(3)
    prefix = [rnd.randrange(3, 200) for _ in range(64)]
    prompts = [prefix + [rnd.randrange(3, 200) for _ in range(6)] for _ in range(8)]
    before = sched.stats.cached_prompt_tokens
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.cached_tokens >= 64 for o in outs) == 7
    assert sched.stats.cached_prompt_tokens - before >= 7 * 64
    _assert_whole(llm)


def test_retracted_request_is_not_readmitted_on_its_own_cached_kv(llm_factory):
    """Eight equal requests (64-token prompts, 64 tokens each, ``ignore_eos``) in a pool of
    700 tokens: admitted by estimate, they outgrow the pool near the end and one is
    retracted, its K/V going to the tree. Admission must not count that cached K/V as free
    space (locking it for the re-admitted request takes it out of the evictable pool), or
    the request is re-admitted at once and retracted again every few steps (57
    retractions here before the fix, 1 after). Outputs equal a large pool's."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 250, (64,), generator=g).tolist() for _ in range(8)]
    sp = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm_factory(model="llama-tiny", load_format="dummy").generate(prompts, sp)]
    for radix in (True, False):
        llm = llm_factory(model="llama-tiny", load_format="dummy", max_total_tokens=700, max_running_requests=16,
                          disable_radix_cache=not radix)
        sched = llm.engine.scheduler
        sched.flush_prefix_cache()
        before = sched.stats.num_retractions
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
        assert 1 <= sched.stats.num_retractions - before <= 2, radix
        _assert_whole(llm)
