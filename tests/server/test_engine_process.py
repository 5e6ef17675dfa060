"""The multi-process server (``--engine-process on``): the engine in a process of its own,
HTTP, tokenization and streaming detokenization in the test's process.

One engine process serves the embedded SmolLM2 (real tokenizer) for most tests: streamed
text equals the whole text, stop strings, usage and prefix-cache fields, bad input, abort
on disconnect freeing the KV, metrics; the last test drains it. Separate engine processes
of the tiny dummy Qwen3 shape check a full queue, a dead engine, and start-up errors."""

import asyncio
import json
import os
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from attnserve.server.engine_client import start_engine_process  # noqa: E402
from attnserve.server.launch import ServerThread, create_app  # noqa: E402
from attnserve.server_args import ServerArgs  # noqa: E402


def is_idle(st) -> bool:
    return (st["running"] == 0 and st["waiting"] == 0 and st["live_requests"] == 0
            and st["kv_slots_free"] == st["kv_slots_total"] and st["req_rows_free"] == st["req_rows_total"]
            and st["tracked_requests"] == 0)


def _metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


class _Served:
    def __init__(self, server_args: ServerArgs):
        self.engine, self.client = start_engine_process(server_args)
        self.app = create_app(self.engine, loop=self.client)
        self.thread = ServerThread(self.app).start()
        self.base_url = self.thread.base_url

    def state(self):
        return httpx.get(self.base_url + "/debug/state", timeout=10).json()

    def wait_idle(self, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if is_idle(st):
                return st
            assert time.monotonic() < deadline, f"not idle after {timeout} s: {st}"
            time.sleep(0.05)

    def close(self):
        self.thread.stop()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def served():
    s = _Served(ServerArgs())  # embedded SmolLM2-135M on CPU
    yield s
    s.close()


def _sse_text(lines):
    text, usage = "", None
    for ln in lines:
        if ln.startswith("data: ") and ln != "data: [DONE]":
            chunk = json.loads(ln[len("data: "):])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text += c.get("text") or ""
            usage = chunk.get("usage") or usage
    return text, usage


def test_engine_runs_in_another_process(served):
    assert served.client.process.pid != os.getpid() and served.client.process.is_alive()
    st = served.state()
    assert st["engine_alive"] and st["device"] == "cpu" and st["model"] == "smollm2-135m"
    assert httpx.get(served.base_url + "/health").json() == {"status": "ok"}
    assert not hasattr(served.engine, "scheduler")  # no engine state in the HTTP process


def test_streamed_text_equals_whole_text_with_a_stop_string(served):
    body = {"prompt": "The capital of France is Paris. The capital of Germany is", "max_tokens": 40,
            "temperature": 0}
    whole = httpx.post(served.base_url + "/v1/completions", json=body, timeout=120).json()
    text = whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] >= 1 and text
    stop = text.strip()[3:6]  # a stop string that the greedy output reaches
    assert stop and stop in text
    with httpx.stream("POST", served.base_url + "/v1/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        streamed, usage = _sse_text(list(r.iter_lines()))
    assert streamed == text and usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    cut = httpx.post(served.base_url + "/v1/completions", json={**body, "stop": [stop]}, timeout=120).json()
    with httpx.stream("POST", served.base_url + "/v1/completions", timeout=120,
                      json={**body, "stop": [stop], "stream": True}) as r:
        streamed_cut, _ = _sse_text(list(r.iter_lines()))
    assert cut["choices"][0]["finish_reason"] == "stop" and stop not in cut["choices"][0]["text"]
    assert streamed_cut == cut["choices"][0]["text"] == text[: text.index(stop)]
    # the same prompt again: its prefix is served from the cache and reported so
    again = httpx.post(served.base_url + "/v1/completions", json=body, timeout=120).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    served.wait_idle()


def test_chat_and_several_choices(served):
    r = httpx.post(served.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    r = httpx.post(served.base_url + "/v1/completions", timeout=120,
                   json={"prompt": "Once upon a time", "max_tokens": 6, "n": 3, "temperature": 0.8, "seed": 1,
                         "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 18


def test_bad_input(served):
    url = served.base_url + "/v1/completions"
    r = httpx.post(url, json={"prompt": [1, 2, 10**9], "max_tokens": 2})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "hi " * 9000, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url, json={"prompt": "", "max_tokens": 2})
    assert r.status_code == 400
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 or r.status_code == 422
    served.wait_idle()


def test_logprobs_over_the_connection(served):
    """Logprob entries travel with the token messages (issue 35): streamed chunks carry
    their tokens' logprobs, equal to the whole answer's; echo brings the prompt's; a
    logit_bias key outside the vocabulary is a 400 naming it."""
    url = served.base_url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "frequency_penalty": 0.5}
    whole = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == whole["message"]["content"] and len(content) == 6
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    streamed = [c for ch in chunks for choice in ch["choices"] if choice.get("logprobs")
                for c in choice["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert [c["logprob"] for c in streamed] == pytest.approx([c["logprob"] for c in content], abs=1e-4)
    r = httpx.post(served.base_url + "/v1/completions", timeout=120, json={
        "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
    assert r.json()["choices"][0]["text"] == "".join(lp["tokens"])
    r = httpx.post(served.base_url + "/v1/completions", json={"prompt": "hi", "logit_bias": {"49152": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_grammars_cross_the_process_boundary(served):
    """Constrained requests reach the engine process with their grammar (issue 35): a regex
    completion and a JSON-mode chat completion match; a malformed regex is a 400."""
    import re

    pytest.importorskip("xgrammar")
    url = served.base_url + "/v1"
    r = httpx.post(url + "/completions", timeout=120, json={
        "prompt": "Is water wet? Answer:", "max_tokens": 24, "temperature": 0, "regex": r"(yes|no)[.!]"}).json()
    assert re.fullmatch(r"(yes|no)[.!]", r["choices"][0]["text"]) and r["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(url + "/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Give me a JSON object with one key."}], "max_tokens": 96,
        "temperature": 0, "response_format": {"type": "json_object"}}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    bad = httpx.post(url + "/completions", timeout=60, json={"prompt": "hi", "regex": "(yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "regex"
    served.wait_idle()


def test_matched_stop_crosses_the_process_boundary(served):
    """What ended a request travels with its final token entry: SGLang's ``finish_reason``
    names the stop token id / stop string, the OpenAI routes' ``stop_reason`` the stop string;
    ``max_new_tokens: 0`` scores the prompt."""
    url, prompt = served.base_url, "The capital of France is"
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    g = httpx.post(url + "/generate", timeout=120, json={"text": prompt, "sampling_params": greedy,
                                                          "return_logprob": True}).json()
    tid = g["output_ids"][1]
    r = httpx.post(url + "/generate", timeout=120, json={"text": prompt,
                                                          "sampling_params": {**greedy, "stop_token_ids": [tid]}})
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": tid}, r.text
    stop = g["text"].strip()[1:4]
    c = httpx.post(url + "/v1/completions", timeout=120, json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                                "ignore_eos": True, "stop": [stop]}).json()
    assert c["choices"][0]["finish_reason"] == "stop" and c["choices"][0]["stop_reason"] == stop
    z = httpx.post(url + "/generate", timeout=120, json={"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    assert z.json()["text"] == "" and z.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    served.wait_idle()


def test_disconnects_abort_and_free_the_kv(served):
    aborted_before = _metric(httpx.get(served.base_url + "/metrics").text, "attnserve_requests_total",
                             finish_reason="abort")

    async def run():
        async def one(i):
            async with httpx.AsyncClient(base_url=served.base_url, timeout=120) as c:
                body = {"prompt": f"Request {i}: a long story about ships.", "max_tokens": 400, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and '"text":"' in line:
                            break  # leave after the first token
            return time.perf_counter()

        return await asyncio.gather(*(one(i) for i in range(8)))

    closed_at = max(asyncio.run(run()))
    while not is_idle(st := served.state()):
        assert time.perf_counter() - closed_at < 2.0, f"not freed within 2 s of the disconnects: {st}"
        time.sleep(0.02)
    aborted = _metric(httpx.get(served.base_url + "/metrics").text, "attnserve_requests_total", finish_reason="abort")
    assert aborted - aborted_before == 8
    assert served.client.state()["live_requests"] == 0 and not served.client._reqs


def test_metrics_fed_from_the_engine_process(served):
    text = httpx.get(served.base_url + "/metrics").text
    before = _metric(text, "attnserve_generation_tokens_total")
    r = httpx.post(served.base_url + "/v1/completions", timeout=120,
                   json={"prompt": "One two three", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    served.wait_idle()
    text = httpx.get(served.base_url + "/metrics").text
    assert _metric(text, "attnserve_generation_tokens_total") - before == 5
    assert _metric(text, "attnserve_time_to_first_token_seconds_count") >= 1
    assert _metric(text, "attnserve_kv_slots_total") == served.state()["kv_slots_total"] > 0
    st = served.state()
    assert st["loop_cpu_seconds"] >= st["step_cpu_seconds"] > 0


def test_drain_refuses_new_requests_and_ends_running_ones(served):
    """Last in this module: it stops the engine process."""
    results = {}

    async def run():
        async with httpx.AsyncClient(base_url=served.base_url, timeout=120) as c:
            async def long_stream():
                body = {"prompt": "An endless story:", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    results["lines"] = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]

            task = asyncio.ensure_future(long_stream())
            deadline = time.monotonic() + 60
            while served.client.state()["running"] < 1:
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.05)
            served.client.begin_drain(0.5)
            refused = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            results["refused"] = refused
            results["health"] = await c.get("/health")
            await task

    asyncio.run(run())
    assert results["refused"].status_code == 503 and results["refused"].json()["error"]["code"] == "shutting_down"
    assert results["health"].status_code == 503
    lines = results["lines"]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert served.client.wait_drained(10)
    served.close()
    assert not served.client.process.is_alive() and served.client.process.exitcode == 0


def _tiny(**kw) -> ServerArgs:
    return ServerArgs(model="qwen3-tiny", load_format="dummy", **kw)


def test_queue_full_then_a_dead_engine_is_503():
    s = _Served(_tiny(max_running_requests=1, max_queued_requests=1))
    try:
        url = s.base_url + "/v1/completions"
        long = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}  # the whole context (512)

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                for _attempt in range(5):  # until one request runs while the other waits (machine speed)
                    tasks = []
                    for want in ("running", "waiting"):  # admission is per step: send one at a time
                        tasks.append(asyncio.ensure_future(c.post(url, json=long)))
                        deadline = time.monotonic() + 60
                        while (st := s.client.state())[want] < 1 and not any(t.done() for t in tasks):
                            assert time.monotonic() < deadline, st
                            await asyncio.sleep(0.005)
                    if not any(t.done() for t in tasks):
                        break
                    await asyncio.gather(*tasks)
                else:
                    raise AssertionError("the long requests always finished before the queue filled")
                full = await c.post(url, json={"prompt": [5], "max_tokens": 2})
                open_at_kill = [t for t in tasks if not t.done()]
                s.client.process.kill()  # the engine dies with requests open
                return full, await asyncio.gather(*open_at_kill)

        full, open_ones = asyncio.run(run())
        assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
        assert open_ones, "no request was open when the engine died"
        for r in open_ones:
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        h = httpx.get(s.base_url + "/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
        r = httpx.post(url, json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert 'status="503"' in httpx.get(s.base_url + "/metrics").text
    finally:
        s.close()


def test_start_up_errors_are_raised_in_the_http_process():
    with pytest.raises(FileNotFoundError, match="not found"):
        start_engine_process(ServerArgs(model="/nonexistent/model-dir"))


def test_cli_sigterm_drains_and_stops_the_engine_process(tmp_path):
    """``attnserve serve --engine-process on``: SIGTERM ends a running stream with a
    ``shutting_down`` error event once the grace period (0 s) is over, and the server exits
    with the engine process gone. (With no grace the server may be gone before a new
    request connects; `test_drain_refuses_new_requests_and_ends_running_ones` checks the
    refusal.)"""
    import signal
    import socket
    import subprocess
    import sys
    import threading

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath("src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "attnserve", "serve", "--port", str(port), "--model",
                                 "qwen3-tiny", "--load-format", "dummy", "--engine-process", "on",
                                 "--graceful-shutdown-timeout", "0", "--log-level", "warning"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.3)
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        assert children, "the engine process is a child of the server"
        lines = []

        def stream():
            body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        lines.append(ln)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while httpx.get(base + "/debug/state").json()["running"] < 1:
            assert t.is_alive() and time.monotonic() < deadline, "the stream ended before it was seen running"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "shutting_down", lines[-3:]
        # a child may still be finishing its own exit (multiprocessing's resource tracker reads
        # EOF once the server is gone, then cleans up): each must be gone within 15 s
        deadline = time.monotonic() + 15
        for pid in children:
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                try:
                    if "zombie" in open(f"/proc/{pid}/status").read().lower():
                        break
                except FileNotFoundError:
                    break
                time.sleep(0.1)
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_incremental_detokenizer_matches_a_full_decode(server):
    """Text with multi-token characters (CJK, emoji, accents) fed in chunks of 1-4 ids:
    the incremental text is always a prefix of the full decode and equals it at the end;
    what is held back is exactly a proper prefix of a stop string, and the streamable
    length never shrinks."""
    import random

    from attnserve.server.detokenize import IncrementalDetokenizer

    tok = server.engine.tokenizer
    rng = random.Random(0)
    samples = ["Hello, world! Ça va? Größe — 東京タワーは高い。 🚀🎉 done.", "  leading spaces\n\tand tabs ",
               "naïve café 😀😃 数学 end", "STOP in the middle: abcSTOPdef"]
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(tok, ["STOP", "😃 数"])
        i, last_len = 0, 0
        while i < len(ids):
            k = rng.randint(1, 4)
            detok.add(ids[i:i + k])
            i += k
            assert full.startswith(detok.text), (detok.text, full)
            stable = detok.stable_text()
            held = detok.text[len(stable):]
            assert detok.text.startswith(stable) and len(stable) >= last_len
            assert held == "" or any(s.startswith(held) and len(held) < len(s) for s in detok.stop_strs), held
            last_len = len(stable)
        assert detok.text == full


def test_tensor_parallel_engine_in_its_process():
    """``--tp-size 2`` on CPU ranks: the engine process spawns the other rank, serves, and
    takes it down when stopped."""
    s = _Served(_tiny(tp_size=2, max_total_tokens=2048, max_running_requests=8))
    try:
        engine_pid = s.client.process.pid
        with open(f"/proc/{engine_pid}/task/{engine_pid}/children") as f:
            ranks = [int(x) for x in f.read().split()]
        assert ranks, "rank 1 is a child of the engine process"
        r = httpx.post(s.base_url + "/v1/completions", timeout=120,
                       json={"prompt": [1, 5, 9, 13], "max_tokens": 6, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
        s.wait_idle()
    finally:
        s.close()
    assert s.client.process.exitcode == 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in ranks)


class _ThreadAsProcess:
    """Stands for the engine process where the loop runs in a thread of the test."""

    def __init__(self, loop):
        self.loop = loop
        self.pid = os.getpid()
        self.exitcode = None

    def is_alive(self):
        return self.loop._thread is not None and self.loop._thread.is_alive()

    def join(self, timeout=None):
        self.loop._thread.join(timeout)

    def terminate(self):
        self.loop.stop()

    kill = terminate


def test_failing_step_over_the_connection_then_serving_goes_on():
    """`ProcessEngineLoop` and `EngineClient` over a real connection, with the fake engine of
    test_engine_loop (no process, no model): a step that raises fails its batch with 500,
    the leaked KV is reset, and the next requests are served; events arrive in order."""
    import multiprocessing

    from test_engine_loop import POISON_STEP, FakeEngine

    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.server.engine_client import EngineClient
    from attnserve.server.engine_loop import RequestStream, SubmitCommand
    from attnserve.server.engine_process import ProcessEngineLoop
    from attnserve.server.metrics import ServerMetrics

    ours, theirs = multiprocessing.Pipe(duplex=True)
    engine = FakeEngine()
    ploop = ProcessEngineLoop(engine, theirs, idle_poll_s=0.01, state_interval_s=0.0)
    ploop.start()
    client = EngineClient(_ThreadAsProcess(ploop), ours, metrics=ServerMetrics("p"))

    async def run(rid, prompt, n):
        stream = RequestStream()
        client.submit(SubmitCommand(rid, prompt, SamplingParams(max_new_tokens=n), stream))
        events = []
        while not (events and events[-1].final):
            events.append(await stream.get())
        return events

    async def main():
        await client.start_async()
        bad = await run("bad", [POISON_STEP], 3)
        good = await asyncio.gather(*(run(f"g{i}", [1, 2, 3], 2 + i) for i in range(3)))
        await client.stop_async(timeout=5)
        return bad, good

    bad, good = asyncio.run(main())
    assert bad[0].error is None and bad[0].prompt_tokens == 1  # accepted first
    assert bad[-1].error is not None and bad[-1].error.status == 500 and "boom in step" in bad[-1].error.message
    alloc = engine.model_runner.token_to_kv_pool_allocator
    assert alloc.free == alloc.size  # the slots the failed step leaked were reset
    for i, events in enumerate(good):
        assert events[0].error is None and not events[0].final
        last = events[-1]
        assert last.finish_reason == "length" and last.completion_tokens == 2 + i
        assert "".join(e.text for e in events) == "a" * (2 + i)  # the engine's final text
    assert ploop.step_errors == 1 and not client._reqs and not ploop._thread.is_alive()

