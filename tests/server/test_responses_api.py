"""``POST /v1/responses`` (OpenAI's Responses API) with the official ``openai`` client on the
shared server: greedy text equal to the chat route's, ``instructions`` as a system message,
usage, ``incomplete`` at ``max_output_tokens``, the typed streaming events, a disconnect that
frees its request, and bad input refused with a 400 naming the field."""

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
R = "/v1/responses"


def _chat(oai, messages, max_tokens):
    return oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def test_greedy_text_equals_chat(oai):
    chat = _chat(oai, [{"role": "user", "content": QUESTION}], 12)
    r = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0, store=True,
                             metadata={"k": "v"}, user="u1")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and r.output_text.startswith("The capital of France")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [(c.type, c.annotations) for c in item.content] == [("output_text", [])]
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens > 0  # the chat request's prompt is in the prefix cache
    # echoed settings: nothing is stored (vLLM's behaviour without a store), metadata and user kept
    assert r.store is False and r.metadata == {"k": "v"} and r.user == "u1" and r.temperature == 0
    assert r.max_output_tokens == 12 and r.tools == [] and r.parallel_tool_calls is True
    # the same conversation as a list of message items with input_text parts
    r2 = oai.responses.create(model=MODEL, max_output_tokens=12, temperature=0, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital "},
                                                         {"type": "input_text", "text": "of France?"}]}])
    assert r2.output_text == r.output_text and r2.usage.input_tokens == r.usage.input_tokens


def test_instructions_and_history_equal_chat_messages(oai):
    system = "You answer in one word."
    history = [{"role": "user", "content": "Capital of Italy?"}, {"role": "assistant", "content": "Rome."},
               {"role": "user", "content": "And of Spain?"}]
    chat = _chat(oai, [{"role": "system", "content": system}] + history, 6)
    r = oai.responses.create(model=MODEL, instructions=system, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "Capital of Italy?"},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Rome.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And of Spain?"}]}])
    assert r.output_text == chat.choices[0].message.content and r.instructions == system
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    # a developer / system item first is the same as instructions
    r2 = oai.responses.create(model=MODEL, max_output_tokens=6, temperature=0,
                              input=[{"role": "developer", "content": system}] + history)
    assert r2.output_text == r.output_text and r2.usage.input_tokens == r.usage.input_tokens


def test_incomplete_at_max_output_tokens(oai):
    r = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.output_text


def test_streaming_events_in_order(oai):
    full = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    events = list(oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0,
                                       stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    terminal = "response.completed" if full.status == "completed" else "response.incomplete"
    assert types == head + ["response.output_text.delta"] * len(deltas) + tail + [terminal]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == full.output_text == events[-4].text == events[-3].part.text
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2]} == {item_id} and events[-2].item.id == item_id
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.id == events[0].response.id and done.output_text == text and done.output[0].id == item_id
    assert (done.usage.input_tokens, done.usage.output_tokens) == (full.usage.input_tokens, full.usage.output_tokens)
    # the client's streaming helper accumulates the same response
    with oai.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0) as stream:
        if full.status == "completed":
            assert stream.get_final_response().output_text == text
        else:
            assert [e.type for e in stream][-1] == "response.incomplete"


def test_streamed_incomplete_ends_with_response_incomplete(oai):
    events = list(oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens" and last.response.usage.output_tokens == 2
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_text_format_json_schema(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    r = oai.responses.create(model=MODEL, input=QUESTION + " Answer in JSON.", max_output_tokens=16, temperature=0,
                             text={"format": fmt})
    assert r.output_text.startswith('{"city": ') and r.text.format.type == "json_schema"
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text)["city"], str)


def _aborted(client) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name == "attnserve_requests_total" and s.labels.get("finish_reason") == "abort":
                return s.value
    return 0.0


def test_disconnect_mid_stream_frees_the_request(server, auth, client):
    before = _aborted(client)
    body = {"model": MODEL, "input": "Tell me a very long story about ships.", "max_output_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=60) as c:
        with c.stream("POST", R, json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line == "event: response.output_text.delta":
                    break
        gone = time.perf_counter()  # leaving the block closed the connection mid-stream
    server.wait_idle(timeout=5)
    assert time.perf_counter() - gone < 5
    assert _aborted(client) - before == 1  # aborted, not run to its 400 tokens


BAD = [
    ("empty-string", {"input": ""}, 400, "input"),
    ("empty-list", {"input": []}, 400, "input"),
    ("input-wrong-type", {"input": 5}, 400, "input"),
    ("bad-role", {"input": [{"role": "tool", "content": "x"}]}, 400, "input.0.role"),
    ("item-not-message", {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400,
     "input.0.type"),
    ("image-part", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0.type"),
    ("max-output-tokens-zero", {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("max-output-tokens-huge", {"input": "hi", "max_output_tokens": 10**9}, 400, "max_output_tokens"),
    ("input-over-context", {"input": "word " * 20000}, 400, "input"),
    ("previous-response-id", {"input": "hi", "previous_response_id": "resp_123"}, 400, "previous_response_id"),
    ("tools", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, 400, "tools"),
    ("reasoning", {"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ("unknown-field", {"input": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("bad-format-name", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
     400, "text.format.name"),
    ("other-model", {"input": "hi", "model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_refused_naming_the_field(client, body, status, param):
    r = client.post(R, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    if param == "max_output_tokens" and status == 400 and body["max_output_tokens"] > 1:
        assert err["code"] == "context_length_exceeded" and "max_output_tokens" in err["message"]


def test_server_keeps_serving_after_bad_input(oai, server):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=[], max_output_tokens=2)
    assert e.value.body["param"] == "input"
    r = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0)
    assert r.output_text and r.usage.output_tokens >= 1
    server.wait_idle(timeout=5)


def test_reasoning_items_stream_before_the_message():
    """The event builder alone (a ``--reasoning-parser`` server): a reasoning item, then the
    message, each opened, filled and closed, in OpenAI's order and shapes."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from attnserve.server.responses_api import ResponseEvents

    def snapshot(status, output, usage=None, details=None, error=None):
        return {"id": "resp_1", "object": "response", "created_at": 1, "status": status, "output": list(output),
                "usage": usage, "incomplete_details": details, "error": error, "model": MODEL,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}

    ev = ResponseEvents(snapshot)
    sse = ev.start() + ev.delta("reasoning", "Paris is") + ev.delta("reasoning", " known.") + ev.delta("text", "Paris")
    sse += ev.finish("stop", {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7,
                              "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}})
    data = [json.loads(s.split("data: ", 1)[1]) for s in sse]
    assert [s.split("\n", 1)[0] for s in sse] == [f"event: {d['type']}" for d in data]
    adapter = TypeAdapter(ResponseStreamEvent)
    for d in data:
        if "response" not in d:  # the client's event types accept every item event as sent
            adapter.validate_python(d)
    assert [d["type"] for d in data] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    output = data[-1]["response"]["output"]
    assert [(o["type"], o["content"][0]["text"]) for o in output] == [("reasoning", "Paris is known."),
                                                                     ("message", "Paris")]
    assert [d["output_index"] for d in data if d["type"].endswith(".delta")] == [0, 0, 1]
