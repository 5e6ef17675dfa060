"""Constrained decoding through the offline API (`LLM.generate`), on a 2-layer Llama with
random weights and a 300-token byte-level BPE tokenizer under a 320-wide LM head
(`grammar_fixtures`): a random model emits valid output only because of the mask, and
the 20 padded ids must never be sampled. Strings are bounded with ASCII patterns (see
`attnserve.engine.constrained.json_schema` on xgrammar's UTF-8 classes). Covers JSON Schema / regex / EBNF, overlap
scheduling forced on the CPU (the early processing of the pending step), mixed batches,
the radix cache, grammar termination with ``ignore_eos``, bad grammars, and a grammar that
fails inside the engine while the other requests go on."""

import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from attnserve.engine.llm import LLM  # noqa: E402
from attnserve.engine.sampling_params import SamplingParams  # noqa: E402
from grammar_fixtures import TOKENIZER_VOCAB, tiny_model_dir  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "kind": {"enum": ["red", "green", "blue"]}}, "required": ["id", "kind"]},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "boolean"}}, "required": ["x", "y"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "note": {"type": "string", "pattern": "^[a-z ]{0,6}$"}}, "required": ["point", "tags"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50},
                                                      {"type": "null"}, {"enum": ["none"]}]}}, "required": ["v"]},
]
REGEX = r"(yes|no)-[0-9]{2,3}"
EBNF = 'root ::= "(" item ("," item)? ")"\nitem ::= "x" | "y" [0-9]'
EBNF_LANGUAGE = re.compile(r"\((x|y[0-9])(,(x|y[0-9]))?\)")
PROMPTS = ["hello", "the quick brown fox", "abc", "123-456 yes"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny-grammar")))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, load_format="dummy", max_total_tokens=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def overlap_llm(model_dir):
    with LLM(model_dir, load_format="dummy", max_total_tokens=4096, disable_overlap_schedule=False) as engine:
        yield engine


def _requests(temperature):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS * 2):
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(max_new_tokens=96, temperature=temperature, seed=i, json_schema=schema))
    for i in range(3):
        prompts.append(PROMPTS[i])
        params.append(SamplingParams(max_new_tokens=16, temperature=temperature, seed=10 + i, regex=REGEX))
        prompts.append(PROMPTS[i + 1])
        params.append(SamplingParams(max_new_tokens=16, temperature=temperature, seed=20 + i, ebnf=EBNF))
    return prompts, params


def _check_valid(outs, params):
    for o, p in zip(outs, params):
        assert o.finish_reason == "stop" and o.error is None, (o.text, o.finish_reason, o.error)
        assert all(t < TOKENIZER_VOCAB for t in o.token_ids), o.token_ids  # padded ids never sampled
        if p.json_schema is not None:
            jsonschema.validate(json.loads(o.text), json.loads(p.json_schema))
        elif p.regex is not None:
            assert re.fullmatch(REGEX, o.text), o.text
        else:
            assert EBNF_LANGUAGE.fullmatch(o.text), o.text


def test_random_model_output_matches_its_grammar(llm):
    prompts, params = _requests(temperature=1.0)
    outs = llm.generate(prompts, params)
    _check_valid(outs, params)
    assert len({o.text for o in outs}) > len(outs) // 2  # really sampled, not one fixed string
    g = llm.engine.scheduler.grammar
    assert g.stats.terminated >= len(outs) and g.cache.stats.hits >= 3  # SCHEMAS * 2: compiled once each


def test_overlap_scheduling_gives_the_same_tokens(llm, overlap_llm):
    prompts, params = _requests(temperature=0.7)
    plain = llm.generate(prompts, params)
    overlapped = overlap_llm.generate(prompts, params)
    _check_valid(overlapped, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]
    stats = overlap_llm.engine.scheduler.grammar.stats
    assert stats.early_syncs > 0  # the pending step's tokens were accepted before the masks were filled
    assert stats.background_fills > 0  # masks filled on the worker thread, the sampling deferred


