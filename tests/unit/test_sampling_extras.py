"""Logit controls and logprobs without a model (issue 35): the batched device rules against
HF's ``LogitsProcessor`` implementations (repetition penalty, min new tokens, sequence
bias) and OpenAI's frequency/presence formula on fixed logits, step after step with the
counts kept on the device; logprob maths against ``log_softmax``; the prompt-logprob plan
over chunked prefill and a retraction; parameter validation."""

from collections import Counter

import pytest
import torch

from attnserve.engine.logprobs import plan_prompt_logprobs, token_logprob_stats
from attnserve.engine.request import Req
from attnserve.engine.sampling_extras import SamplingExtras
from attnserve.engine.sampling_params import SamplingParams

lp = pytest.importorskip("transformers.generation.logits_process")

V = 48
EOS = 1


def _req(rid, prompt, **kw):
    sp = SamplingParams(max_new_tokens=16, **kw)
    return Req(rid=rid, prompt_ids=list(prompt), sampling_params=sp, max_total_len=64)


def _reference(raw_row, req, eos):
    """The four rules on one row with HF's processors and OpenAI's formula written out."""
    p = req.sampling_params
    seq = torch.tensor([req.prompt_ids + req.output_ids])
    x = raw_row[None].clone()
    if p.logit_bias:
        x = lp.SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in p.logit_bias.items()])(seq, x)
    if p.min_tokens:
        stop = sorted(set(p.stop_token_ids or ()) | (set() if p.ignore_eos else {eos}))
        x = lp.MinNewTokensLengthLogitsProcessor(len(req.prompt_ids), p.min_tokens, stop)(seq, x)
    if p.repetition_penalty != 1.0:
        x = lp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seq, x)
    x = x[0]
    for tok, c in Counter(req.output_ids).items():  # OpenAI: mu[j] - c[j] * a_freq - float(c[j] > 0) * a_pres
        x[tok] = x[tok] - c * p.frequency_penalty - float(c > 0) * p.presence_penalty
    return x


def _close(a, b):
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin) and torch.equal(a[~fin], b[~fin])
    torch.testing.assert_close(a[fin], b[fin], rtol=1e-6, atol=1e-5)


