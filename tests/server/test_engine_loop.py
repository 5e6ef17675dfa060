"""`EngineLoop` with a fake engine (no model): thread contract, failure isolation, queue
full, abort, shutdown, a dying loop thread, a graceful drain; and the same thread contract
on the real server."""

import asyncio
import threading
import time

import pytest
import torch

from attnserve.engine.request import FinishReason, Req
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.scheduler import QueueFullError
from attnserve.server.engine_loop import EngineLoop, RequestStream, SubmitCommand
from attnserve.server.metrics import ServerMetrics

POISON_STEP, POISON_ADD, POISON_KILL = 666, 777, 888


class LoopKilled(BaseException):
    """Escapes the loop's per-iteration ``except Exception``: the loop thread dies."""


class _Pool:
    def __init__(self, size):
        self.size = size
        self.free = size

    def available_size(self):
        return self.free

    def clear(self):
        self.free = self.size


class _KVCache:
    dtype = torch.float32

    def mem_bytes(self):
        return 4096


class _Runner:
    def __init__(self):
        self.token_to_kv_pool_allocator = _Pool(100)
        self.req_to_token_pool = _Pool(8)
        self.token_to_kv_pool = _KVCache()


class FakeEngine:
    """Generates token 1 ("a") per step; a prompt holding ``POISON_STEP`` makes `step` raise,
    ``POISON_ADD`` makes `add_request` raise a non-ValueError. Records calling threads."""

    def __init__(self, max_waiting=None):
        self.scheduler = self
        self.model_runner = _Runner()
        self.running, self.waiting, self.requests = [], [], {}
        self.threads = set()
        self.max_waiting = max_waiting
        self.num_steps = 0

    def _called(self):
        self.threads.add(threading.get_ident())

    def add_request(self, prompt_ids, sp, rid=None):
        self._called()
        if POISON_ADD in prompt_ids:
            raise KeyError("boom in add")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError("queue full")
        req = Req(rid=rid, prompt_ids=list(prompt_ids), sampling_params=sp, max_total_len=100)
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def abort_request(self, rid):
        self._called()
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        req.finish_reason = FinishReason.ABORT
        for lst in (self.waiting, self.running):
            if req in lst:
                lst.remove(req)
        return True

    def forget(self, rid):
        req = self.requests.get(rid)
        if req is not None and req.finished:
            del self.requests[rid]

    def has_work(self):
        return bool(self.waiting or self.running)

    def step(self):
        self._called()
        self.num_steps += 1
        self.running += self.waiting
        self.waiting = []
        if any(POISON_STEP in r.prompt_ids for r in self.running):
            self.model_runner.token_to_kv_pool_allocator.free -= 3  # a half-done step leaks slots
            raise RuntimeError("boom in step")
        if any(POISON_KILL in r.prompt_ids for r in self.running):
            raise LoopKilled("the engine loop thread dies")
        for r in self.running:
            r.output_ids.append(1)
            r.text += "a"
            if len(r.output_ids) >= r.sampling_params.max_new_tokens:
                r.finish_reason = FinishReason.LENGTH
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return list(self.running) + done


async def _run(loop: EngineLoop, rid: str, prompt, max_tokens=3):
    stream = RequestStream()
    loop.submit(SubmitCommand(rid, prompt, SamplingParams(max_new_tokens=max_tokens), stream))
    events = []
    while True:
        ev = await stream.get()
        events.append(ev)
        if ev.final:
            return events


@pytest.fixture()
def fake():
    engine = FakeEngine()
    loop = EngineLoop(engine, ServerMetrics("fake"), idle_poll_s=0.01)
    loop.start()
    yield engine, loop
    loop.stop()


def test_only_the_loop_thread_calls_the_engine(fake):
    engine, loop = fake

    async def main():
        return await asyncio.gather(*(_run(loop, f"r{i}", [1, 2, 3]) for i in range(5)))

    results = asyncio.run(main())
    for events in results:
        assert events[0].error is None and events[-1].finish_reason == "length"
        assert "".join(e.text for e in events) == "aaa" and events[-1].completion_tokens == 3
    # the loop pushes a request's final event, then forgets it: join the thread so that the
    # forgetting of the last request is not raced by this check (stop() is idempotent)
    loop.stop()
    assert engine.threads == {loop.thread_id}
    assert engine.requests == {}  # finished requests are forgotten


def test_step_exception_fails_batch_and_loop_survives(fake):
    engine, loop = fake

    async def main():
        bad = await _run(loop, "bad", [POISON_STEP])
        good = await _run(loop, "good", [1])
        return bad, good

    bad, good = asyncio.run(main())
    assert bad[-1].error is not None and bad[-1].error.status == 500 and "boom in step" in bad[-1].error.message
    assert good[-1].finish_reason == "length"
    assert loop.is_alive() and loop.step_errors == 1
    alloc = engine.model_runner.token_to_kv_pool_allocator
    assert alloc.available_size() == alloc.size  # leaked slots were reclaimed once idle


