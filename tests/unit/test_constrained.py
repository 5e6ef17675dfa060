"""Constrained decoding building blocks without a model (`attnserve.engine.constrained`):
grammar field checks, grammar parsing errors, the compile cache, the token bitmask on the
CPU (constrained rows only, padded vocabulary), the manager's queueing and finishing."""

import json
import threading
import time
from collections import deque

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from attnserve.engine.constrained import GrammarManager, GrammarSpec, check_grammar_text  # noqa: E402
from attnserve.engine.constrained.bitmask import TokenBitmask  # noqa: E402
from attnserve.engine.constrained.compile_cache import GrammarCompileCache  # noqa: E402
from attnserve.engine.request import FinishReason, Req  # noqa: E402
from attnserve.engine.sampling_params import SamplingParams  # noqa: E402
from grammar_fixtures import MODEL_VOCAB, TOKENIZER_VOCAB, tiny_bpe_tokenizer  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def cache(tok):
    c = GrammarCompileCache(tok, MODEL_VOCAB, [EOS], max_entries=3)
    yield c
    c.shutdown()


def _req(rid, **grammar):
    sp = SamplingParams(max_new_tokens=16, **grammar)
    return Req(rid=rid, prompt_ids=[5, 6], sampling_params=sp, max_total_len=64)


def test_sampling_params_grammar_fields():
    with pytest.raises(ValueError, match="at most one grammar.*json_schema and regex"):
        SamplingParams(json_schema='{"type": "object"}', regex="a+")
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        SamplingParams(regex="")
    with pytest.raises(ValueError, match="ebnf must be a non-empty string"):
        SamplingParams(ebnf=5)
    sp = SamplingParams(json_schema={"type": "object", "properties": {"z": {"type": "integer"}, "a": {}}})
    assert isinstance(sp.json_schema, str) and sp.json_schema.index('"z"') < sp.json_schema.index('"a"')
    assert json.loads(sp.json_schema)["properties"]["z"] == {"type": "integer"}


@pytest.mark.parametrize("kind,text,message", [
    ("regex", "[a-", r"invalid regex: Regex parsing error at position 4: Unclosed '\['"),
    ("ebnf", 'root ::= "a" rule2', 'invalid ebnf: .*Rule "rule2" is not defined'),
    ("ebnf", "root ::= (", "invalid ebnf: .*"),
    ("json_schema", "{not json", "json_schema is not valid JSON"),
    ("json_schema", "[1, 2]", "json_schema must be a JSON object or boolean"),
    ("json_schema", '{"type": "array", "minItems": -1}', "not a valid JSON Schema: -1 is less than the minimum"),
    ("json_schema", '{"type": "foo"}', "json_schema"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "invalid json_schema: Invalid range"),
])
def test_bad_grammars_are_value_errors(kind, text, message):
    with pytest.raises(ValueError, match=message) as info:
        check_grammar_text(GrammarSpec(kind, text))
    assert ".cc:" not in str(info.value) and "Check failed" not in str(info.value)


def test_good_grammars_parse():
    for spec in (GrammarSpec("regex", r"[0-9]{3}-[a-z]+"), GrammarSpec("ebnf", 'root ::= "yes" | "no"'),
                 GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, '
                                            '{"type": "null"}]}}}')):
        check_grammar_text(spec)


def test_compile_cache_lru_errors_and_workers(cache):
    a, b, c, d = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+", "d+"))
    fa = cache.get(a)
    assert cache.get(a) is fa and cache.stats.hits >= 1
    assert any(t.name.startswith("attnserve-grammar") for t in threading.enumerate())
    assert fa.result(timeout=30) is not None
    for s in (b, c, d):
        cache.get(s).result(timeout=30)
    assert len(cache) == 3 and cache.stats.evictions >= 1
    misses = cache.stats.misses
    assert cache.get(a) is not fa and cache.stats.misses == misses + 1  # evicted: compiled again
    bad = cache.get(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(ValueError, match="invalid regex"):
        bad.result(timeout=30)


def _allowed(tok_info_mask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (tok_info_mask_row.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab].bool()


@pytest.mark.parametrize("width", [MODEL_VOCAB, MODEL_VOCAB + 13])
@pytest.mark.parametrize("compact", [False, True], ids=["rows-in-place", "compact-then-scatter"])
def test_bitmask_masks_constrained_rows_and_padding(cache, width, compact):
    compiled = cache.get(GrammarSpec("regex", r"(yes|no)[0-9]{2}")).result(timeout=30)
    m1, m3 = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    assert m3.accept_string("ye")
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    bitmask = TokenBitmask(MODEL_VOCAB, "cpu", compact=compact)
    for _ in range(2):  # the second call reuses the (other) host buffer
        bitmask.apply(logits, [1, 3], [m1, m3])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])  # unconstrained rows
    for row, m in ((1, m1), (3, m3)):
        ref = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
        m.fill_next_token_bitmask(ref, 0)
        allowed = _allowed(ref[0], MODEL_VOCAB)
        finite = torch.isfinite(logits[row])
        assert torch.equal(finite[:MODEL_VOCAB], allowed)
        assert torch.equal(logits[row][finite], before[row][finite])
        assert not finite[TOKENIZER_VOCAB:].any()  # ids the tokenizer lacks (padded head), and past it
        assert 0 < int(allowed.sum()) < TOKENIZER_VOCAB
    assert not torch.isfinite(logits[3, EOS])  # "ye" needs "s" and two digits first
    full = torch.randn(2, MODEL_VOCAB)
    bitmask.apply(full, [0, 1], [m1, m3])  # every row constrained: no row indices
    assert torch.equal(torch.isfinite(full[1]), torch.isfinite(logits[3])[:MODEL_VOCAB])


