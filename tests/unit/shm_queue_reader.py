"""Reader processes of tests/unit/test_shm_broadcast.py (numpy only: no torch import, so
that the spawned readers start fast)."""

import time

import numpy as np

from attnserve.distributed.shm_broadcast import ShmMessageQueue, ShmQueueHandle

NUM_SLOTS = 4
SLOT_BYTES = 4096
COUNT = 240


def payload(i: int):
    """Message ``i``: small objects, arrays within a slot, arrays over several slots, and
    one larger than the whole ring (4 slots x 4 KiB)."""
    if i % 40 == 7:
        return {"i": i, "big": np.arange(3000, dtype=np.int64) * i}  # 24 KB > the ring's 16 KB
    if i % 10 == 3:
        return {"i": i, "a": np.full(700 + i, i, dtype=np.int32), "b": np.arange(900, dtype=np.int64)}  # ~2 slots
    if i % 3 == 0:
        return ("tuple", i, [i] * (i % 5))
    return {"i": i, "a": np.arange(i, dtype=np.int64), "f": np.linspace(0, 1, i % 17, dtype=np.float32)}


def digest(obj) -> str:
    """A structural fingerprint that fails on any reordering or corrupted byte."""
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k}:{digest(v)}" for k, v in sorted(obj.items())) + "}"
    if isinstance(obj, (tuple, list)):
        return type(obj).__name__ + "(" + ",".join(digest(v) for v in obj) + ")"
    if isinstance(obj, np.ndarray):
        return f"{obj.dtype}{obj.shape}:{obj.tobytes().hex()[:64]}:{int(obj.astype(np.int64).sum())}"
    return repr(obj)


def reader(handle: ShmQueueHandle, rank: int, count: int, slow_first: int, out) -> None:
    q = ShmMessageQueue.attach(handle, rank)
    q.spin_s = 0.0005
    got = []
    for n in range(count):
        if n < slow_first:
            time.sleep(0.005)  # the writer fills the ring meanwhile and must wait
        got.append(digest(q.dequeue()))
    q.close()
    out.put((rank, got))
