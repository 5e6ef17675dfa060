"""Overlap scheduling and retraction leave every output unchanged (real SmolLM2, fp32, CPU).

On the CPU overlap is off by default; ``disable_overlap_schedule=False`` forces the overlap
code path (launch step N+1 before processing step N) so it runs in the CPU suite.
"""

import pytest

from attnserve.engine.sampling_params import SamplingParams

PROMPTS = [
    "Hi",
    "What is two plus two?",
    "Tell me a fact about the moon.",
    "List the days of the week.",
    "The quick brown fox",
    "Write one sentence about cats.",
    "Why?",
    "Count from one to ten in words.",
    "Name three colours.",
    "What is the capital of France?",
    "Say hello in French.",
    "Give me a number between one and five.",
    "Describe rain in four words.",
    "Is water wet?",
    "Spell the word cat.",
    "What comes after Monday?",
]


def _params():
    """Mixed stop conditions: EOS allowed, stop strings, stop tokens, different lengths,
    a seeded sampled request and one with a vanishing temperature."""
    out = []
    for i in range(len(PROMPTS)):
        if i % 5 == 1:
            out.append(SamplingParams(max_new_tokens=20, temperature=0.0, stop=[" the", "."]))
        elif i % 5 == 2:
            out.append(SamplingParams(max_new_tokens=9 + i, temperature=0.0, ignore_eos=True))
        elif i % 5 == 3:
            out.append(SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=100 + i))
        elif i % 5 == 4:
            out.append(SamplingParams(max_new_tokens=12, temperature=1e-300))
        else:
            out.append(SamplingParams(max_new_tokens=24, temperature=0.0))
    return out


def _summary(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.matched_stop) for o in outs]


def _assert_idle(llm):
    runner = llm.engine.model_runner
    alloc, rows = runner.token_to_kv_pool_allocator, runner.req_to_token_pool
    tree = llm.engine.scheduler.tree_cache
    assert alloc.available_size() + tree.evictable_size() == alloc.size and tree.protected_size() == 0
    assert rows.available_size() == rows.size
    assert not llm.engine.scheduler.has_work()


@pytest.fixture(scope="module")
def baseline(llm):
    outs = llm.generate(PROMPTS, _params(), chat=True)
    assert llm.engine.scheduler.overlap is False
    return _summary(outs)


def test_overlap_outputs_identical(llm_factory, baseline):
    llm = llm_factory(disable_overlap_schedule=False)
    assert llm.engine.scheduler.overlap is True
    outs = llm.generate(PROMPTS, _params(), chat=True)
    assert _summary(outs) == baseline
    assert any(o.finish_reason == "stop" and isinstance(o.matched_stop, str) for o in outs)
    for o, p in zip(outs, _params()):
        assert len(o.token_ids) <= p.max_new_tokens
        if p.ignore_eos:
            assert len(o.token_ids) == p.max_new_tokens and o.finish_reason == "length"
    _assert_idle(llm)
    assert llm.engine.scheduler.stats.discarded_tokens >= 0


def test_retraction_keeps_outputs(llm_factory, baseline):
    """A pool far below 16 requests' worst case (prompt + max_new_tokens): the scheduler
    admits by estimate, runs out of pages while decoding, retracts, and re-prefills; every
    output is the same as with a large pool."""
    from attnserve.engine.scheduler import AdmissionPolicy

    llm = llm_factory(disable_overlap_schedule=False, max_total_tokens=192, page_size=4)
    sched = llm.engine.scheduler
    sched.policy = AdmissionPolicy(init_ratio=0.05, min_ratio=0.01)  # admit optimistically
    sched.new_token_ratio = sched.policy.init_ratio
    outs = llm.generate(PROMPTS, _params(), chat=True)
    assert sched.stats.num_retractions > 0
    assert any(o.token_ids for o in outs)
    assert _summary(outs) == baseline
    _assert_idle(llm)


def test_abort_mid_decode_frees_the_pool(llm_factory):
    llm = llm_factory(disable_overlap_schedule=False)
    eng = llm.engine
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(eng.tokenize(p, chat=True), sp) for p in PROMPTS[:4]]
    while len(reqs[1].output_ids) < 5:
        eng.step()
    assert eng.abort_request(reqs[1].rid)
    while any(not r.finished for r in reqs):
        eng.step()
    eng.scheduler.flush()
    assert reqs[1].finish_reason.value == "abort" and len(reqs[1].output_ids) < 30
    assert all(len(r.output_ids) == 30 for i, r in enumerate(reqs) if i != 1)
    for r in reqs:
        eng.scheduler.forget(r.rid)
    _assert_idle(llm)


def test_fault_in_one_step_fails_only_its_requests(llm_factory):
    """A forward that raises for one step (a newcomer's prefill) fails that step's request
    alone: the requests decoding in the pending step keep their tokens and finish exactly
    as without the fault, and the pool empties."""
    llm = llm_factory(disable_overlap_schedule=False)
    eng = llm.engine
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(PROMPTS[:3], sp, chat=True)]
    reqs = [eng.add_request(eng.tokenize(p, chat=True), sp) for p in PROMPTS[:3]]
    while min(len(r.output_ids) for r in reqs) < 3:
        eng.step()
    newcomer = eng.add_request(eng.tokenize(PROMPTS[5], chat=True), sp)
    runner = eng.model_runner
    original = runner.forward

    def flaky(fb, *a, **kw):
        if fb.forward_mode.is_extend():
            raise RuntimeError("injected failure")
        return original(fb, *a, **kw)

    runner.forward = flaky
    try:
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
    finally:
        runner.forward = original
    assert eng.scheduler.failed_reqs == [newcomer]
    eng.abort_request(newcomer.rid)
    while eng.has_work():
        eng.step()
    assert [r.output_ids for r in reqs] == ref
    for r in reqs + [newcomer]:
        eng.scheduler.forget(r.rid)
    _assert_idle(llm)
