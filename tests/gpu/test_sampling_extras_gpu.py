"""Logprobs and logit controls on the GPU (issue 35), with CUDA graphs and overlap scheduling:
dummy SmolLM2-shape weights, float32 and batch-invariant attention (`EXACT`) so that a
request's logits do not depend on its batch.

* Overlap on and off give the same tokens and logprobs for a batch mixing penalties,
  ``logit_bias``, ``min_tokens``, logprobs and plain requests (the penalty counts are
  updated on the device from the sampled ids, ahead of the host).
* Output and prompt logprobs equal ``log_softmax`` of a plain float32 forward of the same
  sequence within 1e-3; top lists are sorted and start with the greedy token.
"""

import random

import pytest
import torch

from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams as SP
from attnserve.forward_batch import ForwardMode
from attnserve.server_args import ServerArgs

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tf32")]

EXACT = dict(dtype="float32", enable_deterministic_inference=True)


def _engine(**kw):
    base = dict(model="smollm2-135m", load_format="dummy", device="cuda", max_total_tokens=40000,
                max_running_requests=32, context_length=1024, **EXACT)
    base.update(kw)
    return Engine(ServerArgs(**base))


def _prompts(n, seed, lo=20, hi=120):
    rnd = random.Random(seed)
    return [[rnd.randrange(100, 40000) for _ in range(rnd.randrange(lo, hi))] for _ in range(n)]


def _run(engine, prompts, params):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    return reqs


def _params(eos):
    out = []
    for i in range(12):
        kind = i % 6
        if kind == 0:
            out.append(SP(max_new_tokens=24, temperature=0.0, ignore_eos=True))
        elif kind == 1:
            out.append(SP(max_new_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                          presence_penalty=0.5, repetition_penalty=1.3, logprobs=True, top_logprobs=5))
        elif kind == 2:
            out.append(SP(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=20))
        elif kind == 3:
            out.append(SP(max_new_tokens=24, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=4 + i))
        elif kind == 4:
            out.append(SP(max_new_tokens=24, temperature=0.9, seed=i, ignore_eos=True, frequency_penalty=-1.0,
                          logit_bias={101: 5.0, 202: -100.0}))
        else:
            out.append(SP(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=True))
    return out


def test_extras_same_with_and_without_overlap():
    prompts = _prompts(12, 3)
    results = {}
    for overlap in (False, True):
        eng = _engine(disable_overlap_schedule=not overlap)
        assert eng.scheduler.overlap is overlap and eng.model_runner.cuda_graph_runner is not None
        eos = eng.scheduler.eos_token_ids[0]
        reqs = _run(eng, prompts, _params(eos))
        results[overlap] = reqs
        for i, r in enumerate(reqs):
            if i % 6 == 3:
                assert len(r.output_ids) == 5 + i and r.output_ids[-1] == eos  # min_tokens, then the biased EOS
            if i % 6 == 4:
                assert 202 not in r.output_ids
        controls = eng.scheduler.extras.controls
        assert sorted(controls.free) == list(range(controls.capacity))
        eng.shutdown()
    for a, b in zip(results[False], results[True]):
        assert a.output_ids == b.output_ids
        if a.logprobs is not None and a.logprobs.output:
            assert a.logprobs.output_token_logprobs == pytest.approx(b.logprobs.output_token_logprobs, abs=1e-4)


def test_logprobs_equal_log_softmax_of_a_plain_forward():
    eng = _engine()
    prompts = _prompts(4, 9)
    sp = SP(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5,
            prompt_logprobs=True)
    reqs = _run(eng, prompts, [sp] * 4)
    runner = eng.model_runner
    for r in reqs:
        seq = r.prompt_ids + r.output_ids
        row = runner.req_to_token_pool.alloc(1)[0]
        slots = runner.token_to_kv_pool_allocator.alloc_extend([0], [len(seq)], [0])
        try:
            runner.req_to_token_pool.write(row, 0, slots)
            fb = runner.build_forward_batch(ForwardMode.EXTEND, seq, [row], [0], [len(seq)], slots)
            ref = torch.log_softmax(runner.forward(fb, return_all_logits=True).float(), dim=-1).cpu()
        finally:
            runner.token_to_kv_pool_allocator.free(slots)
            runner.req_to_token_pool.free(row)
        ids = torch.tensor(seq)
        want = ref[:-1].gather(1, ids[1:, None])[:, 0]
        rec = r.logprobs
        got = torch.tensor(rec.prompt_token_logprobs[1:] + rec.output_token_logprobs)
        assert rec.prompt_token_logprobs[0] is None and (got - want).abs().max() < 1e-3
        for tok, top in zip(r.output_ids, rec.output_top_logprobs):
            vals = [v for _, v in top]
            assert top[0][0] == tok and vals == sorted(vals, reverse=True)
    eng.shutdown()
