"""Prefix caching through the API: ``usage.prompt_tokens_details.cached_tokens`` and the
cache metrics, on the shared test server (real SmolLM2, radix cache on by default)."""

import json

CHAT = "/v1/chat/completions"


def _metric(client, name):
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_cached_tokens_reported_in_usage_and_metrics(server, client):
    messages = [{"role": "user", "content": "Describe a lighthouse at night in exactly two sentences, please."}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0}
    before = _metric(client, "attnserve_cached_prompt_tokens_total")
    first = client.post(CHAT, json=body).json()
    second = client.post(CHAT, json=body).json()
    prompt = second["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens"] == prompt
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1  # all but the last token
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    lines = []
    with client.stream("POST", CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
    usage = json.loads(lines[-1][len("data: "):])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    server.wait_idle(timeout=10)
    assert _metric(client, "attnserve_cached_prompt_tokens_total") >= before + 2 * (prompt - 1)
    assert 0 < _metric(client, "attnserve_prefix_cache_hit_rate") <= 1
    assert _metric(client, "attnserve_kv_slots_evictable") > 0 and _metric(client, "attnserve_kv_slots_protected") == 0
