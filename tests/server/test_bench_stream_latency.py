"""bench.serving's TTFT and inter-token latency on a model without a tokenizer (a dummy
shape, as the H100 serving runs use): half the requests streamed, through the in-thread
engine loop and through the engine process. Such a model makes no text, so the server sends
an empty chunk per report of new tokens; streamed requests must still get every token."""

import asyncio
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from attnserve.bench.serving import random_workload, run_load, set_stream_fraction, summarize  # noqa: E402
from attnserve.server.launch import ServerThread, create_app  # noqa: E402
from attnserve.server_args import ServerArgs  # noqa: E402


def _tiny() -> ServerArgs:
    return ServerArgs(model="qwen3-tiny", load_format="dummy")  # no tokenizer


@pytest.fixture(scope="module", params=["engine-loop", "engine-process"])
def tokenless_server(request):
    if request.param == "engine-loop":
        from attnserve.engine.engine import Engine

        engine, loop = Engine(_tiny()), None
    else:
        from attnserve.server.engine_client import start_engine_process

        engine, loop = start_engine_process(_tiny())
    assert engine.tokenizer is None
    thread = ServerThread(create_app(engine, loop=loop)).start()
    yield thread.base_url
    thread.stop()
    engine.shutdown()


def test_streamed_requests_report_ttft_and_every_token(tokenless_server):
    vocab = 301  # qwen3-tiny's vocabulary (prompt ids must lie below it)
    work = random_workload(6, (4, 24), (3, 9), seed=3, token_range=(1, vocab))
    set_stream_fraction(work, 0.5)
    results, duration = asyncio.run(run_load(tokenless_server, "qwen3-tiny", None, work, float("inf"), None,
                                             seed=0, timeout=120.0))
    assert all(r.ok for r in results), [r.error for r in results]
    streamed = [r for r in results if r.stream]
    whole = [r for r in results if not r.stream]
    assert len(streamed) == 3 and len(whole) == 3
    for w, r in zip(work, results):
        assert r.output_tokens == w.payload["max_tokens"]  # ignore_eos: exactly the asked length
    for r in streamed:
        # one chunk per generated token (no speculation, one token per step): n - 1 gaps
        assert 0 < r.ttft <= r.e2e and len(r.itl) == r.output_tokens - 1
        assert all(g >= 0 for g in r.itl)
    for r in whole:
        assert math.isnan(r.ttft) and r.itl == []
    s = summarize(results, duration)
    assert s["completed"] == 6 and s["completed_streamed"] == 3
    assert s["ttft_ms"]["requests"] == 3 and s["e2e_ms"]["requests"] == 6
    assert s["itl_ms"]["requests"] == 3 and s["itl_ms"]["gaps"] == sum(r.output_tokens - 1 for r in streamed)
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        st = s[key]
        assert all(math.isfinite(st[k]) for k in ("mean", "p50", "p90", "p99")), (key, st)
        assert 0 <= st["p50"] <= st["p90"] <= st["p99"]
