"""Host work of the serving path per generated token, pinned by counts (issue 33 item 5):
the engine process sends one message per step whatever the number of requests, and a
request whose client waits for the whole answer (``stream`` false) is reported on its
first token, every `QUIET_INTERVAL` tokens and at its end instead of every step, with the
same final text and token count. Fake engine of test_engine_loop (no model)."""

import asyncio
import multiprocessing
import pickle

from test_engine_loop import FakeEngine

from attnserve.engine.sampling_params import SamplingParams
from attnserve.server.engine_loop import QUIET_INTERVAL, EngineLoop, RequestStream, SubmitCommand
from attnserve.server.engine_process import ProcessEngineLoop

N_TOK = 2 * QUIET_INTERVAL + 20  # three reports between the first token and the end


def _quiet_reports(n_tok: int) -> int:
    """Entries of a non-streamed request of ``n_tok`` tokens: the first token, one every
    `QUIET_INTERVAL` tokens after it while it runs, and the end."""
    return 1 + (n_tok - 2) // QUIET_INTERVAL + 1


def test_engine_process_sends_one_message_per_step_and_quiet_requests_at_intervals():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    engine = FakeEngine()
    loop = ProcessEngineLoop(engine, theirs, idle_poll_s=0.01, state_interval_s=3600.0)
    n_req = 16
    for i in range(n_req):
        cmd = ("submit", f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=N_TOK))
        loop._command(cmd if i % 2 == 0 else cmd + (False,))  # odd ones: not streamed
    loop._flush()
    accept = pickle.loads(ours.recv_bytes())
    assert [e[0] for e in accept[1]] == ["e"] * n_req
    per_step, entries = [], {f"r{i}": [] for i in range(n_req)}
    while engine.has_work():
        loop._iterate()
        got = 0
        while ours.poll(0):
            msg = pickle.loads(ours.recv_bytes())
            assert msg[0] == "out"
            got += 1
            for e in msg[1]:
                assert e[0] == "t"
                entries[e[1]].append(e)
        per_step.append(got)
    assert len(per_step) == N_TOK and set(per_step) == {1}  # one message per step for the whole batch
    for i in range(n_req):
        ents = entries[f"r{i}"]
        assert len(ents) == (N_TOK if i % 2 == 0 else _quiet_reports(N_TOK))
        assert sum(len(e[2]) for e in ents) == N_TOK  # every token id crosses once
        assert ents[-1][3] == N_TOK and ents[-1][4] == "length" and ents[-1][5] == "a" * N_TOK
    assert not loop._live and engine.requests == {}


def test_in_process_loop_reports_quiet_requests_at_intervals_with_the_same_answer():
    engine = FakeEngine()
    loop = EngineLoop(engine, None, idle_poll_s=0.01)
    loop.start()

    async def run(rid, stream_tokens):
        stream = RequestStream()
        loop.submit(SubmitCommand(rid, [1, 2], SamplingParams(max_new_tokens=N_TOK), stream,
                                  stream_tokens=stream_tokens))
        events = []
        while not (events and events[-1].final):
            events.append(await stream.get())
        return events

    async def main():
        return await asyncio.gather(run("s", True), run("w", False))

    try:
        streamed, whole = asyncio.run(main())
    finally:
        loop.stop()
    for events in (streamed, whole):
        assert "".join(e.text for e in events) == "a" * N_TOK
        assert events[-1].finish_reason == "length" and events[-1].completion_tokens == N_TOK
    assert len(streamed) == 1 + N_TOK  # acceptance + one event per token
    assert len(whole) == 1 + _quiet_reports(N_TOK)
