"""Malformed and hostile requests get a 4xx with an OpenAI error body, and the server
keeps serving: a well-formed request right after each one succeeds.

Fields no API defines are refused (``unrecognized_request_argument``), and known fields that
attnserve does not implement are accepted only at their neutral value: see
`test_request_fields.py` and `test_neutral_fields_are_accepted`.
"""

import json

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "Hi", "max_tokens": 1}
MSG = [{"role": "user", "content": "Hi"}]


def _raw(body: bytes, ctype="application/json"):
    return {"content": body, "headers": {"content-type": ctype}}


def _chunked(total: int):
    def gen():
        yield b'{"prompt": "'
        for _ in range(total // 65536):
            yield b"a" * 65536
        yield b'"}'
    return {"content": gen(), "headers": {"content-type": "application/json"}}


# (id, method, path, request kwargs for httpx, expected status, expected param or None)
CASES = [
    ("malformed-json", "POST", C, _raw(b'{"prompt": "hi",'), 400, None),
    ("non-utf8-bytes", "POST", C, _raw(b'{"prompt": "\xff\xfe\xfa"}'), 400, None),
    ("body-is-array", "POST", C, {"json": [1, 2, 3]}, 400, None),
    ("body-is-string", "POST", C, {"json": "hello"}, 400, None),
    ("empty-body", "POST", C, _raw(b""), 400, None),
    ("text-plain-body", "POST", C, _raw(b'{"prompt": "hi"}', "text/plain"), 415, None),
    ("deeply-nested-json", "POST", C, _raw(b"[" * 200_000 + b"]" * 200_000), 400, None),
    ("missing-prompt", "POST", C, {"json": {"max_tokens": 4}}, 400, "prompt"),
    ("prompt-wrong-type", "POST", C, {"json": {"prompt": 5}}, 400, "prompt"),
    ("prompt-batch-mixed-types", "POST", C, {"json": {"prompt": ["a", [1, 2]]}}, 400, "prompt"),
    ("prompt-batch-too-many", "POST", C, {"json": {"prompt": ["a"] * 2049}}, 400, "prompt"),
    ("prompt-batch-one-over-context", "POST", C, {"json": {"prompt": ["hi", "word " * 20000]}}, 400, "prompt[1]"),
    ("prompt-batch-empty-token-list", "POST", C, {"json": {"prompt": [[5, 6], []]}}, 400, "prompt[1]"),
    ("prompt-batch-empty-string", "POST", C, {"json": {"prompt": ["", "hi"]}}, 400, "prompt[0]"),
    ("prompt-bool-ids", "POST", C, {"json": {"prompt": [1, True]}}, 400, "prompt"),
    ("empty-prompt", "POST", C, {"json": {"prompt": ""}}, 400, "prompt"),
    ("empty-token-list", "POST", C, {"json": {"prompt": []}}, 400, "prompt"),
    ("token-id-out-of-vocab", "POST", C, {"json": {"prompt": [1, 2, 10**9]}}, 400, "prompt"),
    ("token-id-negative", "POST", C, {"json": {"prompt": [5, -1]}}, 400, "prompt"),
    ("prompt-over-context", "POST", C, {"json": {"prompt": [42] * 9000}}, 400, "prompt"),
    ("text-prompt-over-context", "POST", C, {"json": {"prompt": "word " * 20000}}, 400, "prompt"),
    ("max-tokens-negative", "POST", C, {"json": {"prompt": "hi", "max_tokens": -5}}, 400, "max_tokens"),
    ("max-tokens-zero", "POST", C, {"json": {"prompt": "hi", "max_tokens": 0}}, 400, "max_tokens"),
    ("max-tokens-huge", "POST", C, {"json": {"prompt": "hi", "max_tokens": 10**12}}, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, {"json": {"prompt": "hi", "max_tokens": "8"}}, 400, "max_tokens"),
    ("max-tokens-float", "POST", C, {"json": {"prompt": "hi", "max_tokens": 8.5}}, 400, "max_tokens"),
    ("temperature-negative", "POST", C, {"json": {"prompt": "hi", "temperature": -1}}, 400, "temperature"),
    ("temperature-string", "POST", C, {"json": {"prompt": "hi", "temperature": "hot"}}, 400, "temperature"),
    ("temperature-nan", "POST", C, _raw(b'{"prompt": "hi", "temperature": NaN}'), 400, "temperature"),
    ("top-p-zero", "POST", C, {"json": {"prompt": "hi", "top_p": 0}}, 400, "top_p"),
    ("top-p-above-one", "POST", C, {"json": {"prompt": "hi", "top_p": 1.5}}, 400, "top_p"),
    ("top-k-negative", "POST", C, {"json": {"prompt": "hi", "top_k": -5}}, 400, "top_k"),
    # beyond the sampler's int64: was a 500 from the engine step
    ("top-k-beyond-int64", "POST", C, {"json": {"prompt": "hi", "top_k": 2**63}}, 400, "top_k"),
    ("generate-top-k-beyond-int64", "POST", "/generate", {"json": {"text": "hi", "sampling_params": {"top_k": 2**63}}},
     400, "sampling_params.top_k"),
    ("min-p-above-one", "POST", C, {"json": {"prompt": "hi", "min_p": 2}}, 400, "min_p"),
    ("n-seventeen", "POST", C, {"json": {"prompt": "hi", "n": 17}}, 400, "n"),
    ("n-zero", "POST", CHAT, {"json": {"messages": MSG, "n": 0}}, 400, "n"),
    ("best-of-not-n", "POST", C, {"json": {"prompt": "hi", "n": 2, "best_of": 3}}, 400, "best_of"),
    ("temperature-above-two", "POST", C, {"json": {"prompt": "hi", "temperature": 2.5}}, 400, "temperature"),
    ("chat-temperature-huge", "POST", CHAT, {"json": {"messages": MSG, "temperature": 1e308}}, 400, "temperature"),
    # json.dumps escapes the lone surrogates as \\uXXXX (valid JSON, invalid Unicode)
    ("lone-surrogate-prompt", "POST", C, _raw(json.dumps({"prompt": "abc\ud800def"}).encode()), 400, "prompt"),
    ("lone-surrogate-chat", "POST", CHAT, _raw(json.dumps({"messages": [{"role": "user", "content": "x\udfffy"}]})
                                               .encode()), 400, "messages"),
    ("lone-surrogate-stop", "POST", C, _raw(json.dumps({"prompt": "hi", "stop": ["a\ud83d"]}).encode()), 400,
     "stop"),
    ("lone-surrogate-prompt-list", "POST", C, _raw(json.dumps({"prompt": ["ok", "a\ud800"]}).encode()), 400,
     "prompt"),
    ("lone-surrogate-content-part", "POST", CHAT, _raw(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udc00"}]}]}).encode()), 400, "messages"),
    ("lone-surrogate-message-name", "POST", CHAT, _raw(json.dumps({"messages": [{"role": "user", "content": "hi",
                                                                                  "name": "a\ud800"}]}).encode()),
     400, "messages"),
    ("lone-surrogate-chat-stop", "POST", CHAT, _raw(json.dumps({"messages": MSG, "stop": "\udbff"}).encode()), 400,
     "stop"),
    ("lone-surrogate-user", "POST", C, _raw(json.dumps({"prompt": "hi", "user": "\ud800"}).encode()), 400, "user"),
    ("lone-surrogate-model", "POST", C, _raw(json.dumps({"prompt": "hi", "model": "x\ud800"}).encode()), 400,
     "model"),
    ("form-content-type", "POST", CHAT, _raw(json.dumps({"messages": MSG}).encode(),
                                              "application/x-www-form-urlencoded"), 415, None),
    ("generate-text-plain", "POST", "/generate", _raw(b'{"text": "hi"}', "text/plain"), 415, None),
    ("echo-false-max-tokens-zero", "POST", C, {"json": {"prompt": "hi", "max_tokens": 0, "echo": False}}, 400,
     "max_tokens"),
    ("stop-wrong-type", "POST", C, {"json": {"prompt": "hi", "stop": 5}}, 400, "stop"),
    ("stop-empty-string", "POST", C, {"json": {"prompt": "hi", "stop": [""]}}, 400, "stop"),
    ("stop-too-many", "POST", C, {"json": {"prompt": "hi", "stop": [f"s{i}" for i in range(100)]}}, 400, "stop"),
    ("stop-token-ids-negative", "POST", C, {"json": {"prompt": "hi", "stop_token_ids": [-3]}}, 400,
     "stop_token_ids"),
    ("seed-not-int", "POST", C, {"json": {"prompt": "hi", "seed": "abc"}}, 400, "seed"),
    ("seed-too-big", "POST", C, {"json": {"prompt": "hi", "seed": 2**70}}, 400, "seed"),
    ("stream-not-bool", "POST", C, {"json": {"prompt": "hi", "stream": "yes"}}, 400, "stream"),
    ("stream-options-wrong", "POST", C, {"json": {"prompt": "hi", "stream_options": {"include_usage": "x"}}},
     400, "stream_options.include_usage"),
    ("ignore-eos-string", "POST", C, {"json": {"prompt": "hi", "ignore_eos": "true"}}, 400, "ignore_eos"),
    ("logprobs-above-5", "POST", C, {"json": {"prompt": "hi", "logprobs": 6}}, 400, "logprobs"),
    ("chat-top-logprobs-above-20", "POST", CHAT, {"json": {"messages": MSG, "logprobs": True, "top_logprobs": 21}},
     400, "top_logprobs"),
    ("penalty-out-of-range", "POST", C, {"json": {"prompt": "hi", "presence_penalty": 2.5}}, 400,
     "presence_penalty"),
    ("regex-malformed", "POST", C, {"json": {"prompt": "hi", "regex": "[a-z+"}}, 400, "regex"),
    ("logit-bias-not-in-vocab", "POST", C, {"json": {"prompt": "hi", "logit_bias": {"49152": 5}}}, 400,
     "logit_bias"),
    ("unknown-field", "POST", CHAT, {"json": {"messages": MSG, "temprature": 0.5}}, 400, "temprature"),
    ("unknown-model", "POST", C, {"json": {"prompt": "hi", "model": "gpt-4"}}, 404, "model"),
    ("bad-api-key", "POST", C, {"json": OK, "headers": {"Authorization": "Bearer wrong"}}, 401, None),
    ("missing-api-key", "POST", C, {"json": OK, "headers": {"Authorization": ""}}, 401, None),
    ("basic-auth-scheme", "POST", C, {"json": OK, "headers": {"Authorization": "Basic dGVzdA=="}}, 401, None),
    ("body-10mb", "POST", C, _raw(b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'), 413, None),
    ("body-5mb-chunked", "POST", C, _chunked(5 * 1024 * 1024), 413, None),
    ("chat-missing-messages", "POST", CHAT, {"json": {"max_tokens": 4}}, 400, "messages"),
    ("chat-empty-messages", "POST", CHAT, {"json": {"messages": []}}, 400, "messages"),
    ("chat-bad-role", "POST", CHAT, {"json": {"messages": [{"role": "wizard", "content": "hi"}]}}, 400,
     "messages.0.role"),
    ("chat-content-int", "POST", CHAT, {"json": {"messages": [{"role": "user", "content": 7}]}}, 400,
     "messages.0.content"),
    ("chat-message-not-object", "POST", CHAT, {"json": {"messages": ["hello"]}}, 400, "messages.0"),
    ("chat-image-part", "POST", CHAT, {"json": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}}, 400, "messages.0.content"),
    ("chat-max-completion-tokens-zero", "POST", CHAT, {"json": {"messages": MSG, "max_completion_tokens": 0}},
     400, "max_completion_tokens"),
    ("chat-tool-without-function", "POST", CHAT, {"json": {"messages": MSG, "tools": [{"type": "function"}]}}, 400,
     "tools.0.function"),
    ("chat-over-context", "POST", CHAT, {"json": {"messages": [{"role": "user", "content": "hello " * 9000}]}},
     400, "messages"),
    ("wrong-method", "GET", C, {}, 405, None),
    ("unknown-route", "POST", "/v1/engines/x/completions", {"json": OK}, 404, None),
]


def test_case_count():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,method,path,kwargs,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_then_good_request(server, auth, client, name, method, path, kwargs, status, param):
    kwargs = dict(kwargs)
    headers = {**auth, **kwargs.pop("headers", {})}
    if headers["Authorization"] == "":
        del headers["Authorization"]
    r = httpx.request(method, server.base_url + path, headers=headers, timeout=60, **kwargs)
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if name.startswith("lone-surrogate"):
        assert err["code"] == "invalid_value", err
    # the server is still fine
    good = client.post(C, json=OK)
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_context_errors_carry_code(client):
    r = client.post(C, json={"prompt": [42] * 9000})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post(C, json={"prompt": "hi", "max_tokens": 8192})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_neutral_fields_are_accepted(client):
    """Fields attnserve does not implement pass at their neutral value; an unknown field,
    top-level or inside a message, is a 400 naming it (never silently ignored)."""
    r = client.post(C, json={**OK, "temperature": 0, "best_of": 1, "user": "u1"})
    assert r.status_code == 200, r.text
    r = client.post(CHAT, json={"messages": MSG, "max_tokens": 1, "tool_choice": "none",
                                "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    r = client.post(C, json={**OK, "frobnicate": {"x": [1, 2]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate", r.text
    assert r.json()["error"]["code"] == "unrecognized_request_argument"
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi", "extra": 1}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.extra", r.text


def test_stream_errors_before_streaming_are_plain_json(client):
    r = client.post(C, json={"prompt": "", "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "prompt"


def test_engine_failure_fails_only_that_request(server, client):
    """An exception inside an engine step fails the running batch with a 500 (streamed or
    not), frees its KV, and the loop keeps serving."""
    runner = server.engine.model_runner
    poison = 31337
    original = runner.forward

    def flaky(fb, *a, **kw):
        if poison in fb.input_ids.tolist():
            raise RuntimeError("injected failure")
        return original(fb, *a, **kw)

    runner.forward = flaky
    try:
        r = client.post(C, json={"prompt": [1, 2, poison], "max_tokens": 4})
        assert r.status_code == 500 and r.headers.get("connection") == "close", (r.text, r.headers)
        assert r.json()["error"]["type"] == "server_error" and "injected failure" in r.json()["error"]["message"]
        with client.stream("POST", C, json={"prompt": [3, poison], "max_tokens": 4, "stream": True}) as s:
            assert s.status_code == 200
            lines = [ln for ln in s.iter_lines() if ln]
        assert "injected failure" in json.loads(lines[0][len("data: "):])["error"]["message"]
        assert lines[-1] == "data: [DONE]"
    finally:
        runner.forward = original
    st = server.wait_idle(timeout=5)
    assert st["step_errors"] >= 2 and st["engine_alive"]
    assert client.get("/health").status_code == 200
    assert client.post(C, json=OK).status_code == 200


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    assert httpx.get(server.base_url + "/debug/state").status_code == 401
