"""The server's intake path (issue 33 item 5): cheap checks of token-id prompts, and the
HTTP process's commands to the engine process batched per event-loop iteration, in order.
No engine is built: the engine process's end of the connection is read by the test."""

import asyncio
import pickle
import socket
import threading
from multiprocessing.connection import Connection

import pytest

from attnserve.engine.sampling_params import SamplingParams
from attnserve.model_loader.tokenizer import tokenize_prompt
from attnserve.server.request_fields import lone_surrogate


def test_lone_surrogate_skips_token_ids_and_still_finds_text():
    assert lone_surrogate(list(range(5000))) is None
    assert lone_surrogate([[1, 2], [3, 4]]) is None
    assert lone_surrogate([1, 2.5, None, True]) is None
    assert lone_surrogate(["ok", "bad\ud800"]) == 3
    assert lone_surrogate([1, 2, "x\udfff"]) == 1  # a string among numbers is still checked
    assert lone_surrogate({"k": [7, "\ud800"]}) == 0


@pytest.mark.parametrize("ids", [[5, -1], [5, 100], [5, True], [5, 2.0], [5, "7"]])
def test_token_id_prompt_refuses_what_it_refused_before(ids):
    with pytest.raises(ValueError, match=r"integers in \[0, 100\)"):
        tokenize_prompt(None, 100, ids)


def test_token_id_prompt_accepts_ids_in_range():
    ids = [0, 99, 42]
    assert tokenize_prompt(None, 100, ids) == ids
    assert tokenize_prompt(None, 100, (1, 2)) == [1, 2]


class _Proc:
    pid = 0
    exitcode = None

    def is_alive(self):
        return True

    def join(self, timeout=None):
        pass


def _messages(conn: Connection, timeout: float = 2.0):
    out = []
    while conn.poll(timeout):
        out.append(pickle.loads(conn.recv_bytes()))
        timeout = 0.2
    return out


def test_commands_of_one_iteration_go_out_together_in_order():
    from attnserve.server.engine_client import EngineClient
    from attnserve.server.engine_loop import RequestStream, SubmitCommand

    ours, theirs = socket.socketpair()
    engine_end = Connection(theirs.detach())
    client = EngineClient(_Proc(), Connection(ours.detach()))

    async def burst():
        await client.start_async()
        sp = SamplingParams(max_new_tokens=4)
        for i in range(10):  # one event-loop iteration, as a burst of handlers
            client.submit(SubmitCommand(f"r{i}", [1, 2, 3], sp, RequestStream()))
        client.abort("r3")
        t = threading.Thread(target=client.abort, args=("r4",))  # another thread: queued after
        t.start()
        t.join()
        for _ in range(5):
            await asyncio.sleep(0.01)
        client.flush_cache()  # not batched: goes out at once
        await asyncio.sleep(0.01)
        return _messages(engine_end)

    msgs = asyncio.run(burst())
    cmds = [c for m in msgs for c in m]
    assert [c[0] for c in cmds] == ["submit"] * 10 + ["abort", "abort", "flush_cache"]
    assert [c[1] for c in cmds[:12]] == [f"r{i}" for i in range(10)] + ["r3", "r4"]
    assert msgs[0] == [cmds[0]]  # the first submit at once (an idle engine starts on it)
    assert len(msgs[1]) >= 10  # the rest of the iteration in one message
    assert len(msgs) <= 4
    engine_end.close()
