"""``--dp-size 2`` on CPU: two engine processes of the tiny dummy Qwen3 shape behind one
server (`attnserve.server.data_parallel`). One module-scoped server: 64 mixed requests
(lengths, streaming, a shared prefix) with zero failures and both replicas used, per-replica
``/metrics``; then (last) one replica is killed mid-run: its requests end with 503 naming
it, the other keeps serving, no process is left, ``/health`` says degraded."""

import asyncio
import json
import os
import random
import signal
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from attnserve.server.data_parallel import start_data_parallel  # noqa: E402
from attnserve.server.launch import ServerThread, create_app  # noqa: E402
from attnserve.server_args import ServerArgs  # noqa: E402


def _metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == {"model_name": "qwen3-tiny", **labels}:
                return s.value
    raise AssertionError(f"{name}{labels} not in /metrics")


class _Served:
    def __init__(self):
        args = ServerArgs(model="qwen3-tiny", load_format="dummy", device="cpu", dp_size=2)
        self.engine, self.ctl = start_data_parallel(args)
        self.app = create_app(self.engine, loop=self.ctl)
        self.thread = ServerThread(self.app).start()
        self.base_url = self.thread.base_url

    def close(self):
        self.thread.stop()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def served():
    s = _Served()
    yield s
    s.close()
    for c in s.ctl.clients:
        assert not c.process.is_alive()


async def _one(c: httpx.AsyncClient, body: dict):
    """(HTTP status or ``stream-error:<code>``, completion tokens or the error body, cached
    tokens) of one request, streamed or not."""
    if not body.get("stream"):
        r = await c.post("/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, r.json(), 0
        usage = r.json()["usage"]
        return 200, usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    async with c.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread()), 0
        lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    if "error" in last:  # the stream had started (200): the error is its last event
        return f"stream-error:{last['error']['code']}", last, 0
    return 200, last["usage"]["completion_tokens"], last["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_replicas_serve_64_mixed_requests(served):
    rng = random.Random(0)
    shared = [rng.randrange(5, 300) for _ in range(48)]
    bodies = []
    for i in range(64):
        n = rng.randrange(3, 120)
        prompt = [rng.randrange(5, 300) for _ in range(n)]
        if i % 4 == 0:
            prompt = shared + prompt[:8]  # a shared 48-token prefix
        bodies.append({"prompt": prompt, "max_tokens": rng.randrange(1, 12), "ignore_eos": True,
                       "temperature": 0.7 if i % 5 == 0 else 0, "stream": i % 3 == 0})

    async def run():
        async with httpx.AsyncClient(base_url=served.base_url, timeout=120) as c:
            burst = await asyncio.gather(*(_one(c, b) for b in bodies))
            again = [await _one(c, {"prompt": shared + [7, 8, 9], "max_tokens": 2}) for _ in range(2)]
            return burst, again

    burst, again = asyncio.run(run())
    assert [r[0] for r in burst] == [200] * 64, [r for r in burst if r[0] != 200][:3]
    assert [r[1] for r in burst] == [b["max_tokens"] for b in bodies]
    st = httpx.get(served.base_url + "/debug/state").json()
    routed = [r["routed"] for r in st["replicas"]]
    assert st["dp_size"] == 2 and sum(routed) == 66 and min(routed) > 0, routed
    assert all(r[0] == 200 and r[2] >= 48 for r in again), again  # the prefix sits in its replica's cache
    assert served.ctl.balancer.affinity_hits > 0
    # every request ended, so no work is left on the balancer's books
    assert [(c.num_in_flight, c.outstanding_work) for c in served.ctl.clients] == [(0, 0.0)] * 2
    assert httpx.get(served.base_url + "/health").json() == {"status": "ok"}
    deadline = time.monotonic() + 10
    while True:  # the replicas' state snapshots arrive after the last tokens
        text = httpx.get(served.base_url + "/metrics").text
        if _metric(text, "attnserve_num_running_reqs") == 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    gen = [_metric(text, "attnserve_generation_tokens_total", dp_rank=str(i)) for i in range(2)]
    assert min(gen) > 0 and sum(gen) == _metric(text, "attnserve_generation_tokens_total") == sum(
        b["max_tokens"] for b in bodies) + 4
    assert _metric(text, "attnserve_kv_slots_total") == sum(
        _metric(text, "attnserve_kv_slots_total", dp_rank=str(i)) for i in range(2)) > 0
    assert _metric(text, "attnserve_dp_replica_up", dp_rank="1") == 1
    # /flush_cache reaches every replica: both prefix caches empty
    assert sum(r["kv_slots_cached"] for r in httpx.get(served.base_url + "/debug/state").json()["replicas"]) > 0
    assert httpx.post(served.base_url + "/flush_cache").status_code == 200
    while any(r["kv_slots_cached"] for r in httpx.get(served.base_url + "/debug/state").json()["replicas"]):
        assert time.monotonic() < deadline + 20
        time.sleep(0.05)


def test_a_killed_replica_fails_only_its_requests(served):
    """Last in this module: replica 1 dies with requests open."""
    victim = served.ctl.clients[1]
    pid = victim.process.pid
    long = {"max_tokens": 400, "ignore_eos": True}
    routed_before = sum(served.ctl.routed)

    async def run():
        async with httpx.AsyncClient(base_url=served.base_url, timeout=120) as c:
            tasks = [asyncio.ensure_future(_one(c, {**long, "prompt": [9 + i, 5, 6], "stream": i % 2 == 0}))
                     for i in range(12)]
            deadline = time.monotonic() + 60
            # every request routed, and both replicas running some
            while (sum(served.ctl.routed) - routed_before < 12
                   or not all(r.get("running", 0) >= 1 for r in served.ctl.state()["replicas"])):
                assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                await asyncio.sleep(0.02)
            on_victim = victim.num_in_flight
            assert victim.outstanding_work > 0  # its open requests' estimated work
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            results = []
            for t in asyncio.as_completed(tasks):
                results.append((await t, time.monotonic() - killed_at))
            health = await c.get("/health")
            after = await asyncio.gather(*(_one(c, {"prompt": [20 + i, 5, 6, 7], "max_tokens": 3})
                                           for i in range(6)))
            return on_victim, results, health, after

    on_victim, results, health, after = asyncio.run(run())
    failed = [(r, dt) for r, dt in results if r[0] != 200]
    assert on_victim > 0 and len(failed) == on_victim, (on_victim, [r for r, _ in results])
    for r, dt in failed:
        assert r[0] in (503, "stream-error:engine_dead") and "replica 1" in json.dumps(r[1]) and dt < 30.0, (r, dt)
    assert all(r[1] == 400 for r, _ in results if r[0] == 200)  # the other replica finished its requests
    assert health.status_code == 200 and health.json() == {"status": "degraded", "dead_replicas": [1]}
    assert [r[0] for r in after] == [200] * 6  # new requests go to the live replica
    assert victim.process.exitcode == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{pid}"), "the dead replica's process was not reaped"
    text = httpx.get(served.base_url + "/metrics").text
    assert _metric(text, "attnserve_dp_replica_up", dp_rank="1") == 0


def test_replicas_report_the_model_facts_of_the_floor(served):
    from attnserve.bench.roofline import RooflineModel

    rm = RooflineModel(**served.engine.info["roofline_model"])  # what bench.offline's dp floor reads
    assert rm.params > 0 and rm.weight_bytes > 0 and rm.num_layers > 0 and rm.kv_bytes_per_token > 0
