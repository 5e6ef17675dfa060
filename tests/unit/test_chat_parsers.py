"""Tool-call parsers (hermes/qwen25, llama3, mistral, the forced-call JSON array) and
reasoning parsers (deepseek-r1, qwen3) on canned model outputs: one call, several calls,
text around them, malformed JSON (left as content), and streaming: every split of the
text into two pieces, and one character at a time, reassembles to the whole-text result."""

import json

import pytest

from attnserve.server.parsers import (
    check_reasoning_parser,
    check_tool_call_parser,
    parse_tool_calls,
    reasoning_parser,
    stream_tool_calls,
)

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
W_ARGS = '{"city": "Paris", "unit": "celsius"}'
T = '{"name": "get_time", "arguments": {"tz": "UTC+1 {x}"}}'
T_ARGS = '{"tz": "UTC+1 {x}"}'
L = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'

# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    # hermes / qwen25
    ("qwen25", f"<tool_call>\n{W}\n</tool_call>", "", [("get_weather", W_ARGS)]),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", "",
     [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("qwen25", f"Let me check.\n<tool_call>\n{W}\n</tool_call>\nOne moment.", "Let me check.\nOne moment.",
     [("get_weather", W_ARGS)]),
    ("qwen25", '<tool_call>{"arguments": {"x": [1, 2]}, "name": "f"}</tool_call>', "", [("f", '{"x": [1, 2]}')]),
    ("qwen25", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", '{"x": 1}')]),
    ("qwen25", '<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
    ("qwen25", f"<tool_call>\n{W}", "", [("get_weather", W_ARGS)]),  # no end tag, complete object
    ("qwen25", "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("qwen25", 'x <tool_call>{"name": 5, "arguments": {}}</tool_call>', 'x <tool_call>{"name": 5, "arguments": {}}'
                                                                        '</tool_call>', []),
    ("qwen25", "plain <tool text < 3", "plain <tool text < 3", []),
    # llama3
    ("llama3", L, "", [("get_weather", W_ARGS)]),
    ("llama3", f'  {L}; {{"name": "get_time", "parameters": {{"tz": "UTC+1 {{x}}"}}}}', "",
     [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("llama3", f"I will call it.<|python_tag|>{L}", "I will call it.", [("get_weather", W_ARGS)]),
    ("llama3", f"{L}\nThat is the call.", "That is the call.", [("get_weather", W_ARGS)]),
    ("llama3", 'The set {1, 2} has {"name": "x"} inside.', 'The set {1, 2} has {"name": "x"} inside.', []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", '{name: "f"}', '{name: "f"}', []),
    # mistral
    ("mistral", f"[TOOL_CALLS] [{W}]", "", [("get_weather", W_ARGS)]),
    ("mistral", f"[TOOL_CALLS][{W}, {T}]", "", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("mistral", f"Checking. [TOOL_CALLS] [{W}] Done.", "Checking. Done.", [("get_weather", W_ARGS)]),
    ("mistral", f"[{T}]", "", [("get_time", T_ARGS)]),  # the control token was dropped by detokenization
    ("mistral", "[TOOL_CALLS] [oops]", "[TOOL_CALLS] [oops]", []),
    ("mistral", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("mistral", "the list [TOOL_CALL] is", "the list [TOOL_CALL] is", []),
    # forced calls (bare array, "parameters")
    ("json_array", f"[{L}, {T}]", "", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
]


def _reassemble(deltas):
    content = "".join(d.content for d in deltas)
    calls = {}
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                assert c.index not in calls, "a call announced twice"
                assert c.id.startswith("call_") and len(c.id) > 10
                calls[c.index] = [c.name, ""]
            calls[c.index][1] += c.arguments
    assert sorted(calls) == list(range(len(calls))), "call indices must count from 0"
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _stream(name, pieces):
    st = stream_tool_calls(name)
    return _reassemble([st.feed(p) for p in pieces] + [st.finish()])


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_and_stream(name, text, content, calls):
    whole = parse_tool_calls(name, text)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    for _, args in calls:
        assert isinstance(json.loads(args), dict)
    expected = (content, calls)
    assert _stream(name, [text]) == expected
    assert _stream(name, list(text)) == expected
    for k in range(1, len(text)):
        assert _stream(name, [text[:k], text[k:]]) == expected, f"split at {k}: {text[:k]!r} | {text[k:]!r}"


def test_name_comes_before_arguments_in_stream():
    st = stream_tool_calls("qwen25")
    first = [d for d in (st.feed(c) for c in f"<tool_call>{W}</tool_call>") if d.calls]
    assert first[0].calls[0].name == "get_weather" and first[0].calls[0].arguments == ""
    assert len(first) > 5 and all(d.calls[0].name is None for d in first[1:])  # arguments arrive in pieces


@pytest.mark.parametrize("name,text,after", [
    ("qwen25", 'x <tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call> y', "y"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1', ""),  # cut off mid-call
    ("qwen25", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "</tool_call>"),  # arguments not an object
])
def test_call_breaking_after_its_name(name, text, after):
    """Non-streamed: the broken call's text is content again. Streamed: the call was
    announced and stays; the text after it is still content (the documented exception)."""
    whole = parse_tool_calls(name, text)
    assert whole.calls == [] and '"name": "f"' in whole.content
    content, calls = _stream(name, list(text))
    assert [c[0] for c in calls] == ["f"] and content.endswith(after)


def test_unknown_parsers_list_valid_names():
    with pytest.raises(ValueError, match="llama3.*qwen25.*hermes.*mistral"):
        check_tool_call_parser("gpt")
    with pytest.raises(ValueError, match="deepseek-r1.*qwen3"):
        check_reasoning_parser("o1")


REASONING = [
    ("deepseek-r1", "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4.", "Step 1.\nStep 2.", "The answer is 4."),
    ("deepseek-r1", "Step 1 (the tag was in the prompt).</think>Answer.", "Step 1 (the tag was in the prompt).",
     "Answer."),
    ("deepseek-r1", "Still thinking when cut off", "Still thinking when cut off", ""),
    ("deepseek-r1", "a < b and </thin> is not </think> the end", "a < b and </thin> is not", "the end"),
    ("qwen3", "<think>\nHmm.\n</think>\n\nHello!", "Hmm.", "Hello!"),
    ("qwen3", "Hello, no thinking here. <think> is text.", "", "Hello, no thinking here. <think> is text."),
    ("qwen3", "<think></think>Direct.", "", "Direct."),
    ("qwen3", "<thinking>", "", "<thinking>"),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_parse_and_stream(name, text, reasoning, content):
    parser = reasoning_parser(name)
    assert parser.parse(text) == (reasoning, content)
    splits = [[text], list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]
    for pieces in splits:
        st = parser.stream()
        deltas = [st.feed(p) for p in pieces] + [st.finish()]
        got = ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))
        assert got == (reasoning, content), pieces
