"""vLLM's additions to the OpenAI routes against the shared real server (`conftest.server`):
``stop_reason`` on choices (the matched stop string or stop token id, else null) and
``stream_options.continuous_usage_stats`` (usage on every streamed chunk, per choice)."""

import json

import pytest

from attnserve.server.choice_extras import ChoiceExtras, stop_reason
from attnserve.server.engine_loop import StreamEvent

C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The capital of France is"
BODY = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def _chunks(client, path, body):
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", r.text[-300:]
    chunks = [json.loads(x) for x in lines[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return chunks


@pytest.fixture(scope="module")
def greedy(server, auth):
    """The greedy 5-token completion and its token ids (from ``/generate``'s ``output_ids``)."""
    import httpx

    r = httpx.post(server.base_url + "/generate", headers=auth, timeout=120, json={
        "text": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["text"], r.json()["output_ids"]


def test_stop_reason_on_completions(client, greedy):
    text, ids = greedy
    stop = text.strip()[1:4]
    plain = client.post(C, json=BODY).json()["choices"][0]
    assert plain["finish_reason"] == "length" and plain["stop_reason"] is None
    by_str = client.post(C, json={**BODY, "stop": [stop]}).json()["choices"][0]
    assert by_str["finish_reason"] == "stop" and by_str["stop_reason"] == stop
    by_id = client.post(C, json={**BODY, "stop_token_ids": [ids[2]]}).json()["choices"][0]
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == ids[2]
    ends = [c["choices"][0] for c in _chunks(client, C, {**BODY, "stop": [stop]}) if c["choices"]
            and c["choices"][0]["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in ends] == [("stop", stop)]


def test_stop_reason_on_chat(server, client):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
            "temperature": 0}
    first = client.post(CHAT, json=body).json()["choices"][0]
    content = first["message"]["content"]
    stop = content.strip()[:2]
    cut = client.post(CHAT, json={**body, "stop": stop}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    eos = sorted(server.engine.scheduler.eos_token_ids)[0]
    by_eos = client.post(CHAT, json={**body, "logit_bias": {str(eos): 100}}).json()["choices"][0]
    assert by_eos["finish_reason"] == "stop" and by_eos["stop_reason"] is None  # EOS: null, as in vLLM
    listed = client.post(CHAT, json={**body, "logit_bias": {str(eos): 100}, "stop_token_ids": [eos]}).json()
    assert listed["choices"][0]["stop_reason"] == eos
    ends = [c["choices"][0] for c in _chunks(client, CHAT, {**body, "stop": stop})
            if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in ends] == [("stop", stop)]


def test_stop_reason_rules():
    assert stop_reason(StreamEvent(finish_reason="stop", matched_stop="\n\n"), None) == "\n\n"
    assert stop_reason(StreamEvent(finish_reason="stop", matched_stop=7), [7, 9]) == 7
    assert stop_reason(StreamEvent(finish_reason="stop", matched_stop=2), [7]) is None
    assert stop_reason(StreamEvent(finish_reason="length"), [7]) is None
    scoring = ChoiceExtras([3], 1, None, scoring=True)
    assert scoring.stop_reason(StreamEvent(finish_reason="stop", matched_stop="x")) is None
    assert scoring.usage(0, 1).model_dump(exclude_none=True) == {"prompt_tokens": 3, "completion_tokens": 0,
                                                                 "total_tokens": 3}


def _check_running_usage(chunks, prompt_len_of):
    """Every chunk with a choice carries that choice's usage so far; the last chunk sums them."""
    seen = {}
    for c in chunks[:-1]:
        assert len(c["choices"]) == 1 and c["usage"] is not None, c
        i, u = c["choices"][0]["index"], c["usage"]
        assert u["prompt_tokens"] == prompt_len_of(i) and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert u["completion_tokens"] >= seen.get(i, 0)
        seen[i] = u["completion_tokens"]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(seen.values())
    return seen


def test_continuous_usage_on_streamed_completions(server, client):
    """n 2 over a batch of two prompts: each chunk's usage is its own choice's (vLLM's rule)."""
    prompts = [PROMPT, "Once upon a time there was a"]
    lens = [len(server.engine.tokenizer.encode(p)) for p in prompts]
    body = {**BODY, "prompt": prompts, "n": 2, "max_tokens": 4, "stream_options": CONTINUOUS}
    chunks = _chunks(client, C, body)
    seen = _check_running_usage(chunks, lambda i: lens[i // 2])
    assert seen == {0: 4, 1: 4, 2: 4, 3: 4}
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(lens)
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1] if c["choices"][0]["index"] == 0]
    assert counts[0] < counts[-1] == 4  # it grows as the choice streams
    alone = _chunks(client, C, {**BODY, "stream_options": {"continuous_usage_stats": True}})
    assert all(c.get("usage") is None for c in alone)  # without include_usage: nothing, as in vLLM
    scored = _chunks(client, C, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream_options": CONTINUOUS})
    assert _check_running_usage(scored, lambda i: lens[0]) == {0: 0}


def test_continuous_usage_on_streamed_chat(client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "n": 2, "stream_options": CONTINUOUS}
    chunks = _chunks(client, CHAT, body)
    prompt = chunks[0]["usage"]["prompt_tokens"]
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 2 and all(c["usage"]["completion_tokens"] == 0 for c in roles)
    assert _check_running_usage(chunks, lambda i: prompt) == {0: 4, 1: 4}


def test_continuous_usage_stats_must_be_a_boolean(client):
    r = client.post(C, json={**BODY, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text
