"""The shared-memory step queue (`attnserve.distributed.shm_broadcast`): messages reach every
reader process in order, frames larger than a slot (and than the whole ring) arrive whole,
the ring wraps many times, a slow reader is never overwritten (the writer waits), and a
`StepMessage` keeps its tensors through protocol 5."""

import multiprocessing as mp
import os
import pickle
import time

import pytest
import torch

from attnserve.distributed.shm_broadcast import (ShmMessageQueue, ShmQueueAborted, ShmQueueHandle,
                                                 ShmQueueTimeout)
from shm_queue_reader import COUNT, NUM_SLOTS, SLOT_BYTES, digest, payload, reader

def test_messages_reach_every_process_in_order():
    ctx = mp.get_context("spawn")
    q = ShmMessageQueue.create(2, num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES)
    q.timeout_s = 60.0
    out = ctx.Queue()
    procs = [ctx.Process(target=reader, args=(q.handle, r, COUNT, 30 if r == 1 else 0, out), daemon=True)
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        path = os.path.join("/dev/shm", q.name)
        deadline = time.monotonic() + 60
        while not all(q.attached()):
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "readers did not attach"
            time.sleep(0.01)
        assert os.path.exists(path)
        q.unlink()  # what the engine does once everyone is attached: the mappings stay valid
        assert not os.path.exists(path)
        sizes = [q.enqueue(payload(i)) for i in range(COUNT)]
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        q.close()
    want = [digest(payload(i)) for i in range(COUNT)]
    assert results[0] == want
    assert results[1] == want  # the slow reader, too: nothing was overwritten before it read it
    assert max(sizes) > NUM_SLOTS * SLOT_BYTES  # a frame larger than the whole ring went through
    assert q._next - 1 > 20 * NUM_SLOTS  # the ring wrapped many times
    assert all(p.exitcode == 0 for p in procs)


def test_full_ring_makes_the_writer_wait():
    w = ShmMessageQueue.create(2, num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES)
    fast, slow = (ShmMessageQueue.attach(w.handle, r) for r in range(2))
    try:
        w.unlink()
        w.timeout_s = 0.3
        for i in range(NUM_SLOTS):
            w.enqueue(("m", i))
        for i in range(NUM_SLOTS):
            assert fast.dequeue() == ("m", i)
        t0 = time.perf_counter()
        with pytest.raises(ShmQueueTimeout, match=r"reader\(s\) \[1\]"):  # the slow reader holds slot 0
            w.enqueue(("m", NUM_SLOTS))
        assert time.perf_counter() - t0 >= 0.3
        assert slow.dequeue() == ("m", 0)  # intact
        w.enqueue(("m", NUM_SLOTS))  # slot 0 is free now
        w.abort_check = lambda: "rank 2 exited with code -9"
        with pytest.raises(ShmQueueAborted, match="rank 2 exited"):
            w.enqueue(("m", NUM_SLOTS + 1))  # slot 1 still unread by the slow reader
        w.abort_check = None
        for i in range(1, NUM_SLOTS + 1):
            assert slow.dequeue() == ("m", i)
        assert fast.dequeue() == ("m", NUM_SLOTS)
    finally:
        for end in (fast, slow, w):
            end.close()
        w.close()  # idempotent


def test_attach_checks_the_handle():
    w = ShmMessageQueue.create(1, num_slots=2, slot_bytes=128)
    try:
        with pytest.raises(ValueError, match="reader_rank 1"):
            ShmMessageQueue.attach(w.handle, 1)
        with pytest.raises(ValueError, match="header"):
            ShmMessageQueue.attach(ShmQueueHandle(w.name, 1, 2, 64), 0)
        with pytest.raises(RuntimeError, match="writer"):
            w.dequeue()
        assert w.attached() == [False]
        r = ShmMessageQueue.attach(w.handle, 0)
        assert w.attached() == [True]
        with pytest.raises(RuntimeError, match="reader 0"):
            r.enqueue(1)
        r.close()
    finally:
        w.close()
    with pytest.raises(FileNotFoundError):
        ShmMessageQueue.attach(w.handle, 0)  # closed writer: the name is gone
    with pytest.raises(ValueError, match="num_slots"):
        ShmMessageQueue.create(1, num_slots=1)


def test_step_message_through_the_queue_keeps_its_tensors():
    from attnserve.engine.logprobs import PromptLogprobPlan
    from attnserve.engine.step_inputs import host_step_layout
    from attnserve.engine.tp.step_sync import StepMessage
    from attnserve.forward_batch import ForwardMode

    host = host_step_layout([4, 2, 9], [10, 0, 5], [3, 8, 1])
    loc = torch.arange(100, 112)
    host.update(input_ids=torch.tensor([5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 8, -1]), out_cache_loc=loc,
                out_cache_loc_i32=loc.to(torch.int32), emit_index=torch.empty(0, dtype=torch.int64))
    plan = PromptLogprobPlan(token_index=torch.tensor([0, 3]), targets=torch.tensor([6, 2]), k=2)
    msg = StepMessage(ForwardMode.MIXED, host, [10, 0, 5], [3, 8, 1], True, 0,
                      [(4, 0, torch.arange(7, 17, dtype=torch.int32))], prompt_plan=plan)
    w = ShmMessageQueue.create(1, num_slots=8, slot_bytes=1024)  # the frame spans several slots of the ring
    r = ShmMessageQueue.attach(w.handle, 0)
    try:
        w.unlink()
        w.timeout_s = 5.0
        for _ in range(3):
            assert 1024 < w.enqueue(msg) <= 8 * 1024  # (one thread: the frame must fit the ring)
            got = r.dequeue()
            assert isinstance(got, StepMessage)
            assert got.host.keys() == msg.host.keys()
            for k, v in msg.host.items():
                assert got.host[k].dtype == v.dtype and torch.equal(got.host[k], v), k
            assert (got.forward_mode, got.prefix_lens, got.extend_lens, got.has_future, got.num_emit) == \
                (ForwardMode.MIXED, [10, 0, 5], [3, 8, 1], True, 0)
            [(row, start, slots)] = got.r2t_writes
            assert (row, start) == (4, 0) and slots.dtype == torch.int32 and torch.equal(slots, msg.r2t_writes[0][2])
            assert torch.equal(got.prompt_plan.token_index, plan.token_index) and got.prompt_plan.k == 2
            got.host["positions"].add_(1)  # a private, writable copy
            assert not torch.equal(got.host["positions"], msg.host["positions"])
    finally:
        r.close()
        w.close()
    # in-band protocol 5 (no buffer callback) and the gloo path's default protocol agree
    for proto in (5, pickle.DEFAULT_PROTOCOL):
        again = pickle.loads(pickle.dumps(msg, protocol=proto))
        assert all(torch.equal(again.host[k], v) for k, v in msg.host.items())
        again.host["input_ids"].add_(1)


def test_step_broadcast_mode(monkeypatch):
    from types import SimpleNamespace

    from attnserve.engine.tp.step_channel import STEP_BROADCAST_ENV, step_broadcast_mode

    one, two = SimpleNamespace(nnodes=1), SimpleNamespace(nnodes=2)
    monkeypatch.delenv(STEP_BROADCAST_ENV, raising=False)
    assert step_broadcast_mode(one) == "shm" and step_broadcast_mode(two) == "gloo"
    monkeypatch.setenv(STEP_BROADCAST_ENV, "gloo")
    assert step_broadcast_mode(one) == "gloo"
    monkeypatch.setenv(STEP_BROADCAST_ENV, "shm")
    assert step_broadcast_mode(one) == "shm"
    with pytest.raises(ValueError, match="one node"):
        step_broadcast_mode(two)
    monkeypatch.setenv(STEP_BROADCAST_ENV, "nccl")
    with pytest.raises(ValueError, match="auto, shm, gloo"):
        step_broadcast_mode(one)


def test_writer_killed_before_unlink_leaves_no_segment():
    """A writer SIGKILLed between `create` and `unlink` (a rank dying during start-up): its
    process's resource tracker removes the segment."""
    import signal
    import subprocess
    import sys

    code = ("import os, signal, sys\n"
            "from attnserve.distributed.shm_broadcast import ShmMessageQueue\n"
            "q = ShmMessageQueue.create(1, num_slots=2, slot_bytes=64)\n"
            "print(q.name, flush=True)\n"
            "sys.stdin.readline()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    path = os.path.join("/dev/shm", name)
    assert name.startswith("attnserve-stepq-") and os.path.exists(path)
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 20
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path)
