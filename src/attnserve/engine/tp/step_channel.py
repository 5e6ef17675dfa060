"""How rank 0's step messages reach the other tensor-parallel ranks: a shared-memory ring
when every rank runs on rank 0's node, else the gloo CPU group.

``ATTNSERVE_STEP_BROADCAST`` picks the path: ``auto`` (default: ``shm`` on one node with
/dev/shm, ``gloo`` across nodes), ``shm`` (refused with ``--nnodes`` > 1), or ``gloo`` (the
old path, for comparison). Rank 0 decides and tells the others at start-up; if any rank
cannot create or map the segment, every rank falls back to gloo (logged).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

#: environment variable that forces the step-message path
STEP_BROADCAST_ENV = "ATTNSERVE_STEP_BROADCAST"
_MODES = ("auto", "shm", "gloo")

#: ring geometry: an 8k-token extend step is ~300 KB; a larger frame spans several slots
NUM_SLOTS = 8
SLOT_BYTES = 1 << 20

#: seconds a waiting rank polls before it sleeps between polls. On GPUs a follower waits
#: about one step for the next message, and a late wake-up delays its kernel launches, so
#: it polls (with ``sched_yield``) through any step; CPU ranks share few cores with the
#: forward's own threads, so they poll briefly.
SPIN_S_CUDA = 0.1
SPIN_S_CPU = 0.0005


def step_broadcast_mode(server_args) -> str:
    """``"shm"`` or ``"gloo"`` for this launch (`STEP_BROADCAST_ENV`, ``--nnodes``).

    Raises:
        ValueError: an unknown value, or ``shm`` forced across several nodes.
    """
    from attnserve.distributed.shm_broadcast import shm_available

    value = os.environ.get(STEP_BROADCAST_ENV, "").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"{STEP_BROADCAST_ENV}={value!r}: expected one of {', '.join(_MODES)}")
    if value == "shm" and server_args.nnodes > 1:
        raise ValueError(f"{STEP_BROADCAST_ENV}=shm needs every tensor-parallel rank on one node "
                         f"(--nnodes is {server_args.nnodes}); use auto or gloo")
    if value == "auto":
        return "shm" if server_args.nnodes == 1 and shm_available() else "gloo"
    return value


def setup_step_queue(tp, mode: str, device_type: str, timeout_s: float):
    """Create (rank 0) or attach (the others) the step queue; every rank of ``tp`` calls it.

    Two start-up collectives on ``tp.cpu_group``: rank 0 broadcasts the segment's handle
    (None: gloo), then the ranks agree that all of them mapped it. Rank 0 then unlinks the
    segment's name, so no file stays in /dev/shm whichever rank dies later.

    Args:
        tp: this rank's `TPGroup` (size > 1).
        mode: ``"shm"`` or ``"gloo"`` (rank 0's decides).
        device_type: ``"cuda"`` or ``"cpu"`` (sets how long a wait polls).
        timeout_s: the writer waits at most this long for a full ring to drain.

    Returns:
        this rank's `ShmMessageQueue` end, or None (gloo).
    """
    from attnserve.distributed.shm_broadcast import ShmMessageQueue

    queue: Optional[ShmMessageQueue] = None
    if tp.rank == 0 and mode == "shm":
        try:
            queue = ShmMessageQueue.create(tp.size - 1, NUM_SLOTS, SLOT_BYTES)
        except (OSError, ValueError) as e:
            logger.warning("shared-memory step queue unavailable (%s); step messages go over gloo", e)
    handle = tp.broadcast_object(queue.handle if queue is not None else None)
    if tp.rank != 0 and handle is not None:
        try:
            queue = ShmMessageQueue.attach(handle, tp.rank - 1)
        except (OSError, ValueError) as e:
            logger.warning("rank %d cannot map the step queue %s (%s); step messages go over gloo", tp.rank,
                           handle.name, e)
    try:
        ok = tp.min_int(int(queue is not None)) if handle is not None else 0
    finally:
        if tp.rank == 0 and queue is not None:
            queue.unlink()
    if not ok:
        if queue is not None:
            queue.close()
            if tp.rank == 0:
                logger.warning("a rank could not map the step queue; step messages go over gloo")
        return None
    queue.spin_s = SPIN_S_CUDA if device_type == "cuda" else SPIN_S_CPU
    if tp.rank == 0:
        queue.timeout_s = timeout_s
    logger.debug("rank %d: step messages through shared memory %s", tp.rank, handle.name)
    return queue
