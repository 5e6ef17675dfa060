"""Server hardening: one request never fails another, the length rule, keep-alive after a
bad request, one ``created`` per stream, ``n`` choices, a dead engine loop, a bounded load
test. (SIGTERM draining: `test_cli_serve.py`.)"""

import asyncio
import http.client
import json
import random
import time

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"


def _lines(client, path, body):
    with client.stream("POST", path, json={**body, "stream": True}) as s:
        assert s.status_code == 200, s.read()
        return [ln for ln in s.iter_lines() if ln.startswith("data: ")]


def test_poisoned_request_does_not_reach_the_batch(server, auth):
    """Four greedy requests beside one with temperature 1e-300 (once NaN for the whole
    batch): all succeed, and each greedy text equals the same request alone."""
    prompts = ["The capital of France is", "Two plus two equals", "The sky is", "Cats like to"]
    alone = []
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=120) as c:
        for p in prompts:
            alone.append(c.post(C, json={"prompt": p, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"])

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=auth, timeout=120) as c:
            reqs = [c.post(C, json={"prompt": p, "max_tokens": 8, "temperature": 0}) for p in prompts]
            reqs.append(c.post(C, json={"prompt": "Tiny temperature:", "max_tokens": 8, "temperature": 1e-300}))
            reqs.append(c.post(C, json={"prompt": "Streamed too:", "max_tokens": 8, "temperature": 1e-300,
                                        "stream": True}))
            return await asyncio.gather(*reqs)

    results = asyncio.run(run())
    assert all(r.status_code == 200 for r in results), [r.text[:200] for r in results]
    assert [r.json()["choices"][0]["text"] for r in results[:4]] == alone
    assert results[-1].text.rstrip().endswith("data: [DONE]") and '"error"' not in results[-1].text
    server.wait_idle(timeout=10)


def test_keep_alive_survives_a_lone_surrogate(server, auth):
    conn = http.client.HTTPConnection("127.0.0.1", int(server.base_url.rsplit(":", 1)[1]), timeout=60)
    headers = {**auth, "Content-Type": "application/json"}
    try:
        conn.request("POST", C, body=b'{"prompt": "abc\\ud800def", "max_tokens": 2}', headers=headers)
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 400 and body["error"]["code"] == "invalid_value" and body["error"]["param"] == "prompt"
        conn.request("POST", C, body=json.dumps({"prompt": "Hello", "max_tokens": 2}).encode(), headers=headers)
        r = conn.getresponse()  # same socket: http.client would raise if the server had dropped it
        assert r.status == 200 and json.loads(r.read())["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        conn.close()


def test_one_created_and_n_choices(server, client):
    lines = _lines(client, C, {"prompt": "Count slowly: one,", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    chunks = [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
    assert len(chunks) > 3 and len({c["created"] for c in chunks}) == 1 and len({c["id"] for c in chunks}) == 1
    r = client.post(C, json={"prompt": "Name an animal:", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 5,
                             "ignore_eos": True}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 18 and r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 18
    again = client.post(C, json={"prompt": "Name an animal:", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 5,
                                 "ignore_eos": True}).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r["choices"]]  # seeded: reproducible
    body = {"messages": [{"role": "user", "content": "Say a colour."}], "max_tokens": 5, "n": 2, "temperature": 0.9,
            "stream_options": {"include_usage": True}}
    lines = _lines(client, CHAT, body)
    events = [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
    finishes = {c["choices"][0]["index"] for c in events if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finishes == {0, 1} and lines[-1] == "data: [DONE]"
    assert events[-1]["usage"]["completion_tokens"] >= 2
    server.wait_idle(timeout=10)


def test_bounded_load_no_failures_and_empty_pool(server, auth):
    """A few dozen mixed requests at concurrency 8: no failure, the pool empty afterwards."""
    rnd = random.Random(0)
    bodies = []
    for i in range(32):
        stream = i % 3 == 0
        if i % 2:
            b = {"messages": [{"role": "user", "content": f"Tell me fact number {i} about oceans."}]}
            path = CHAT
        else:
            b = {"prompt": f"Fact {i}: the ocean", "stop": [".", "\n"] if i % 4 == 0 else None}
            path = C
        b.update(max_tokens=rnd.randrange(2, 16), temperature=rnd.choice([0, 0.7]), stream=stream)
        bodies.append((path, {k: v for k, v in b.items() if v is not None}))

    async def run():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server.base_url, headers=auth, timeout=300) as c:
            async def one(path, body):
                async with sem:
                    r = await c.post(path, json=body)
                    return r.status_code, r.text

            return await asyncio.gather(*(one(p, b) for p, b in bodies))

    results = asyncio.run(run())
    failures = [(s, t[:200]) for s, t in results if s != 200 or '"error"' in t]
    assert not failures, failures
    st = server.wait_idle(timeout=30)
    assert st["kv_slots_free"] == st["kv_slots_total"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop is killed on purpose
def test_length_rule_uses_the_pool_and_a_dead_loop_answers_503():
    """On a 2,048-token pool: prompt + max_tokens beyond it is a 400 naming max_tokens (or
    prompt), with no server-flag advice; then the engine loop dies: /health and new
    requests get 503 at once."""
    pytest.importorskip("fastapi")
    from attnserve.engine.engine import Engine
    from attnserve.server.launch import ServerThread, create_app
    from attnserve.server_args import ServerArgs

    engine = Engine(ServerArgs(max_total_tokens=2048))
    app = create_app(engine)
    thread = ServerThread(app).start()
    try:
        with httpx.Client(base_url=thread.base_url, timeout=60) as c:
            r = c.post(C, json={"prompt": [42] * 1900, "max_tokens": 500})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
            assert "--" not in err["message"]
            r = c.post(C, json={"prompt": [42] * 2100, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert "--" not in r.json()["error"]["message"]
            r = c.post(C, json={"prompt": [42] * 1900})  # no max_tokens: the default fits what is left
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 148
            assert c.get("/health").status_code == 200
            loop = app.state.ctx.loop

            def die():
                raise SystemExit("engine loop killed by the test")

            loop._step = die
            loop.engine.scheduler.waiting.append(None)  # has_work() -> the loop steps -> dies
            loop._commands.put(object.__new__(type("Nudge", (), {})))
            deadline = time.monotonic() + 10
            while loop._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not loop._thread.is_alive()
            assert c.get("/health").status_code == 503
            t0 = time.monotonic()
            r = c.post(C, json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and time.monotonic() - t0 < 5
            assert r.headers.get("connection") == "close"
    finally:
        thread.stop()


def test_post_processing_error_fails_that_request_alone(server, auth, monkeypatch):
    """An exception while checking one request's stop conditions fails that request (500
    with the reason; streamed: an error event, then [DONE]) and its neighbours finish."""
    import attnserve.engine.scheduler as scheduler_module

    poison = 31337
    original = scheduler_module.check_stop

    def flaky(req, *a, **kw):
        if poison in req.prompt_ids:
            raise RuntimeError("stop check exploded")
        return original(req, *a, **kw)

    monkeypatch.setattr(scheduler_module, "check_stop", flaky)

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=auth, timeout=120) as c:
            return await asyncio.gather(
                c.post(C, json={"prompt": "Hello there", "max_tokens": 6, "temperature": 0}),
                c.post(C, json={"prompt": [1, 2, poison], "max_tokens": 6}),
                c.post(C, json={"prompt": [3, poison], "max_tokens": 6, "stream": True}),
                c.post(C, json={"prompt": "General Kenobi", "max_tokens": 6, "temperature": 0}),
            )

    good, bad, bad_stream, good2 = asyncio.run(run())
    assert good.status_code == 200 and good2.status_code == 200
    assert bad.status_code == 500 and "stop check exploded" in bad.json()["error"]["message"]
    lines = [ln for ln in bad_stream.text.splitlines() if ln.startswith("data: ")]
    assert "stop check exploded" in lines[-2] and lines[-1] == "data: [DONE]"
    server.wait_idle(timeout=10)
