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
        assert r.getheader("connection") != "close"  # a 4xx keeps the connection
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


def test_n_streamed_choices_are_indexed_and_a_disconnect_aborts_them_all(server, client):
    """``n=4`` streamed: chunks carry each choice's index; leaving after every choice has
    produced text aborts all four sub-requests (the pool is free at once, though each
    asked for 400 tokens)."""
    body = {"prompt": "Once upon a time", "max_tokens": 400, "n": 4, "ignore_eos": True, "temperature": 0.8,
            "stream": True}
    seen = set()
    with client.stream("POST", C, json=body) as s:
        assert s.status_code == 200
        for ln in s.iter_lines():
            if ln.startswith("data: ") and ln != "data: [DONE]":
                seen.update(c["index"] for c in json.loads(ln[6:])["choices"] if c["text"])
                if len(seen) == 4:
                    break
    assert seen == {0, 1, 2, 3}
    server.wait_idle(timeout=5)


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


@pytest.fixture(scope="module")
def small_pool():
    """Its own server on a 2,048-token KV pool (the context is 8,192), without an API key.
    `test_dead_engine_loop_answers_503` kills its engine loop, so it is the last user."""
    from attnserve.engine.engine import Engine
    from attnserve.server.launch import ServerThread, create_app
    from attnserve.server_args import ServerArgs

    engine = Engine(ServerArgs(max_total_tokens=2048))
    app = create_app(engine)
    thread = ServerThread(app).start()
    yield engine, app, thread
    thread.stop()


def _context_error(r, param):
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, r.text
    assert "--" not in err["message"] and "max-total-tokens" not in err["message"]  # no server-flag advice
    return err["message"]


def test_length_rule_uses_the_pool(small_pool, caplog):
    """On a 2,048-token pool: prompt + max_tokens beyond it is a 400 naming max_tokens (or
    the prompt, when the prompt alone does not fit), never a silently shortened answer; the
    flag advice goes to the server log; without max_tokens the default is clamped to what
    fits; the offline API's `Engine.check_prompt` applies the same rule."""
    from attnserve.engine.sampling_params import SamplingParams

    engine, app, thread = small_pool
    assert engine.max_request_tokens == 2048 < engine.context_len
    with httpx.Client(base_url=thread.base_url, timeout=120) as c:
        msg = _context_error(c.post(C, json={"prompt": [42] * 1900, "max_tokens": 500}), "max_tokens")
        assert "148" in msg  # says how much would fit
        _context_error(c.post(C, json={"prompt": [42] * 2100, "max_tokens": 1}), "prompt")
        _context_error(c.post(C, json={"prompt": [42] * 2048}), "prompt")  # no room for one token
        _context_error(c.post(CHAT, json={"messages": [{"role": "user", "content": "hi " * 2100}]}), "messages")
        _context_error(c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2048}),
                       "max_tokens")
        assert "--max-total-tokens" in caplog.text  # the operator learns which flag to raise
        r = c.post(C, json={"prompt": [42] * 2040})  # no max_tokens: the default (16) is clamped to the 8 left
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == 2040 and 1 <= usage["completion_tokens"] <= 8
        r = c.post(C, json={"prompt": [42] * 2040, "max_tokens": 8, "ignore_eos": True})  # exactly full: fine
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        _context_error(c.post(C, json={"prompt": [42] * 2040, "max_tokens": 9}), "max_tokens")
    with pytest.raises(ValueError, match="KV pool"):
        engine.check_prompt([42] * 1900, SamplingParams(max_new_tokens=500))
    with pytest.raises(ValueError, match="context length"):
        engine.check_prompt([42] * 100, SamplingParams(max_new_tokens=engine.context_len))
    engine.check_prompt([42] * 1900, SamplingParams(max_new_tokens=148))  # fits exactly
    deadline = time.monotonic() + 10
    while app.state.ctx.loop.state()["kv_slots_used"] or app.state.ctx.loop.state()["tracked_requests"]:
        assert time.monotonic() < deadline, app.state.ctx.loop.state()
        time.sleep(0.05)


class _LoopKilled(BaseException):
    """Escapes the engine loop's per-iteration ``except Exception``: the thread dies."""


def test_dead_engine_loop_answers_503(small_pool):
    """The engine loop thread dies while a stream runs: the stream ends with an
    ``engine_dead`` error event and ``[DONE]``, /health answers 503, and a new request gets
    503 (with ``Connection: close``) within a second instead of hanging."""
    engine, app, thread = small_pool

    def dying_step():
        raise _LoopKilled("engine loop killed by the test")

    with httpx.Client(base_url=thread.base_url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        body = {"prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with c.stream("POST", C, json=body) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            assert '"text"' in next(ln for ln in lines if ln.startswith("data: "))
            engine.step = dying_step  # the loop's next step kills its thread
            t0 = time.monotonic()
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert time.monotonic() - t0 < 5 and rest[-1] == "data: [DONE]", rest[-3:]
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_dead"
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert c.get("/debug/state").json()["engine_alive"] is False
        for stream in (False, True):
            t0 = time.monotonic()
            r = c.post(C, json={"prompt": "hi", "max_tokens": 2, "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
            assert time.monotonic() - t0 < 1.0 and r.headers.get("connection") == "close"


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