def test_add_errors_are_reported_per_request():
    engine = FakeEngine(max_waiting=0)
    loop = EngineLoop(engine, None, idle_poll_s=0.01)
    loop.start()
    try:
        async def main():
            return await _run(loop, "a", [POISON_ADD]), await _run(loop, "b", [1])

        crashed, full = asyncio.run(main())
        assert crashed[0].error.status == 500 and "boom in add" in crashed[0].error.message
        assert full[0].error.status == 503 and full[0].error.code == "queue_full"
        assert loop.is_alive()
    finally:
        loop.stop()


def test_abort_and_shutdown(fake):
    engine, loop = fake

    async def main():
        stream = RequestStream()
        loop.submit(SubmitCommand("long", [1], SamplingParams(max_new_tokens=10**6), stream))
        assert (await stream.get()).error is None
        await stream.get()  # generating
        loop.abort("long")
        while True:
            ev = await stream.get()
            if ev.final:
                return ev

    ev = asyncio.run(main())
    assert ev.finish_reason == "abort" and engine.requests == {} and not engine.running
    loop.stop()
    assert not loop.is_alive()

    async def after_stop():
        return await _run(loop, "late", [1])

    assert asyncio.run(after_stop())[0].error.status == 503


def test_dead_loop_fails_running_and_later_requests_with_503():
    """The loop thread dies (an exception its guard cannot catch) while a request runs:
    that request and the one that killed it end with 503 ``engine_dead`` instead of
    hanging, the loop reports itself dead, and a later submit is refused at once."""
    engine = FakeEngine()
    loop = EngineLoop(engine, None, idle_poll_s=0.01)
    loop.start()

    async def main():
        running = RequestStream()
        loop.submit(SubmitCommand("long", [1], SamplingParams(max_new_tokens=10**6), running))
        assert (await running.get()).error is None
        assert (await running.get()).text == "a"  # generating
        killer = asyncio.ensure_future(_run(loop, "killer", [POISON_KILL]))
        while True:
            ev = await asyncio.wait_for(running.get(), 5)
            if ev.final:
                break
        killed = await asyncio.wait_for(killer, 5)
        t0 = time.monotonic()
        late = await asyncio.wait_for(_run(loop, "late", [1]), 5)
        return ev, killed, late, time.monotonic() - t0

    ev, killed, late, late_s = asyncio.run(main())
    assert ev.error is not None and ev.error.status == 503 and ev.error.code == "engine_dead"
    assert killed[-1].error is not None and killed[-1].error.code == "engine_dead"
    assert len(late) == 1 and late[0].error.code == "engine_dead" and late_s < 1.0
    assert not loop.is_alive() and loop.wait_drained(1.0)
    assert engine.requests == {} and not engine.running  # aborted and forgotten on the way out


def test_drain_refuses_new_requests_and_ends_running_ones_at_the_deadline(fake):
    engine, loop = fake
    grace = 0.3

    async def main():
        running = RequestStream()
        loop.submit(SubmitCommand("long", [1], SamplingParams(max_new_tokens=10**7), running))
        assert (await running.get()).error is None
        await running.get()  # generating
        t0 = time.monotonic()
        loop.begin_drain(grace)
        refused = await asyncio.wait_for(_run(loop, "new", [1]), 5)
        texts = 0
        while True:
            ev = await asyncio.wait_for(running.get(), 5)
            texts += bool(ev.text)
            if ev.final:
                return refused, ev, texts, time.monotonic() - t0

    refused, ev, texts, ended_s = asyncio.run(main())
    assert refused[0].error.status == 503 and refused[0].error.code == "shutting_down"
    assert texts > 1  # the running request kept generating during the grace period
    assert ev.error is not None and ev.error.code == "shutting_down" and ended_s >= grace
    assert loop.wait_drained(5.0) and loop.draining and engine.requests == {}


def test_real_server_scheduler_only_on_loop_thread(server, client):
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert server.scheduler_callers == {server.loop.thread_id}


def test_engine_and_server_modules_import_without_server_deps():
    """The GPU box lacks fastapi/uvicorn: the engine and the server's entry modules must
    import without them (FastAPI is imported only when an app is built)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client', 'httpx'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import attnserve, attnserve.cli, attnserve.engine.engine, attnserve.engine.llm\n"
        "import attnserve.server.launch, attnserve.server.engine_loop, attnserve.server.metrics\n"
        "import attnserve.server.errors, attnserve.server.middleware\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
