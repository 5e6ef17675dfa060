"""200 requests at concurrency 32 (mixed prompt lengths, streamed and not): all complete,
streamed text equals non-streamed greedy text, and the KV pool ends completely free."""

import asyncio
import json
import random
import time

import httpx


WORDS = ("river stone cloud maple engine quiet orange violin harbor lantern summer pencil garden "
         "silver window thunder copper meadow puzzle rocket").split()


def _prompts(n: int, seed: int = 7):
    """``n`` distinct (text prompt, max_tokens) pairs: 1 to ~60 words, 2 to 8 tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.choice([1, 2, 4, 8, 16, 32, 60])
        out.append((f"Item {i}: " + " ".join(rng.choice(WORDS) for _ in range(k)), rng.randint(2, 8)))
    return out


async def _one(client: httpx.AsyncClient, prompt: str, stream: bool, max_tokens: int):
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return data["choices"][0]["text"], data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    parts, reason, usage, done = [], None, None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                parts.append(chunk["choices"][0]["text"])
                reason = chunk["choices"][0]["finish_reason"] or reason
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    assert done, "stream did not end with [DONE]"
    return "".join(parts), reason, usage


def test_200_requests_at_concurrency_32(server, auth):
    prompts = _prompts(100)
    jobs = [(p, m, s) for p, m in prompts for s in (True, False)]
    random.Random(3).shuffle(jobs)

    async def run():
        sem = asyncio.Semaphore(32)
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.base_url, headers=auth, timeout=300, limits=limits) as c:
            async def guarded(job):
                async with sem:
                    return await _one(c, job[0], job[2], job[1])

            peak = {"running": 0}

            async def watch():  # own connection: the 32 of the pool are busy
                async with httpx.AsyncClient(base_url=server.base_url, headers=auth, timeout=30) as w:
                    while True:
                        st = (await w.get("/debug/state")).json()
                        peak["running"] = max(peak["running"], st["running"])
                        await asyncio.sleep(0.1)

            watcher = asyncio.create_task(watch())
            try:
                return await asyncio.gather(*(guarded(j) for j in jobs)), peak["running"]
            finally:
                watcher.cancel()

    errors_before = server.state()["step_errors"]
    t0 = time.perf_counter()
    results, peak_running = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    assert len(results) == 200
    by_prompt = {}
    for (prompt, max_tokens, stream), (text, reason, ntok) in zip(jobs, results):
        assert reason in ("stop", "length"), (prompt, reason)
        assert 1 <= ntok <= max_tokens and (reason == "stop" or ntok == max_tokens)
        by_prompt.setdefault(prompt, {})[stream] = (text, reason, ntok)
    for prompt, pair in by_prompt.items():
        assert pair[True] == pair[False], prompt  # same text, finish reason and token count
    assert peak_running >= 16, f"requests were not batched (peak running {peak_running})"
    st = server.wait_idle(timeout=10)
    assert st["kv_slots_used"] == 0 and st["kv_slots_free"] == st["kv_slots_total"]
    assert st["step_errors"] == errors_before
    print(f"200 requests in {elapsed:.1f} s, peak running batch {peak_running}")
