"""``python -m attnserve serve`` in a subprocess: loopback bind, API key, ``--served-model-name``,
503 when the waiting queue is full, clean shutdown on SIGTERM."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

KEY = "cli-key"
SERVED = "tiny-chat"
H = {"Authorization": f"Bearer {KEY}"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(log, *flags):
    """``attnserve serve`` on a free loopback port; returns (process, base URL) once healthy."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath("src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "attnserve", "serve", "--port", str(port), *flags],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.5)
    return proc, base


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("cli") / "server.log"
    proc, base = _start(log, "--api-key", KEY, "--max-running-requests", "1", "--max-queued-requests", "1",
                        "--served-model-name", SERVED, "--enable-metrics")
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_auth_queue_full_and_shutdown(cli_server):
    proc, base, log = cli_server
    assert httpx.post(base + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    st = httpx.get(base + "/debug/state", headers=H).json()
    assert st["req_rows_total"] == 2 and st["device"] == "cpu"  # --max-running-requests 1 (+1 spare row)
    # uvicorn runs on uvloop when it is installed (the server extra installs it), and says so
    assert st["event_loop"] == ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio")
    # --served-model-name: the id clients see and must name (or leave out)
    assert [m["id"] for m in httpx.get(base + "/v1/models", headers=H).json()["data"]] == [SERVED]
    named = httpx.post(base + "/v1/completions", headers=H, timeout=60,
                       json={"model": SERVED, "prompt": "Hi", "max_tokens": 1})
    assert named.status_code == 200 and named.json()["model"] == SERVED
    other = httpx.post(base + "/v1/completions", headers=H, json={"model": "smollm2-135m", "prompt": "Hi"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"

    with httpx.Client(base_url=base, headers=H, timeout=120) as c:
        body = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as long_stream:  # occupies the one running slot
            assert long_stream.status_code == 200
            lines = long_stream.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data: "))
            waiting_result = {}

            def queued():
                r = httpx.post(base + "/v1/completions", headers=H, timeout=120,
                               json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
                waiting_result["r"] = r

            t = threading.Thread(target=queued)
            t.start()
            deadline = time.monotonic() + 30
            while c.get("/debug/state").json()["waiting"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            full = c.post("/v1/completions", json={"prompt": "One more", "max_tokens": 2})
            assert full.status_code == 503, full.text
            err = full.json()["error"]
            assert err["code"] == "queue_full" and err["type"] == "server_overloaded"
        # leaving the stream aborts the long request; the queued one runs and succeeds
        t.join(60)
        assert waiting_result["r"].status_code == 200, waiting_result["r"].text
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "What is the capital "
                                                                "of France?"}], "max_tokens": 8, "temperature": 0})
        assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"]
        metrics = httpx.get(base + "/metrics").text
        assert f'attnserve_requests_rejected_total{{model_name="{SERVED}",status="503"}} 1.0' in metrics

    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises SIGTERM (exit status -15)
    assert proc.wait(30) in (0, -signal.SIGTERM), log.read_text()[-3000:]
    text = log.read_text()
    assert "engine loop stopped" in text and "Traceback" not in text


def test_cli_rejects_bad_flags():
    r = subprocess.run([sys.executable, "-m", "attnserve", "serve", "--page-size", "0", "--port", "1"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.path.abspath("src")})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("attnserve: error:")


def test_sigterm_drains_then_ends_running_requests_with_an_error(tmp_path):
    """SIGTERM while three long streams, one short stream and one long non-streamed request
    run: new requests (and /health) get 503 ``shutting_down`` at once, the short stream
    finishes normally within --graceful-shutdown-timeout, then each long stream gets an
    error event (code shutting_down) and ``data: [DONE]``, the non-streamed one a 503 JSON
    error; the process exits."""
    log = tmp_path / "server.log"
    grace = 3
    proc, base = _start(log, "--graceful-shutdown-timeout", str(grace))
    try:
        results, started = {}, threading.Semaphore(0)

        def stream(i, max_tokens):
            body = {"prompt": f"Story {i}:", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                lines = []
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        if not lines:
                            started.release()
                        lines.append(ln)
                results[i] = lines

        def plain():
            body = {"prompt": "A long essay:", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
            results["plain"] = httpx.post(base + "/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=plain)]
        threads[0].start()
        deadline = time.monotonic() + 60
        while httpx.get(base + "/debug/state").json()["running"] < 1:  # the non-streamed request runs
            assert time.monotonic() < deadline
            time.sleep(0.05)
        threads += [threading.Thread(target=stream, args=(i, 3000 if i < 3 else 8)) for i in range(4)]
        for t in threads[1:]:
            t.start()
        for _ in range(4):
            assert started.acquire(timeout=120)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        refused = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        health = httpx.get(base + "/health", timeout=30)
        assert time.monotonic() - t0 < grace, "the drain must answer new requests at once"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
        assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
        for t in threads:
            t.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
        short = results[3]
        assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in short[-2] and "error" not in "".join(short)
        for i in range(3):
            lines = results[i]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            err = json.loads(lines[-2][len("data: "):])["error"]
            assert err["code"] == "shutting_down", err
        assert results["plain"].status_code == 503 and results["plain"].json()["error"]["code"] == "shutting_down"
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