def test_mixed_batch_leaves_unconstrained_rows_alone(overlap_llm):
    free = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    alone = overlap_llm.generate(PROMPTS, free)
    prompts, params = _requests(temperature=0.0)
    mixed = overlap_llm.generate(PROMPTS + prompts, [free] * len(PROMPTS) + params)
    assert [o.token_ids for o in mixed[:len(PROMPTS)]] == [o.token_ids for o in alone]
    assert any(t >= TOKENIZER_VOCAB for o in alone for t in o.token_ids)  # unmasked rows do reach the padding
    _check_valid(mixed[len(PROMPTS):], params)


def test_failed_deferred_sampling_fails_its_step_and_the_one_being_launched(overlap_llm):
    """Overlap: the deferred sampling of a constrained step runs once the next step's host
    layout is built (`Scheduler._launch_host`); when it fails, the requests of both steps
    fail (the newcomer's prefill chunk holds KV slots), the pool is returned, and the
    engine serves the next requests."""
    engine = overlap_llm.engine
    sched, tok = engine.scheduler, engine.tokenizer
    assert sched.flush_prefix_cache()
    free_pages = sched.allocator.num_free_pages()
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, regex=REGEX)
    reqs = [engine.add_request(tok.encode(p), sp) for p in PROMPTS[:2]]
    while min(len(r.output_ids) for r in reqs) < 2:
        engine.step()
    assert sched._pending is not None and sched._pending.deferred is not None
    newcomer = engine.add_request(tok.encode(PROMPTS[3]), SamplingParams(max_new_tokens=4, temperature=0.0))
    original = sched.grammar.finish_masks

    def broken(job, positions):
        raise RuntimeError("injected failure")

    sched.grammar.finish_masks = broken
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    finally:
        sched.grammar.finish_masks = original
    assert set(map(id, sched.failed_reqs)) == set(map(id, reqs + [newcomer]))
    for r in reqs + [newcomer]:
        engine.abort_request(r.rid)
    while engine.has_work():
        engine.step()
    assert sched.flush_prefix_cache() and sched.allocator.num_free_pages() == free_pages  # no slot leaked
    out = overlap_llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, temperature=0.0, regex=REGEX))
    assert out[0].finish_reason == "stop" and re.fullmatch(REGEX, out[0].text)
    for r in reqs + [newcomer]:
        sched.forget(r.rid)


@pytest.mark.parametrize("engine", ["llm", "overlap_llm"])
def test_min_tokens_yields_to_a_finished_grammar(engine, request):
    """Once the grammar allows only its stop token, ``min_tokens`` no longer masks it: the
    request ends with the grammar (``stop``) below ``min_tokens``. Where the grammar may go
    on, ``min_tokens`` still holds EOS back."""
    llm = request.getfixturevalue(engine)
    yielded0 = llm.engine.scheduler.grammar.stats.min_tokens_yielded
    short = [SamplingParams(max_new_tokens=16, min_tokens=12, temperature=t, seed=i, regex="(yes|no)")
             for i, t in enumerate((0.0, 1.0, 1.0))]
    longer = SamplingParams(max_new_tokens=24, min_tokens=6, temperature=1.0, seed=5, regex="[ab]+")
    outs = llm.generate(PROMPTS[:3] + PROMPTS[:1], short + [longer])
    for o in outs[:3]:
        assert o.finish_reason == "stop" and o.error is None and o.text in ("yes", "no"), (o.text, o.error)
        assert len(o.token_ids) < 12
    assert llm.engine.scheduler.grammar.stats.min_tokens_yielded - yielded0 >= 3
    last = outs[3]
    assert last.error is None and re.fullmatch("[ab]+", last.text), (last.text, last.error)
    assert len(last.token_ids) > 6  # EOS (the last token, if any) only from position min_tokens on


def test_deferred_sampling_keeps_logprobs_penalties_and_seeds(llm, overlap_llm):
    """Overlap defers a constrained batch's sampling to the next launch: the logprobs (of
    the unmasked logits), penalties, ``min_tokens`` and seeded sampling of every row still
    equal those of the same batch without overlap."""
    params = [SamplingParams(max_new_tokens=40, temperature=0.8, seed=1, json_schema=SCHEMAS[0], logprobs=True,
                             top_logprobs=3, frequency_penalty=0.5, min_tokens=3),
              SamplingParams(max_new_tokens=10, temperature=0.8, seed=2, logprobs=True, top_logprobs=2,
                             presence_penalty=1.0, min_tokens=4),
              SamplingParams(max_new_tokens=16, temperature=0.9, seed=3, regex=REGEX, logprobs=True)]
    plain, overlapped = (e.generate(PROMPTS[:3], params) for e in (llm, overlap_llm))
    for a, b in zip(plain, overlapped):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert len(b.output_token_logprobs) == len(b.token_ids)
        assert b.output_token_logprobs == pytest.approx(a.output_token_logprobs, abs=1e-5)
    assert overlap_llm.engine.scheduler.grammar.stats.background_fills > 0
    _check_valid([overlapped[0], overlapped[2]], [params[0], params[2]])


