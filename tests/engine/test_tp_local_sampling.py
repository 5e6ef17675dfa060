"""Tensor parallelism: every rank samples a step itself (`step_sync.LocalSampling`) instead
of receiving rank 0's ids, on CPU ranks (gloo), float32, a 2-layer Llama with random
weights and a tiny BPE tokenizer (`grammar_fixtures`). Tokens must equal tp 1's for greedy,
seeded and unseeded temperature sampling with top-k / top-p / min-p, with overlap
scheduling; a step with a grammar-constrained row or a logit control falls back to the
broadcast; ``ATTNSERVE_TP_SAMPLE=broadcast`` forces the broadcast for every step.

A rank whose ids differed from rank 0's would feed different input ids to its next
forward, so rank 0's own tokens (summed over the ranks by the embedding's all-reduce)
would drift from tp 1's: comparing tokens checks every rank's sampling.
"""

import multiprocessing as mp
import os

import pytest

from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.tp.step_sync import TP_SAMPLE_ENV
from grammar_fixtures import tiny_model_dir

pytest.importorskip("xgrammar")

PROMPTS = ["hello", "the quick brown fox", "abc", "123-456 yes", "yes no maybe"]
SAMPLED = [
    SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=8, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.7, min_p=0.05, seed=9, logprobs=True, top_logprobs=2,
                   ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.9, ignore_eos=True),  # seed drawn by rank 0
]
SCHEMA = '{"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}}, ' \
         '"required": ["id"]}'


def _engine(model_dir, tp_size=1, **kw):
    old = os.environ.pop(TP_SAMPLE_ENV, None)  # the default: local
    try:
        return LLM(model_dir, load_format="dummy", max_total_tokens=2048, max_running_requests=8, tp_size=tp_size,
                   **kw)
    finally:
        if old is not None:
            os.environ[TP_SAMPLE_ENV] = old


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny-tp-sample")))


@pytest.fixture(scope="module")
def ref(model_dir):
    llm = _engine(model_dir)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def tp_local(model_dir):
    llm = _engine(model_dir, tp_size=2, disable_overlap_schedule=False)  # overlap forced on the CPU
    yield llm
    llm.engine.shutdown()


def _tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def _counts(llm):
    s = llm.engine.scheduler.tp_sender
    return s.local_steps, s.ids_broadcasts


def test_local_sampling_matches_tp1(ref, tp_local):
    """The first requests of both engines, so the unseeded row draws the same seed."""
    assert tp_local.engine.scheduler.tp_sender.sample_local
    want = _tokens(ref, PROMPTS, SAMPLED)
    before = _counts(tp_local)
    outs = tp_local.generate(PROMPTS, SAMPLED)
    assert [o.token_ids for o in outs] == want
    local, broadcasts = _counts(tp_local)
    assert local - before[0] >= 12 and broadcasts == before[1]  # every step sampled on every rank
    assert len(outs[3].output_token_logprobs) == 12  # logprobs still come from rank 0


def test_grammar_or_control_row_takes_the_broadcast(ref, tp_local):
    prompts = PROMPTS[:4]
    params = [SamplingParams(max_new_tokens=24, temperature=0.7, seed=3, json_schema=SCHEMA),
              SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=0.8, seed=6, presence_penalty=0.5, ignore_eos=True)]
    want = _tokens(ref, prompts, params)
    before = _counts(tp_local)
    assert _tokens(tp_local, prompts, params) == want
    assert _counts(tp_local)[1] - before[1] >= 10  # those steps broadcast rank 0's ids
    # the same plain rows without the grammar and control rows sample locally again
    before = _counts(tp_local)
    assert _tokens(tp_local, prompts[1:3], params[1:3]) == want[1:3]
    assert _counts(tp_local)[0] - before[0] >= 10 and _counts(tp_local)[1] == before[1]


def test_forced_broadcast_matches(ref, tp_local, monkeypatch):
    """``ATTNSERVE_TP_SAMPLE=broadcast`` sets `StepSender.sample_local` (read at start-up;
    one process holds one tensor-parallel engine, so the running one is switched)."""
    from types import SimpleNamespace

    from attnserve.engine.tp.step_sync import StepSender

    monkeypatch.setenv(TP_SAMPLE_ENV, "broadcast")
    assert not StepSender(None, SimpleNamespace()).sample_local
    monkeypatch.setenv(TP_SAMPLE_ENV, "Local")
    assert StepSender(None, SimpleNamespace()).sample_local
    params = SAMPLED[:4]
    want = _tokens(ref, PROMPTS[:4], params)
    sender = tp_local.engine.scheduler.tp_sender
    monkeypatch.setattr(sender, "sample_local", False)
    before = _counts(tp_local)
    assert _tokens(tp_local, PROMPTS[:4], params) == want
    local, broadcasts = _counts(tp_local)
    assert local == before[0] and broadcasts - before[1] >= 12


def test_bad_mode_is_refused_before_any_rank_starts(model_dir, monkeypatch):
    monkeypatch.setenv(TP_SAMPLE_ENV, "sometimes")
    children = {p.pid for p in mp.active_children()}  # the module's tp 2 engine may be running
    with pytest.raises(ValueError, match=f"{TP_SAMPLE_ENV}='sometimes'"):
        LLM(model_dir, load_format="dummy", max_total_tokens=2048, tp_size=2)
    assert {p.pid for p in mp.active_children()} == children