def test_manager_queues_compiled_fails_bad_and_finishes_on_termination(tok):
    mgr = GrammarManager(tok, MODEL_VOCAB, [EOS], "cpu")
    waiting = deque()
    good, bad, plain = _req("good", ebnf='root ::= "yes" | "no"'), _req("bad", regex="(x"), _req("plain")
    for r in (good, bad, plain):
        mgr.enqueue(r, waiting)
    assert plain in waiting and plain.grammar is None
    failed, deadline = [], time.monotonic() + 30
    while mgr.compiling and time.monotonic() < deadline:
        mgr.wait(0.05)
        failed += mgr.poll(waiting)
    assert failed == [bad] and bad.finish_reason == FinishReason.ABORT and bad.error_status == 400
    assert bad.error.startswith("invalid regex") and bad not in waiting
    assert {r.rid for r in waiting} == {"plain", "good"} and good.grammar.matcher is not None
    again, cached_bad = _req("again", ebnf='root ::= "yes" | "no"'), _req("bad2", regex="(x")
    mgr.enqueue(again, waiting)
    mgr.enqueue(cached_bad, waiting)  # both compiled already: queued / failed at once
    assert waiting[-1] is again and again.grammar.matcher is not None and mgr.compiling
    assert mgr.poll(waiting) == [cached_bad] and not mgr.compiling and cached_bad.error_status == 400
    waiting.pop()
    for t in tok.encode("yes") + [EOS]:
        good.output_ids.append(t)
        mgr.accept(good, t)
    assert good.finish_reason == FinishReason.STOP and good.matched_stop == EOS
    assert good.text == "yes" and mgr.stats.terminated == 1 and mgr.stats.failed == 2
    off_grammar = _req("off", regex="[0-9]+")
    mgr.enqueue(off_grammar, waiting)
    while off_grammar.grammar.matcher is None:
        mgr.wait(0.05)
        mgr.poll(waiting)
    mgr.accept(off_grammar, tok.encode("a")[0])
    assert off_grammar.finish_reason == FinishReason.ABORT and "rejected" in off_grammar.error
    mgr.shutdown()


def test_manager_refuses_what_the_engine_cannot_serve(tok):
    sp = SamplingParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="speculative decoding"):
        GrammarManager(tok, MODEL_VOCAB, [EOS], "cpu", speculative=True).check(sp)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        GrammarManager(None, MODEL_VOCAB, [EOS], "cpu").check(sp)
    with pytest.raises(ValueError, match="invalid regex"):
        GrammarManager(tok, MODEL_VOCAB, [EOS], "cpu").check(SamplingParams(regex="[0-"), parse=True)
    GrammarManager(None, MODEL_VOCAB, [EOS], "cpu", speculative=True).check(SamplingParams())  # no grammar: fine


def test_failed_request_maps_to_400_or_500():
    from attnserve.server.engine_loop import request_error

    r = _req("r")
    r.error, r.error_status = "invalid regex: x", 400
    e = request_error(r)
    assert (e.status, e.message, e.code) == (400, "invalid regex: x", "invalid_value")
    r.error_status = 500
    assert request_error(r).status == 500 and "internal error" in request_error(r).message


@pytest.mark.parametrize("bounds", [{"minLength": 1, "maxLength": 4}, {"maxLength": 200}],
                         ids=["regex-pattern", "narrowed-repetition"])
def test_length_bounded_json_strings_exclude_control_characters(cache, bounds):
    """xgrammar 0.2.8 lets raw U+0000-U+001F into strings with maxLength/minLength, which
    JSON forbids; short bounds become a regex pattern, long ones keep xgrammar's repetition
    with a narrowed class (`attnserve.engine.constrained.json_schema`)."""
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", **bounds}}})
    compiled = cache.get(GrammarSpec("json_schema", schema)).result(timeout=60)
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string('{"s": "a')
    for ch in ("\x00", "\x17", "\t", "\x1f"):
        assert not m.fork().accept_string(ch), repr(ch)
    assert m.accept_string('b~"}') and m.is_completed()
    too_long = xgr.GrammarMatcher(compiled)
    n = bounds["maxLength"]
    assert too_long.accept_string('{"s": "' + "x" * n) and not too_long.accept_string("x")


