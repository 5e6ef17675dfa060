"""gpt-oss harmony output (OpenAI, "OpenAI Harmony Response Format",
cookbook.openai.com/articles/openai-harmony): ``--reasoning-parser gpt-oss`` and
``--tool-call-parser gpt-oss`` on canned outputs, alone and chained as the chat route chains
them (`ChatOutput` / `ChoiceStream`). Every case: the whole text, one character at a time,
and every split into two pieces give the same ``reasoning_content``, ``content`` and
``tool_calls``; no harmony marker ever reaches an output."""

import json

import pytest

from attnserve.server.chat_output import ChatOutput, chat_output, finish_reason
from attnserve.server.parsers import (
    HARMONY_TEXT,
    check_reasoning_parser,
    check_tool_call_parser,
    parse_tool_calls,
    reasoning_parser,
    stream_tool_calls,
)
from attnserve.server.parsers.gpt_oss import MARKERS, Header, parse_header

A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>"
WEATHER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
PARIS = '{"location":"Paris"}'
TRICKY = '{"tz": "UTC+1", "note": "a \\"}\\" {b} [c]", "n": [1, {"x": null}]}'

# (id, text, reasoning, content, [(name, arguments)]) as the two parsers chained read them
CASES = [
    ("analysis-final", f"{A}We need to answer 2+2.{NEXT}{FINAL}The answer is 4.<|return|>",
     "We need to answer 2+2.", "The answer is 4.", []),
    ("final-only", f"{FINAL}Hello there.<|return|>", "", "Hello there.", []),
    ("final-no-stop-token", f"{FINAL}Hello there.", "", "Hello there.", []),
    ("analysis-cut-off", f"{A}Let me think about the", "Let me think about the", "", []),
    ("call-constrain-json", f"{A}Need weather.{NEXT}{WEATHER}{PARIS}<|call|>", "Need weather.", "",
     [("get_weather", PARIS)]),
    ("call-recipient-in-header",
     f"{A}Need weather.{NEXT} to=functions.get_weather<|channel|>commentary json<|message|>{PARIS}<|call|>",
     "Need weather.", "", [("get_weather", PARIS)]),
    ("call-recipient-first-message", f"to=functions.get_time<|channel|>commentary json<|message|>{TRICKY}",
     "", "", [("get_time", TRICKY)]),
    ("two-calls",
     f"{A}Two lookups.{NEXT}{WEATHER}{PARIS}<|call|><|start|>assistant<|channel|>commentary "
     f"to=functions.get_time<|message|> {TRICKY}\n<|call|>",
     "Two lookups.", "", [("get_weather", PARIS), ("get_time", TRICKY)]),
    ("preamble-then-call",
     f"{A}User wants weather.{NEXT}<|channel|>commentary<|message|>Let me check the weather.{NEXT}"
     f"{WEATHER}{PARIS}<|call|>",
     "User wants weather.", "Let me check the weather.", [("get_weather", PARIS)]),
    ("content-messages-joined", f"{FINAL}  First. {NEXT}{FINAL}\nSecond.<|return|>", "", "First.\nSecond.", []),
    ("missing-end", f"{A}think<|start|>assistant<|channel|>final<|message|>ok", "think", "ok", []),
    ("channel-without-start", f"{A}think<|end|><|channel|>final<|message|>ok", "think", "ok", []),
    ("two-analysis", f"{A}one{NEXT}{A} two {NEXT}{FINAL}ok", "one\ntwo", "ok", []),
    ("empty-final", f"{A}x{NEXT}{FINAL}<|return|>", "x", "", []),
    # malformed input: content, no text lost, no marker leaked
    ("no-harmony", "The answer is 4, plainly.", "", "The answer is 4, plainly.", []),
    ("no-harmony-one-word", "Paris", "", "Paris", []),
    ("marker-like-text", f"{FINAL}a <| b <|chan c |> d", "", "a <| b <|chan c |> d", []),
    ("bad-header-char", "<|channel|>final, oops<|message|>text<|end|>", "", "final, oopstext", []),
    ("bad-header-words", "Let me check<|channel|>commentary to=functions.f<|message|>{}", "",
     "Let me checkcommentary to=functions.f{}", []),
    ("header-interrupted", f"<|channel|>analysis<|end|><|start|>assistant{FINAL}ok", "", "ok", []),
    ("header-cut-off", f"{A}x{NEXT}<|channel|>commentary to=functions.f", "x", "", []),
    ("call-body-not-json", "<|channel|>commentary to=functions.f<|message|>not json<|call|>", "", "not json", []),
    ("call-empty-body", "<|channel|>commentary to=functions.f<|message|> <|call|>", "", "", []),
    ("other-recipient", '<|channel|>commentary to=browser.search<|message|>{"q": 1}<|end|>', "", '{"q": 1}', []),
    ("stray-markers-in-body", f"{FINAL}a<|message|>b<|constrain|>c", "", "abc", []),
]
IDS = [c[0] for c in CASES]


