"""Helpers shared by the tests of SGLang's native routes (tests/server/test_native_*.py)."""

import json

#: the prompt and greedy sampling the native-route tests compare answers on
PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


def sse_events(text):
    """The JSON payloads of a server-sent-events body that ends with ``data: [DONE]``."""
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", text[-200:]
    return [json.loads(x) for x in lines[:-1]]


def generate(client, **body):
    """``POST /generate`` with ``body``; asserts a 200 and returns the JSON answer."""
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()