def test_controls_match_hf_processors_over_steps():
    torch.manual_seed(0)
    extras = SamplingExtras("cpu", [EOS], V)
    extras.controls.initial_slots = 2  # grows twice below
    reqs = [
        _req("a", [5, 6, 7, 5], repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
        _req("b", [8, 9]),  # no controls: its row must stay exactly as it was
        _req("c", [3, 4], logit_bias={3: 5.0, 7: -100.0, 40: 2.5}),
        _req("d", [2, 2, 2], min_tokens=3, stop_token_ids=[9]),
        _req("e", [11], frequency_penalty=-1.0, presence_penalty=2.0, min_tokens=1, ignore_eos=True,
             repetition_penalty=0.7),
    ]
    for r in reqs:
        extras.register(r)
    picks = [[5, 8, 3, 1, 12], [5, 2, 7, 9, 12], [6, 8, 3, 4, 13], [5, 8, 40, 1, 12]]  # repeats on purpose
    for step, ids in enumerate(picks):
        if step == 2:  # "a" finishes; "f" takes its slot, which must start from zero counts
            extras.forget(reqs[0])
            reqs[0] = _req("f", [5], presence_penalty=1.0, frequency_penalty=2.0)
            extras.register(reqs[0])
        raw = torch.randn(len(reqs), V) * 3
        processed, pending = extras.before_sampling(reqs, raw.clone())
        assert pending is not None
        for i, r in enumerate(reqs):
            _close(processed[i], _reference(raw[i], r, EOS))
        assert torch.equal(processed[1], raw[1])
        next_ids = torch.tensor(ids)
        assert extras.after_sampling(pending, next_ids, None, [], reqs) is None  # no logprobs asked
        for r, t in zip(reqs, ids):
            r.output_ids.append(t)
    assert extras.controls.capacity >= 4 and reqs[1].control_slot is None


def test_requests_without_extras_pay_nothing():
    extras = SamplingExtras("cpu", [EOS], V)
    reqs = [_req("x", [1, 2]), _req("y", [3], temperature=0.0)]
    for r in reqs:
        extras.register(r)
    logits = torch.randn(2, V)
    out, pending = extras.before_sampling(reqs, logits)
    assert out is logits and pending is None and extras.controls.tensors == {}
    assert extras.after_sampling(None, None, None, []) is None


def test_logprobs_are_of_the_raw_logits_and_sorted():
    torch.manual_seed(1)
    extras = SamplingExtras("cpu", [EOS], V)
    reqs = [_req("p", [4], logprobs=True, top_logprobs=5, frequency_penalty=2.0, logit_bias={0: 50.0}),
            _req("q", [4]), _req("r", [6], logprobs=True)]
    for r in reqs:
        extras.register(r)
    raw = torch.randn(3, V) * 4
    processed, pending = extras.before_sampling(reqs, raw.clone())
    assert int(processed[0].argmax()) == 0  # the bias acts on sampling ...
    ids = torch.tensor([0, 3, 7])
    launched = extras.after_sampling(pending, ids, None, [], reqs)
    extras.deliver(launched, reqs)
    ref = torch.log_softmax(raw, dim=-1)  # ... but logprobs are of the model's own distribution
    rec = reqs[0].logprobs
    assert rec.output_token_logprobs[0] == pytest.approx(float(ref[0, 0]), abs=1e-5)
    top = rec.output_top_logprobs[0]
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    assert [v for _, v in top] == pytest.approx(ref[0].topk(5).values.tolist(), abs=1e-5)
    assert reqs[1].logprobs is None
    assert reqs[2].logprobs.output_token_logprobs == [pytest.approx(float(ref[2, 7]), abs=1e-5)]
    assert reqs[2].logprobs.output_top_logprobs == [[]]


def test_token_logprob_stats_layout():
    torch.manual_seed(2)
    logits = torch.randn(4, 1000) * 5
    targets = torch.tensor([3, 999, 0, 500])
    out = token_logprob_stats(logits, targets, 3)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out[:, 0], ref.gather(1, targets[:, None])[:, 0])
    torch.testing.assert_close(out[:, 1:4], ref.topk(3).values)
    assert torch.equal(out[:, 4:].long(), ref.topk(3).indices)
    assert (out[:, 1:4].exp().sum(1) <= 1).all() and (out[:, 1:4].diff(dim=1) <= 0).all()


def test_prompt_plan_chunks_and_retraction():
    prompt = list(range(100, 110))
    other = _req("o", [1, 2, 3])
    r = _req("p", prompt, prompt_logprobs=True)
    extras = SamplingExtras("cpu", [EOS], 200)
    extras.register(other)
    extras.register(r)
    seen = []
    for p, e in [(0, 4), (4, 4), (8, 2)]:  # chunked prefill, "other" first in each batch
        plan, owners = plan_prompt_logprobs([other, r], [0, p], [3, e])
        seen += [(int(i) - 3 + p, int(t)) for i, t in zip(plan.token_index, plan.targets)]
        assert owners == [(r, plan.token_index.numel())]
    assert seen == [(q, prompt[q + 1]) for q in range(9)]  # positions 0..8, each once
    assert not r.logprobs.prompt_pending
    r2 = _req("p2", prompt, prompt_logprobs=True, logprobs=True, top_logprobs=2)
    extras.register(r2)
    plan, _ = plan_prompt_logprobs([r2], [0], [6])
    assert plan.token_index.tolist() == list(range(6)) and plan.k == 2
    plan, _ = plan_prompt_logprobs([r2], [0], [10])  # retracted: prefills from 0 again
    assert plan.token_index.tolist() == [6, 7, 8]
    assert plan_prompt_logprobs([r2], [10], [1]) == (None, [])


@pytest.mark.parametrize("kw,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20}, "min_tokens"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_new_tokens=16, **kw)


def test_logit_bias_outside_vocabulary_is_refused_at_admission():
    extras = SamplingExtras("cpu", [EOS], V)
    with pytest.raises(ValueError, match="logit_bias key 48 is not a token id"):
        extras.register(_req("z", [1], logit_bias={48: 1.0}))
    spec = SamplingExtras("cpu", [EOS], V, speculative=True)
    with pytest.raises(ValueError, match="speculative"):
        spec.register(_req("s", [1], logprobs=True))
