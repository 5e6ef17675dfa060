"""One real server for the whole directory: the embedded SmolLM2 on CPU, served by uvicorn
from a background thread on a free loopback port, with an API key.

Scheduler entry points are wrapped to record the thread that calls them, so tests can check
that only the engine-loop thread ever touches the scheduler.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Set

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class LiveServer:
    base_url: str
    engine: Any
    app: Any
    thread: Any
    scheduler_callers: Set[int] = field(default_factory=set)

    @property
    def loop(self):
        return self.app.state.ctx.loop

    def state(self) -> Dict[str, Any]:
        r = httpx.get(self.base_url + "/debug/state", headers=AUTH, timeout=10)
        r.raise_for_status()
        return r.json()

    def is_idle(self, st: Dict[str, Any]) -> bool:
        return is_idle(st)

    def wait_idle(self, timeout: float = 30.0) -> Dict[str, Any]:
        """Poll until nothing runs or waits and every KV slot is free; return the state.

        Raises:
            AssertionError: not idle after ``timeout`` seconds (the last state is shown).
        """
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if is_idle(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {st}")
            time.sleep(0.05)


def is_idle(st: Dict[str, Any]) -> bool:
    return (st["running"] == 0 and st["waiting"] == 0 and st["live_requests"] == 0
            and st["kv_slots_free"] == st["kv_slots_total"] and st["req_rows_free"] == st["req_rows_total"]
            and st["tracked_requests"] == 0)


def _record_callers(scheduler, callers: Set[int]) -> None:
    for name in ("add_request", "abort_request", "step"):
        original = getattr(scheduler, name)

        def wrapped(*a, __original=original, **kw):
            callers.add(threading.get_ident())
            return __original(*a, **kw)

        setattr(scheduler, name, wrapped)


@pytest.fixture(scope="session")
def server():
    from attnserve.engine.engine import Engine
    from attnserve.server.launch import ServerThread, create_app
    from attnserve.server_args import ServerArgs

    engine = Engine(ServerArgs())  # embedded SmolLM2-135M, CPU, torch_native
    callers: Set[int] = set()
    _record_callers(engine.scheduler, callers)
    app = create_app(engine, api_key=API_KEY)
    thread = ServerThread(app).start()
    live = LiveServer(thread.base_url, engine, app, thread, callers)
    yield live
    thread.stop()


@pytest.fixture(scope="session")
def api_key():
    return API_KEY


@pytest.fixture(scope="module")
def oai(server, api_key):
    """The official ``openai`` client on the shared server (skips without the package)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def auth():
    return dict(AUTH)


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as c:
        yield c
