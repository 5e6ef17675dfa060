"""Admission's host work on a capped KV pool (issue 33, item 4; issue 38's 1,024-prompt
workload): requests wait while the pool is full and are admitted as others finish.

`reserved_tokens` (the running requests' estimated future KV, summed at every step while
requests wait) must be bit-identical to the sum of `Scheduler._future_tokens` it replaces,
so that admission decisions are unchanged; the scheduler must not call the per-request
estimate for every running request at every step; and `Req` compares by identity, so that
removing a finished request from the running batch is a C-level scan.
"""

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.engine import scheduler as scheduler_mod
from attnserve.engine.request import Req
from attnserve.engine.scheduler import Scheduler

NUM_REQS = 40


def _workload():
    g = torch.Generator().manual_seed(11)
    lens = torch.randint(8, 48, (NUM_REQS,), generator=g).tolist()
    outs = torch.randint(4, 40, (NUM_REQS,), generator=g).tolist()
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]
    params = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True) for m in outs]
    return prompts, params, sum(lens) + sum(outs)


@pytest.fixture(scope="module")
def capped():
    """llama-tiny whose KV pool holds about a third of the workload's tokens at once."""
    _, _, total = _workload()
    llm = LLM("llama-tiny", load_format="dummy", device="cpu", max_total_tokens=total // 3,
              max_running_requests=NUM_REQS, disable_overlap_schedule=True)
    yield llm
    llm.shutdown()


def _reference_reserved(running, ratio, page_size):
    """The sum the scheduler computed before `reserved_tokens`: `_future_tokens` per request."""
    sched = _reference_reserved.sched
    assert sched.new_token_ratio == ratio and sched.allocator.page_size == page_size
    return sum(sched._future_tokens(r) for r in running)


def _run(llm, monkeypatch, reference: bool):
    """Run the workload; return (outputs, admission log [(step, rid)], reserved checks)."""
    sched = llm.engine.scheduler
    sched.flush_prefix_cache()
    sched.new_token_ratio = sched.policy.init_ratio  # it decays across runs: start both alike
    log, checks = [], []
    real_admit = Scheduler._admit
    fast = scheduler_mod.reserved_tokens

    prompts, params, _ = _workload()
    index = {tuple(p): i for i, p in enumerate(prompts)}  # rids come from a global counter

    step0 = sched.stats.num_steps

    def admit(self):
        before = {id(r) for r in self.running}
        real_admit(self)
        log.extend((self.stats.num_steps - step0, index[tuple(r.prompt_ids)]) for r in self.running if id(r) not in before)

    def checked(running, ratio, page_size):
        value = fast(running, ratio, page_size)
        checks.append((value, _reference_reserved(running, ratio, page_size), len(running)))
        return checks[-1][1] if reference else value

    _reference_reserved.sched = sched
    monkeypatch.setattr(Scheduler, "_admit", admit)
    monkeypatch.setattr(scheduler_mod, "reserved_tokens", checked)
    outs = llm.generate(prompts, params)
    monkeypatch.undo()
    return outs, log, checks


def test_capped_pool_same_admissions_and_tokens(capped, monkeypatch):
    new_outs, new_log, checks = _run(capped, monkeypatch, reference=False)
    ref_outs, ref_log, _ = _run(capped, monkeypatch, reference=True)
    # the pool was capped: requests waited and were admitted at later steps, as others finished
    assert len({step for step, _ in new_log}) >= 4, new_log
    assert sorted(i for _, i in new_log) == list(range(NUM_REQS))
    assert max(n for _, _, n in checks) >= 4  # the sum ran over several running requests
    # bit for bit: admission compares this value with the free KV
    assert all(fast == ref for fast, ref, _ in checks), [c for c in checks if c[0] != c[1]][:3]
    assert new_log == ref_log
    assert [o.token_ids for o in new_outs] == [o.token_ids for o in ref_outs]
    assert all(len(o.token_ids) == p.max_new_tokens for o, p in zip(new_outs, _workload()[1]))


def test_admission_does_not_estimate_every_running_request(capped, monkeypatch):
    """Per `_admit`, the per-request estimate runs only for the waiting requests it examines,
    not for every running request (it ran len(running) times a step before)."""
    sched = capped.engine.scheduler
    sched.flush_prefix_cache()
    calls = {"future": 0, "admit_with_waiting": 0, "running_sum": 0}
    real_future, real_admit = Scheduler._future_tokens, Scheduler._admit

    def future(self, req, cached=0):
        calls["future"] += 1
        return real_future(self, req, cached)

    def admit(self):
        if self.waiting:
            calls["admit_with_waiting"] += 1
            calls["running_sum"] += len(self.running)
        before = len(self.running)
        real_admit(self)
        calls["admitted"] = calls.get("admitted", 0) + len(self.running) - before

    monkeypatch.setattr(Scheduler, "_future_tokens", future)
    monkeypatch.setattr(Scheduler, "_admit", admit)
    prompts, params, _ = _workload()
    capped.generate(prompts, params)
    # each _admit examines the admitted requests plus at most the one that did not fit
    assert calls["future"] <= calls["admitted"] + calls["admit_with_waiting"], calls
    assert calls["running_sum"] > 4 * (calls["admitted"] + calls["admit_with_waiting"]), calls  # what it was


def test_req_equality_is_identity():
    p = SamplingParams(max_new_tokens=4)
    a = Req(rid="x", prompt_ids=[1, 2], sampling_params=p, max_total_len=6)
    b = Req(rid="x", prompt_ids=[1, 2], sampling_params=p, max_total_len=6)
    assert a != b and a == a
    running = [a, b]
    running.remove(b)  # field-wise equality would remove `a`, the first equal one
    assert running[0] is a
    assert len({a, b}) == 2  # hashable by identity
