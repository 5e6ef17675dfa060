"""The scheduler's per-token fast path (`attnserve.engine.detokenizer.may_stop`) and the
batched DECODE launch give the same results as the general path (issue 33, host time per
decode step)."""

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.engine import scheduler as scheduler_mod
from attnserve.engine.detokenizer import check_stop, may_stop, stop_ids_of
from attnserve.engine.request import Req


def _req(max_new=4, prompt=(5, 6), **kw):
    p = SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)
    r = Req(rid="r", prompt_ids=list(prompt), sampling_params=p, max_total_len=len(prompt) + max_new)
    r.stop_ids = stop_ids_of(r, [2])
    return r


def test_may_stop_is_false_only_when_check_stop_keeps_running():
    cases = [
        (_req(), 7), (_req(), 2), (_req(ignore_eos=True), 2), (_req(stop_token_ids=[9]), 9),
        (_req(stop="x"), 7), (_req(max_new=1), 7), (_req(max_new=2), 7),
    ]
    for req, tok in cases:
        req.output_ids = [3] * (len(req.output_ids))
        fast = may_stop(req, tok, context_len=512)
        req.output_ids.append(tok)
        check_stop(req, None, [2], 512)
        if not fast:  # the fast path may only skip tokens that leave the request running
            assert req.finish_reason is None, (req.sampling_params, tok)
    assert not may_stop(_req(), 7, 512)
    assert may_stop(_req(), 2, 512) and not may_stop(_req(ignore_eos=True), 2, 512)
    assert may_stop(_req(max_new=1), 7, 512) and may_stop(_req(stop="x"), 7, 512)
    assert may_stop(_req(), 7, context_len=3)  # the context length ends it
    r = _req()
    r.stop_ids = None  # unknown stop ids: always the general path
    assert may_stop(r, 7, 512)


@pytest.fixture(scope="module", params=[False, True], ids=["no-overlap", "overlap"])
def tiny(request):
    llm = LLM("llama-tiny", load_format="dummy", device="cpu", max_total_tokens=4096,
              disable_overlap_schedule=not request.param)
    yield llm
    llm.shutdown()


def test_fast_path_matches_general_path(tiny, monkeypatch):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (24,), generator=g)]
    free = tiny.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    # stop on a token each request is known to produce (a stop id, or EOS), or on length
    params = []
    for i, out in enumerate(free):
        if i % 3 == 0:
            params.append(SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[out.token_ids[5]]))
        elif i % 3 == 1:
            params.append(SamplingParams(max_new_tokens=3 + i % 7, temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=i))
    fast = tiny.generate(prompts, params)
    monkeypatch.setattr(scheduler_mod, "may_stop", lambda *a: True)  # every token through _append / check_stop
    general = tiny.generate(prompts, params)
    key = lambda o: (o.token_ids, o.finish_reason, o.matched_stop, o.text)  # noqa: E731
    assert [key(o) for o in fast] == [key(o) for o in general]
    assert sum(o.finish_reason == "stop" for o in fast) >= 8  # the stop ids did end requests early
    assert all(len(o.token_ids) <= 6 for o, p in zip(fast, params) if p.stop_token_ids)
    alloc = tiny.engine.model_runner.token_to_kv_pool_allocator
    tree = tiny.engine.scheduler.tree_cache
    assert alloc.available_size() + tree.evictable_size() == alloc.size and tree.protected_size() == 0