def test_radix_cache_and_ignore_eos(llm):
    prompt = "the quick brown fox " * 6
    sp = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, json_schema=SCHEMAS[0])
    first, second = llm.generate([prompt, prompt], [sp, sp])
    third = llm.generate([prompt], sp)[0]
    assert third.cached_tokens > 0 and third.token_ids == first.token_ids == second.token_ids
    assert third.finish_reason == "stop" and len(third.token_ids) < 64  # the grammar ended it, not the length
    jsonschema.validate(json.loads(third.text), SCHEMAS[0])


def test_bad_grammars_raise_and_the_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["hi"], SamplingParams(regex="(ab"))
    with pytest.raises(ValueError, match="invalid ebnf"):
        llm.generate(["hi"], SamplingParams(ebnf="root ::= missing_rule"))
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        llm.generate(["hi"], SamplingParams(json_schema={"type": "object", "required": "id"}))
    with pytest.raises(ValueError, match="at most one grammar"):
        llm.generate(["hi"], SamplingParams(regex="a", ebnf='root ::= "a"'))
    out = llm.generate(["hi"], SamplingParams(max_new_tokens=16, temperature=0.0, regex=REGEX))[0]
    assert re.fullmatch(REGEX, out.text)


def test_grammar_failing_inside_the_engine_fails_alone(llm):
    engine = llm.engine
    tok = engine.tokenizer
    bad = engine.add_request(tok.encode("hi"), SamplingParams(regex="[z-a]"))  # past check_prompt
    good = engine.add_request(tok.encode("hi"), SamplingParams(max_new_tokens=16, temperature=0.0, regex=REGEX))
    plain = engine.add_request(tok.encode("hi"), SamplingParams(max_new_tokens=5, temperature=0.0))
    touched = set()
    for _ in range(200):
        touched.update(r.rid for r in engine.step())
        if not engine.has_work():
            break
    engine.scheduler.flush()
    assert bad.finish_reason.value == "abort" and bad.error_status == 400 and "invalid regex" in bad.error
    assert bad.rid in touched and bad.output_ids == []
    assert good.finish_reason.value == "stop" and re.fullmatch(REGEX, tok.decode(good.output_ids[:-1]))
    assert plain.finish_reason is not None and plain.error is None
    for r in (bad, good, plain):
        engine.scheduler.forget(r.rid)


def test_speculative_engine_refuses_constrained_requests(model_dir):
    with LLM(model_dir, load_format="dummy", max_total_tokens=2048, speculative_algorithm="NGRAM") as spec:
        with pytest.raises(ValueError, match="speculative decoding"):
            spec.generate(["hi"], SamplingParams(json_schema=SCHEMAS[0]))
        assert spec.generate(["hi"], SamplingParams(max_new_tokens=4, temperature=0.0))[0].finish_reason


def test_retraction_keeps_constrained_outputs(model_dir, llm):
    """A KV pool too small for the batch: requests are retracted mid-output and re-prefilled
    (prompt + output); their matchers keep their state, so the tokens equal the roomy run's."""
    prompts, params = _requests(temperature=0.0)
    roomy = llm.generate(prompts, params)
    from attnserve.engine.scheduler import AdmissionPolicy

    with LLM(model_dir, load_format="dummy", max_total_tokens=112, page_size=4,
             disable_overlap_schedule=False) as small:
        sched = small.engine.scheduler
        sched.policy = AdmissionPolicy(init_ratio=0.05, min_ratio=0.01)  # admit optimistically
        sched.new_token_ratio = sched.policy.init_ratio
        tight = small.generate(prompts, params)
        assert small.engine.scheduler.stats.num_retractions > 0
    _check_valid(tight, params)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
