"""`TPGroup`: one rank's view of its tensor-parallel group.

Collectives go through ``torch.distributed``: the *device group* (NCCL on CUDA, gloo on
CPU) carries the activations (all-reduce after row-parallel layers, all-gather of
vocabulary-parallel logits, the broadcast of sampled ids); the *CPU group* (always gloo)
carries rank 0's pickled step messages, unless the ranks share one node: then the step
messages go through a shared-memory ring (`step_queue`, see
`attnserve.distributed.shm_broadcast`). A group of size 1 runs no collective at all, so
single-device models pay nothing (Megatron-LM's tensor parallelism, Shoeybi et al.,
arXiv:1909.08053; SGLang keeps the same two groups per TP group). Small all-reduces on
CUDA take the custom one-shot / two-shot path of `custom_all_reduce` when the group has one;
`TPGroup.fused_all_reduce_add_rmsnorm` also folds the residual add and RMSNorm that follow a
row-parallel layer into that all-reduce (`fused_all_reduce`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch


@dataclass
class TPGroup:
    """Attributes:
        rank: this process's rank in ``[0, size)``.
        size: ranks in the group (``--tp-size``).
        device_group: ``torch.distributed`` group for tensors on the model's device (None
            when ``size == 1``).
        cpu_group: gloo group for host objects (None when ``size == 1``).
        custom_all_reduce: `attnserve.distributed.custom_all_reduce.CustomAllReduce` for
            small messages (None: NCCL / gloo carries every all-reduce).
        step_queue: the `ShmMessageQueue` end (writer on rank 0, a reader elsewhere) that
            `broadcast_step` uses, or None (gloo).
        allreduce_fusion: models leave a row-parallel layer's sum to the norm after it
            (`models.layers.allreduce_fusion`); off: ``--disable-allreduce-fusion``.
    """

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    custom_all_reduce: Any = None
    step_queue: Any = None
    allreduce_fusion: bool = True

    @classmethod
    def single(cls) -> "TPGroup":
        """The group of a model that runs on one device."""
        return cls()

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``. The custom all-reduce takes
        it when it has one and the size / dtype suit it (`CustomAllReduce.select`), else the
        device group's backend."""
        if self.size > 1:
            if self.custom_all_reduce is not None and self.custom_all_reduce.all_reduce(x):
                return x
            import torch.distributed as dist

            dist.all_reduce(x, group=self.device_group)
        return x

    def fused_all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                     eps: float, weight_offset: float,
                                     add_rmsnorm: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
        """``residual += sum over ranks of x`` and ``rmsnorm(residual)``.

        Args:
            x: ``[..., N]`` this rank's partial sums (a row-parallel layer's output before its
                all-reduce); not modified on the fused path, summed in place otherwise.
            residual: ``[..., N]`` residual stream, same shape and dtype; updated in place on
                the fused path (the fallback's ``add_rmsnorm`` decides).
            weight / eps / weight_offset: the norm's ``x_hat * (weight + weight_offset)``.
            add_rmsnorm: the unfused add + norm, ``(summed x, residual) -> (out, residual)``
                (`RMSNorm.forward`: its Triton ``fused_add_rmsnorm`` on CUDA).
        Returns:
            ``(normalised, new residual)``.

        One kernel (`CustomAllReduce.fused_all_reduce_add_rmsnorm`) where the custom
        all-reduce has the fused path and its one-shot path takes ``x``; otherwise (NCCL,
        gloo, larger messages, ``--disable-allreduce-fusion``) `all_reduce` then
        ``add_rmsnorm``: the numbers of the two separate ops.
        """
        custom = self.custom_all_reduce
        if self.size > 1 and custom is not None:
            out = custom.fused_all_reduce_add_rmsnorm(x, residual, weight, eps, weight_offset)
            if out is not None:
                return out, residual
        return add_rmsnorm(self.all_reduce(x), residual)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., n]`` of every rank -> ``[..., size * n]`` (rank order)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        flat = torch.empty((self.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(flat, x, group=self.device_group)  # rank-major along dim 0
        parts = flat.view((self.size,) + tuple(x.shape))
        return parts.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype), in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(x, src=self._global(0), group=self.device_group)
        return x

    def broadcast_object(self, obj: Optional[Any] = None) -> Any:
        """Rank 0's picklable ``obj`` to every rank (the others pass None); returns it."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.cpu_group)
        return box[0]

    def broadcast_step(self, obj: Optional[Any] = None) -> Any:
        """`broadcast_object` for the per-step messages: through `step_queue` when set
        (rank 0 returns as soon as the message is in shared memory), else over gloo."""
        q = self.step_queue
        if q is None:
            return self.broadcast_object(obj)
        if self.rank == 0:
            q.enqueue(obj)
            return obj
        return q.dequeue()

    def close_step_queue(self) -> None:
        """Unmap the step queue (idempotent); later steps would go over gloo."""
        q, self.step_queue = self.step_queue, None
        if q is not None:
            q.close()

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. KV pool sizes)."""
        if self.size == 1:
            return int(value)
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def init_custom_all_reduce(self, device: torch.device, disable: bool = False) -> None:
        """Set up `custom_all_reduce` (a collective: every rank calls it, before any CUDA
        graph capture); it stays None where NCCL must carry every all-reduce (see
        `custom_all_reduce.init_custom_all_reduce`)."""
        from attnserve.distributed.custom_all_reduce import init_custom_all_reduce

        self.custom_all_reduce = init_custom_all_reduce(self.rank, self.size, self.device_group, self.cpu_group,
                                                        torch.device(device), disable=disable,
                                                        disable_fusion=not self.allreduce_fusion)

    def _global(self, rank: int) -> int:
        # one TP group spans the whole world here (no data or pipeline parallelism)
        return rank
