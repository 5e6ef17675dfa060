"""A symmetric-memory rendezvous that refuses, instead of hanging, when the ranks' processes differ.

``torch.distributed._symmetric_memory.rendezvous`` exchanges each rank's allocation through
the group's store under keys ``<prefix>/<seq>/<rank>``, where ``seq`` is a counter kept in
the process (torch 2.11: a static ``StoreExchange`` in ``CUDASymmetricMemory.cu``). The
ranks of one rendezvous must therefore have done the same number of rendezvous before. An
engine breaks that when it is built twice in one process: rank 0 is the engine's own
process and keeps its counter, while the new engine's other ranks are fresh processes that
start at 0, so the second rendezvous waits forever. Seen on four H200s (2026-11-26): the
first tensor-parallel engine of ``benchmarks/tp_decode.py`` ran, the next one hung in
``rendezvous`` on every rank; pytorch/pytorch#196082 describes the same skew after a
subgroup's rendezvous. Running one-rank rendezvous on the ranks that are behind did not
line the counters up (the next engine still hung), so `aligned_rendezvous` does not try:
it compares the counts first and raises `RendezvousSkew` on every rank, and the caller
falls back to NCCL for that engine.

The count is kept per process, as torch keeps its own: `_ProcessLedger`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch


class RendezvousSkew(RuntimeError):
    """The ranks' processes have done different numbers of symmetric-memory rendezvous."""


@dataclass
class _ProcessLedger:
    """Rendezvous this process has done (torch keeps the matching counter per process)."""

    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


#: one per process by necessity: it mirrors torch's own process-wide counter
_LEDGER = _ProcessLedger()


def rendezvous_count() -> int:
    """Symmetric-memory rendezvous done in this process through `aligned_rendezvous`."""
    return _LEDGER.done


def skew_reason(counts: Sequence[int]) -> Optional[str]:
    """Why ranks whose processes did ``counts[r]`` rendezvous before cannot meet (None: they can).

    A pure function of the gathered counts, so every rank reaches the same verdict.
    """
    if len(set(counts)) <= 1:
        return None
    return (f"the ranks' processes have done {list(counts)} symmetric-memory rendezvous before (torch "
            "counts them per process, so a rendezvous now would wait forever; a second tensor-parallel "
            "engine in one process meets fresh ranks)")


def aligned_rendezvous(buffer: torch.Tensor, device_group: Any, cpu_group: Any) -> Any:
    """``symm_mem.rendezvous(buffer, device_group)`` when every rank can meet.

    Args:
        buffer: this rank's ``symm_mem.empty`` allocation (same size on every rank).
        device_group: the NCCL group to rendezvous in.
        cpu_group: a gloo group of the same ranks (the counts are compared over it).
    Returns:
        torch's ``_SymmetricMemory`` handle. A collective: every rank of the group calls it.
    Raises:
        RendezvousSkew: on every rank, when the counts differ (`skew_reason`).
    """
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    with _LEDGER.lock:
        counts: list = [None] * dist.get_world_size(cpu_group)
        dist.all_gather_object(counts, _LEDGER.done, group=cpu_group)
        reason = skew_reason(counts)
        if reason is not None:
            raise RendezvousSkew(reason)
        handle = symm_mem.rendezvous(buffer, device_group)
        _LEDGER.done += 1
    return handle
