"""A symmetric-memory rendezvous that works when the ranks' processes have different histories.

``torch.distributed._symmetric_memory.rendezvous`` exchanges each rank's allocation through
the group's store under keys ``<prefix>/<seq>/<rank>``, where ``seq`` is a counter kept in
the process (torch 2.11: a static ``StoreExchange`` in ``CUDASymmetricMemory.cu``). The
ranks of one rendezvous must therefore have done the same number of rendezvous before, in
any group. An engine breaks that when it is built twice in one process: rank 0 is the
engine's own process and keeps its counter, while the new engine's other ranks are fresh
processes that start at 0, so the second rendezvous waits forever (seen on four H200s:
``tp_decode.py`` hung in its second tensor-parallel engine; the mechanism is
pytorch/pytorch#196082, where a subgroup's rendezvous skews the counters the same way).

`aligned_rendezvous` first agrees on the largest number of rendezvous any rank has done in
its process, and the ranks that are behind run that many rendezvous on a group of
themselves alone, which advances their counters exactly as a real one does (a one-rank
exchange waits for no one). The count is per process, like torch's: `_ProcessLedger`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch


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


def aligned_rendezvous(buffer: torch.Tensor, device_group: Any, cpu_group: Any, rank: int) -> Any:
    """``symm_mem.rendezvous(buffer, device_group)`` after aligning the ranks' counters.

    Args:
        buffer: this rank's ``symm_mem.empty`` allocation (same size on every rank).
        device_group: the NCCL group to rendezvous in.
        cpu_group: a gloo group of the same ranks (the agreement on the counts).
        rank: this rank's index in the groups.
    Returns:
        torch's ``_SymmetricMemory`` handle. A collective: every rank of the group calls it.
    """
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    with _LEDGER.lock:
        counts: list = [None] * dist.get_world_size(cpu_group)
        dist.all_gather_object(counts, _LEDGER.done, group=cpu_group)
        behind = max(counts) - _LEDGER.done
        if behind > 0:
            _catch_up(behind, buffer.device)
        handle = symm_mem.rendezvous(buffer, device_group)
        _LEDGER.done = max(counts) + 1
    return handle


def _catch_up(n: int, device: torch.device) -> None:
    """Run ``n`` one-rank rendezvous in this process (advances torch's exchange counter)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    for _ in range(n):
        scratch = symm_mem.empty(16, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(scratch, solo)