def test_bounded_strings_rewrite_touches_only_string_schemas():
    from attnserve.engine.constrained.json_schema import REGEX_MAX_LENGTH, bounded_strings_as_patterns

    schema = {"type": "object", "properties": {
        "enum": {"type": "string", "maxLength": 5},  # a property named like a keyword
        "pat": {"type": "string", "maxLength": 5, "pattern": "^a+$"},
        "long": {"type": "string", "maxLength": REGEX_MAX_LENGTH + 1},
        "opt": {"anyOf": [{"type": "string", "minLength": 2}, {"type": "null"}]},
        "arr": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}}},
        "default": {"type": "string", "maxLength": 5}, "$defs": {"d": {"type": "string", "maxLength": 7}}}
    out = bounded_strings_as_patterns(schema)
    props = out["properties"]
    assert props["enum"] == {"type": "string", "pattern": "^[\\s\\S]{0,5}$"}
    assert props["pat"] == schema["properties"]["pat"] and props["long"] == schema["properties"]["long"]
    assert props["opt"]["anyOf"][0] == {"type": "string", "pattern": "^[\\s\\S]{2,}$"}
    assert props["arr"]["items"]["pattern"] == "^[\\s\\S]{1,3}$"
    assert out["default"] == schema["default"]  # data, not a schema
    assert out["$defs"]["d"]["pattern"] == "^[\\s\\S]{0,7}$"
    assert schema["properties"]["enum"] == {"type": "string", "maxLength": 5}  # the input is not modified


@pytest.mark.parametrize("table", [True, False], ids=["token-table", "accept-token"])
def test_mask_job_accepts_ahead_then_fills_on_the_worker(cache, tok, table):
    """A `MaskJob` (overlap): the pending tokens are accepted (with the `TokenTable`'s
    ``batch_accept_string``, or xgrammar's ``batch_accept_token``), terminated matchers drop
    out of the fill, the outcomes reach `GrammarManager.accept`, and the masks and outcomes
    equal those of plain ``accept_token`` calls, including a rejected byte, a padded id and
    a special token."""
    from attnserve.engine.constrained.mask_job import MaskWorker

    mgr = GrammarManager(tok, MODEL_VOCAB, [EOS], "cpu")
    mgr.bitmask = TokenBitmask(MODEL_VOCAB, "cpu")
    mgr.worker = MaskWorker(mgr.bitmask, cache.token_table() if table else None)
    compiled = cache.get(GrammarSpec("regex", r"(yes|no)[0-9]{2}")).result(timeout=30)
    reqs = [_req(f"r{i}", regex=r"(yes|no)[0-9]{2}") for i in range(20)]
    refs = []
    for r in reqs:
        r.grammar = type("G", (), {})()  # a stand-in RequestGrammar: matcher, spec, ahead_job, must_end
        r.grammar.matcher, r.grammar.ahead_job, r.grammar.must_end = xgr.GrammarMatcher(compiled), None, False
        r.grammar.spec = GrammarSpec("regex", r"(yes|no)[0-9]{2}")
        assert r.grammar.matcher.accept_string("yes4")
        refs.append(xgr.GrammarMatcher(compiled))
        assert refs[-1].accept_string("yes4")
    digit, bad = tok.convert_tokens_to_ids("5"), tok.convert_tokens_to_ids("x")
    tokens = [digit] * 17 + [bad, MODEL_VOCAB - 3, 1]  # rejected: a byte, a padded id, <s>
    job = mgr.start_masks(reqs, True, reqs, tokens)
    mgr.finish_masks(job, [0] * len(reqs))
    assert job.rows == list(range(20))  # "yes45" may still end (EOS) or not: nothing terminated yet
    for i, (r, ref) in enumerate(zip(reqs, refs)):
        assert ref.accept_token(tokens[i]) == (i < 17)
        assert job.outcome(r) == ("accepted" if i < 17 else "rejected")
        want = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
        ref.fill_next_token_bitmask(want, 0)
        assert torch.equal(job.filled.host[i], want[0])
    for r, t in zip(reqs, tokens):
        r.output_ids.append(t)
        mgr.accept(r, t)
    assert all(r.finish_reason is None for r in reqs[:17])
    assert all(r.finish_reason == FinishReason.ABORT and "rejected" in r.error for r in reqs[17:])
    job2 = mgr.start_masks(reqs[:17], True, reqs[:17], [EOS] * 16 + [digit])  # EOS ends "yes45"
    mgr.finish_masks(job2, [0] * 17)
    assert job2.rows == [16] and all(job2.outcome(r) == "terminated" for r in reqs[:16])
    assert job2.outcome(reqs[16]) == "rejected"  # "yes455": a third digit
    assert mgr.worker.stats.jobs == 2 and mgr.worker.stats.accepted_rows == 37
    mgr.shutdown()