def _splits(text):
    yield [text]
    yield list(text)
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]


def _reassemble(deltas):
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = {}
    for d in deltas:
        for c in d.get("tool_calls", ()):
            fn = c["function"]
            if "name" in fn:
                assert c["index"] not in calls and c["id"].startswith("call_") and c["type"] == "function"
                calls[c["index"]] = [fn["name"], ""]
            calls[c["index"]][1] += fn["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


def _streamed(out: ChatOutput, pieces):
    st = out.stream()
    deltas = [st.delta(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return _reassemble(deltas), st.has_calls


def _no_markers(*texts):
    for t in texts:
        assert not any(m in t for m in MARKERS), t


@pytest.mark.parametrize("case_id,text,reasoning,content,calls", CASES, ids=IDS)
def test_chained_parsers_whole_and_streamed(case_id, text, reasoning, content, calls):
    """Both gpt-oss parsers (a request with tools): the chat route's `ChatOutput`."""
    out = chat_output(type("T", (), {"forced": False, "choice": "auto"})(), "gpt-oss", "gpt-oss")
    assert out == ChatOutput("gpt-oss", "gpt-oss") and out.keeps_markers
    fields, has_calls = out.message(text)
    assert fields["reasoning_content"] == (reasoning or None)
    assert fields["content"] == (content if content or not calls else None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in fields.get("tool_calls", [])] == calls
    assert has_calls == bool(calls) and finish_reason("stop", has_calls) == ("tool_calls" if calls else "stop")
    for name, args in calls:
        assert isinstance(json.loads(args), dict)
    _no_markers(reasoning, content)
    for pieces in _splits(text):
        got, streamed_calls = _streamed(out, pieces)
        assert got == (reasoning, content, calls), pieces
        assert streamed_calls == bool(calls)


@pytest.mark.parametrize("case_id,text,reasoning,content,calls", CASES, ids=IDS)
def test_tool_parser_alone(case_id, text, reasoning, content, calls):
    """``--tool-call-parser gpt-oss`` without a reasoning parser: the analysis channel is
    dropped, the rest is as with both parsers."""
    whole = parse_tool_calls("gpt-oss", text)
    assert (whole.content, [(c.name, c.arguments) for c in whole.calls]) == (content, calls)
    for pieces in _splits(text):
        st = stream_tool_calls("gpt-oss")
        deltas = [st.feed(p) for p in pieces] + [st.finish()]
        got = {}
        for d in deltas:
            for c in d.calls:
                got.setdefault(c.index, [c.name, ""])[1] += c.arguments
        assert ("".join(d.content for d in deltas), [tuple(got[i]) for i in sorted(got)]) == (content, calls), pieces


@pytest.mark.parametrize("case_id,text,reasoning,content,calls", CASES, ids=IDS)
def test_reasoning_parser_alone(case_id, text, reasoning, content, calls):
    """``--reasoning-parser gpt-oss`` with no tool parser after it: a call's body is content
    (after the other content, joined by a newline)."""
    expected_content = "\n".join([content] * bool(content) + [args for _, args in calls])
    parser = reasoning_parser("gpt-oss")
    assert parser.parse(text) == (reasoning, expected_content)
    for pieces in _splits(text):
        st = parser.stream()
        deltas = [st.feed(p) for p in pieces] + [st.finish()]
        got = ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))
        assert got == (reasoning, expected_content), pieces


def test_request_without_tools_on_a_tool_parser_server():
    """``--tool-call-parser gpt-oss`` alone and no tools: harmony is still read, calls are text."""
    out = chat_output(None, "gpt-oss", None)
    assert out == ChatOutput(HARMONY_TEXT, None) and out.keeps_markers
    text = f"{A}hidden{NEXT}{WEATHER}{PARIS}<|call|>"
    assert out.message(text) == ({"content": PARIS}, False)
    assert _streamed(out, list(text)) == (("", PARIS, []), False)
    assert chat_output(None, "gpt-oss", "gpt-oss") == ChatOutput(None, "gpt-oss")
    assert not chat_output(None, "hermes", "qwen3").keeps_markers  # other parsers: unchanged


def test_call_breaking_after_its_name():
    """The documented exception: the whole text gives the broken call back as content; a
    stream has announced it and keeps what it sent."""
    text = f'{WEATHER}{{"location": "Paris",}}<|call|>'
    whole = parse_tool_calls("gpt-oss", text)
    assert whole.calls == [] and whole.content == '{"location": "Paris",}'
    st = stream_tool_calls("gpt-oss")
    deltas = [st.feed(c) for c in text] + [st.finish()]
    assert [c.name for d in deltas for c in d.calls if c.name] == ["get_weather"]
    cut = parse_tool_calls("gpt-oss", f'{WEATHER}{{"location": "Par')  # cut off by max_tokens
    assert cut.calls == [] and cut.content == '{"location": "Par'


def test_name_comes_before_arguments():
    st = stream_tool_calls("gpt-oss")
    deltas = [d for d in (st.feed(c) for c in f"{WEATHER}{PARIS}<|call|>") if d.calls]
    assert deltas[0].calls[0].name == "get_weather" and deltas[0].calls[0].arguments == "{"
    assert len(deltas) == len(PARIS) and all(d.calls[0].name is None for d in deltas[1:])


@pytest.mark.parametrize("pieces,role,header", [
    ([(True, "<|channel|>"), (False, "analysis")], False, Header("analysis")),
    ([(False, "assistant to=functions.f"), (True, "<|channel|>"), (False, "commentary json")], True,
     Header("commentary", "functions.f")),
    ([(True, "<|channel|>"), (False, "commentary to=functions.f "), (True, "<|constrain|>"), (False, "json")],
     False, Header("commentary", "functions.f")),
    ([], True, Header()),
    ([(False, "assistant")], False, None),  # a role only after <|start|>
    ([(True, "<|channel|>"), (False, "a"), (True, "<|channel|>"), (False, "b")], False, None),
    ([(True, "<|channel|>")], False, None),
])
def test_parse_header(pieces, role, header):
    assert parse_header(pieces, role) == header


def test_header_kinds():
    assert Header("commentary", "functions.get_weather").kind == "call"
    assert Header("analysis", "functions.f").call_name == "f"  # a function recipient wins over the channel
    assert Header("analysis", "python").kind == "reasoning" and Header("commentary").kind == "content"
    assert Header(None, "functions.").kind == "content" and Header().kind == "content"


def test_names_are_registered():
    check_tool_call_parser("gpt-oss")
    check_reasoning_parser("gpt-oss")
    with pytest.raises(ValueError, match="mistral, gpt-oss"):
        check_tool_call_parser("harmony")
    with pytest.raises(ValueError, match="qwen3, gpt-oss"):
        check_reasoning_parser("harmony")
