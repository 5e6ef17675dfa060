"""Tool calling and reasoning output through the server, with the official ``openai``
client on the real SmolLM2 (the shared `conftest.server`, with ``--tool-call-parser
hermes`` set on its serving context for this module): forced calls (``required`` and a
named function) whose arguments validate against the tool's schema in 20 of 20 sampled
requests, a two-turn tool conversation, a streamed forced call equal to the non-streamed
one (greedy), and the 400s of malformed tool requests."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome", "Tokyo"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"hour_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["hour_offset"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def oai(server, api_key):
    ctx = server.app.state.ctx
    saved = ctx.tool_call_parser
    ctx.tool_call_parser = "hermes"
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=300)
    ctx.tool_call_parser = saved


def _check_calls(choice, only=None):
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        assert c.function.name in SCHEMAS and (only is None or c.function.name == only)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


def test_forced_calls_validate_20_of_20(oai):
    def one(i):
        choice = "required" if i % 2 else {"type": "function", "function": {"name": "get_time"}}
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=96,
                                        temperature=1.0, seed=i, extra_body={"parallel_tool_calls": i % 4 != 1})
        return choice, r.choices[0]

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    for choice, c in results:
        calls = _check_calls(c, None if choice == "required" else "get_time")
        if choice != "required":
            assert len(calls) == 1
    assert len({c.message.tool_calls[0].function.arguments for _, c in results}) > 1  # sampled, not one answer


def test_streamed_forced_call_equals_whole(oai):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name":
                                                                                                     "get_weather"}},
              max_tokens=48, temperature=0)
    whole = _check_calls(oai.chat.completions.create(**kw).choices[0], "get_weather")
    calls, reasons, pieces = {}, [], 0
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or ():
                pieces += 1
                if d.id is not None:
                    assert d.index not in calls and d.function.name
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls" and pieces > 2  # the name first, then the arguments in pieces
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in whole]


def test_two_turn_tool_conversation(oai):
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=48, temperature=0)
    calls = _check_calls(first.choices[0])
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [c.model_dump() for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
                for c in calls]
    second = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were in the prompt


def test_reasoning_parser_splits_thinking(oai, server):
    """deepseek-r1: SmolLM2 never writes </think>, so its whole answer is reasoning."""
    ctx = server.app.state.ctx
    ctx.reasoning_parser = "deepseek-r1"
    try:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                  max_tokens=8, temperature=0)
        r = oai.chat.completions.create(**kw).choices[0].message
        streamed = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                           for ch in oai.chat.completions.create(stream=True, **kw) if ch.choices)
    finally:
        ctx.reasoning_parser = None
    plain = oai.chat.completions.create(**kw).choices[0].message.content
    assert r.reasoning_content == plain.strip() and not r.content and streamed == r.reasoning_content


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "content": "21 C"}]}, "messages.1"),
])
def test_bad_tool_requests_get_400(client, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_parser_flags_fail_at_start_up():
    from attnserve.server.launch import check_parser_flags
    from attnserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="llama3, qwen25, hermes, mistral"):
        check_parser_flags(ServerArgs(tool_call_parser="gpt4"))
    with pytest.raises(ValueError, match="deepseek-r1, qwen3"):
        check_parser_flags(ServerArgs(reasoning_parser="o1"))
