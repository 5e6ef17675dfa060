"""Clients that go away abort their requests: KV slots are freed within about one engine
step, and the server keeps serving."""

import asyncio
import time

import httpx


def _long_body(i: int, stream: bool):
    return {"model": "smollm2-135m", "prompt": f"Request {i}: tell me a very long story about ships.",
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": stream}


def _metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_16_streaming_clients_disconnect_after_first_chunk(server, auth, client):
    aborted_before = _metric(client.get("/metrics").text, "attnserve_requests_total", finish_reason="abort")

    async def run():
        opened = asyncio.Event()
        count = {"first": 0}

        async def one(i):
            async with httpx.AsyncClient(base_url=server.base_url, headers=auth, timeout=120) as c:
                async with c.stream("POST", "/v1/completions", json=_long_body(i, True)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and '"text":"' in line:
                            break  # the first chunk with a token
                    count["first"] += 1
                    if count["first"] == 16:
                        opened.set()
                    await opened.wait()  # all 16 are generating at once, then all leave
                # leaving the block closes the connection mid-stream
            return time.perf_counter()

        return await asyncio.gather(*(one(i) for i in range(16)))

    st = server.state()
    assert st["running"] == 0
    closed_at = max(asyncio.run(run()))
    while True:
        st = server.state()
        if server.is_idle(st):
            break
        assert time.perf_counter() - closed_at < 1.0, f"not freed within 1 s of the disconnects: {st}"
        time.sleep(0.02)
    freed_after = time.perf_counter() - closed_at
    assert st["kv_slots_used"] == 0 and st["running"] == 0
    aborted = _metric(client.get("/metrics").text, "attnserve_requests_total", finish_reason="abort")
    assert aborted - aborted_before == 16
    # the next request is served normally
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    print(f"16 aborted requests freed {freed_after * 1000:.0f} ms after the last disconnect")


def test_non_streaming_client_timeout_aborts(server, auth, client):
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=httpx.Timeout(120, read=1.5)) as c:
        t0 = time.perf_counter()
        try:
            c.post("/v1/completions", json=_long_body(99, False))
            raise AssertionError("a 400-token request should not finish within 1.5 s")
        except httpx.ReadTimeout:
            pass
    gone = time.perf_counter()
    server.wait_idle(timeout=1.5)
    assert time.perf_counter() - gone < 1.5 and gone - t0 < 5
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
