"""All-reduce + residual add + RMSNorm in one kernel over the custom all-reduce's buffers.

Under tensor parallelism a decoder layer runs ``o_proj`` (row-parallel) -> all-reduce ->
``fused_add_rmsnorm`` and ``down_proj`` -> all-reduce -> ``fused_add_rmsnorm``: at decode
sizes each is a latency-bound launch. `fused_all_reduce_add_rmsnorm` does the three in one
launch for messages the one-shot path takes (`custom_all_reduce.select_algorithm`); the
kernel and its synchronisation are described in `fused_all_reduce_triton`.

Numbers: the sum runs in rank order with one rounding to the storage dtype per add, as
PyTorch's one-shot kernel does, and the add + norm use the float32 arithmetic of
`attnserve.models.layers.fused_kernels.fused_add_rmsnorm`; so the result is bit-identical
to ``all_reduce`` (one-shot) followed by ``fused_add_rmsnorm`` (up to the sign of a zero
sum at world sizes other than 2, 4 and 8, where PyTorch starts from ``0``). Against NCCL it
is bit-identical at two ranks only (``a + b`` has one rounding in any order).

Triton is imported lazily (CPU installs without it import this module); on CPU the kernel
runs under ``TRITON_INTERPRET=1`` with ordinary tensors' addresses in the pointer table
(the tests do that).

``ATTNSERVE_ALLREDUCE_FUSION_MODE=push`` selects the push-mode ("Lamport") kernel instead
(`fused_all_reduce_push`): `FusedAllReduce.lamport` is then set, and the ``lamport``
argument of `fused_all_reduce_add_rmsnorm` / `compile_fused` routes the call to it.
``ATTNSERVE_ALLREDUCE_FUSION_MODE=twoshot`` adds the two-shot kernel for the larger messages
(`fused_all_reduce_two_shot`, `FusedAllReduce.two_shot`; `CustomAllReduce` routes the calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

#: most programs a launch uses (rows are strided over them); the flag slots per rank
MAX_PROGRAMS = 128
#: dtypes of the fused path (PyTorch's one-shot kernel is built for these two)
FUSED_DTYPES = (torch.float32, torch.bfloat16)
#: widest row one program normalises (``BLOCK = next_pow2(hidden)``)
MAX_HIDDEN = 32768
_ALIGN = 256


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class FusedRegion:
    """Where the fused kernel's data and flags lie in every rank's symmetric buffer (bytes).

    Attributes:
        data_offset: start of the two message halves (past PyTorch's kernels' region).
        half_bytes: one half (the largest message, ``one_shot_max_bytes``, padded).
        flags_offset: int64 flags ``[MAX_PROGRAMS, world_size]``: slot ``(p, src)`` holds
            the last call in which rank ``src``'s program ``p`` wrote its rows here.
        world_size: ranks.
    """

    data_offset: int
    half_bytes: int
    flags_offset: int
    world_size: int

    @classmethod
    def after(cls, used_bytes: int, max_message_bytes: int, world_size: int) -> "FusedRegion":
        """The region placed after the first ``used_bytes`` of the buffer."""
        data = _round_up(used_bytes, _ALIGN)
        half = _round_up(max(max_message_bytes, 16), _ALIGN)
        return cls(data, half, data + 2 * half, world_size)

    @property
    def flags_bytes(self) -> int:
        return MAX_PROGRAMS * self.world_size * 8

    @property
    def end(self) -> int:
        """Buffer bytes the region needs (its end)."""
        return self.flags_offset + self.flags_bytes


@dataclass
class FusedAllReduce:
    """One rank's state of the fused kernel (`CustomAllReduce.fusion`).

    Attributes:
        region: where data and flags lie in every rank's symmetric buffer.
        buffer_ptrs: int64 ``[W]`` on the device: every rank's buffer address (rank order).
        counters: int64 ``[2]`` on the device (calls completed, programs finished); in
            push mode int64 ``[fused_all_reduce_push.PUSH_COUNTERS]``; in twoshot mode int64
            ``[4]``: the pull kernel's, then the two-shot kernel's ``[2:4]``.
        lamport: the push kernel's `fused_all_reduce_push.LamportRegion` (push mode), or
            None (the pull kernel of this module).
        two_shot: the two-shot kernel's `fused_all_reduce_two_shot.TwoShotRegion` (twoshot
            mode: messages of at least its ``min_bytes`` run that kernel), or None.
    """

    region: FusedRegion
    buffer_ptrs: torch.Tensor
    counters: torch.Tensor
    lamport: Optional[Any] = None
    two_shot: Optional[Any] = None

    @property
    def mode(self) -> str:
        """``"push"``, ``"twoshot"`` or ``"pull"`` (`fused_all_reduce_push.fusion_mode_from_env`'s values)."""
        if self.lamport is not None:
            return "push"
        return "pull" if self.two_shot is None else "twoshot"


def fused_unsupported_reason(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             region: FusedRegion) -> Optional[str]:
    """Why `fused_all_reduce_add_rmsnorm` cannot take ``(x, residual, weight)`` (None: it can):
    same shape and dtype (float32 / bfloat16), contiguous, a message that fits one half,
    ``weight`` of the hidden size."""
    if x.dtype not in FUSED_DTYPES or residual.dtype != x.dtype:
        return f"dtypes {x.dtype} / {residual.dtype}"
    if tuple(x.shape) != tuple(residual.shape) or x.dim() == 0 or x.numel() == 0:
        return f"shapes {tuple(x.shape)} / {tuple(residual.shape)}"
    if not (x.is_contiguous() and residual.is_contiguous()):
        return "not contiguous"
    n = x.shape[-1]
    if n > MAX_HIDDEN or weight.numel() != n:
        return f"hidden size {n} (weight {weight.numel()})"
    if x.numel() * x.element_size() > region.half_bytes:
        return f"{x.numel() * x.element_size()} bytes > {region.half_bytes}"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def norm_warps(block: int) -> int:
    """Warps of a launch: those of ``fused_kernels.fused_add_rmsnorm`` for the same
    ``BLOCK`` (the same layout, so ``tl.sum`` adds in the same order; a test keeps them equal)."""
    return max(1, min(16, block // 512))


def fused_all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 weight_offset: float, buffer_ptrs: torch.Tensor, counters: torch.Tensor, rank: int,
                                 region: FusedRegion, lamport: Optional[Any] = None) -> torch.Tensor:
    """``residual += sum over ranks of x`` (in place) and return ``rmsnorm(residual)``.

    A collective: every rank of the group calls it with the same shapes, in the same order.

    Args:
        x: ``[..., N]`` this rank's partial sums (float32 / bfloat16, contiguous).
        residual: ``[..., N]`` residual stream, same shape and dtype; overwritten.
        weight / eps / weight_offset: the norm's ``x_hat * (weight + weight_offset)``.
        buffer_ptrs: int64 ``[W]`` on ``x``'s device: each rank's symmetric buffer address.
        counters: int64 ``[2]`` zeros at start, on ``x``'s device, private to this group.
        rank: this rank.
        region: the fused region of the buffers.
        lamport: a `fused_all_reduce_push.LamportRegion`: run the push kernel there instead
            (``counters`` then its ``[PUSH_COUNTERS]``), see `fused_all_reduce_push`.

    Returns:
        new ``[..., N]`` tensor in ``x``'s dtype.
    Raises:
        ValueError: `fused_unsupported_reason` gives a reason.
    """
    if lamport is not None:
        from attnserve.distributed.fused_all_reduce_push import fused_all_reduce_add_rmsnorm_push

        return fused_all_reduce_add_rmsnorm_push(x, residual, weight, eps, weight_offset, buffer_ptrs, counters, rank,
                                                 lamport)
    return _launch(x, residual, weight, eps, weight_offset, buffer_ptrs, counters, rank, region, warmup=False)


def compile_fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, buffer_ptrs: torch.Tensor,
                  counters: torch.Tensor, rank: int, region: FusedRegion, lamport: Optional[Any] = None) -> None:
    """Compile the kernel for these arguments without launching it (Triton's ``warmup``): the
    push kernel when ``lamport`` is given (as `fused_all_reduce_add_rmsnorm`), else the pull one."""
    if lamport is not None:
        from attnserve.distributed.fused_all_reduce_push import compile_fused_push

        compile_fused_push(x, residual, weight, buffer_ptrs, counters, rank, lamport)
        return
    _launch(x, residual, weight, 1e-6, 0.0, buffer_ptrs, counters, rank, region, warmup=True)


def fused_pdl_enabled(device: torch.device) -> bool:
    """Whether the pull kernel launches with programmatic dependent launch: `attnserve.pdl.pdl_enabled`
    and ``ATTNSERVE_ALLREDUCE_PDL`` not off (read at every call; see the kernel module's doc)."""
    from attnserve.env_options import env_flag
    from attnserve.pdl import pdl_enabled

    return env_flag("ATTNSERVE_ALLREDUCE_PDL") and pdl_enabled(device)


def _launch(x, residual, weight, eps, weight_offset, buffer_ptrs, counters, rank, region, warmup: bool):
    why = fused_unsupported_reason(x, residual, weight, region)
    if why is not None:
        raise ValueError(f"fused_all_reduce_add_rmsnorm: {why}")
    from attnserve.distributed.fused_all_reduce_triton import _fused_all_reduce_add_rmsnorm_kernel

    n = x.shape[-1]
    rows = x.numel() // n
    out = torch.empty_like(residual)
    block = _next_pow2(n)
    world = region.world_size
    args = (x, residual, weight.contiguous(), out, buffer_ptrs, counters, rank, rows, n, float(eps),
            float(weight_offset), region.data_offset, region.half_bytes, region.flags_offset)
    # num_warps as fused_add_rmsnorm's: the same layout, so tl.sum adds in the same order
    use_pdl = fused_pdl_enabled(x.device)
    meta = dict(W=world, W_P2=_next_pow2(world), BLOCK=block, num_warps=norm_warps(block), USE_PDL=use_pdl)
    if use_pdl:
        meta["launch_pdl"] = True  # a compile option too: the warm-up compiles the launched variant
    grid = (min(rows, MAX_PROGRAMS),)
    if warmup:
        _fused_all_reduce_add_rmsnorm_kernel.warmup(*args, grid=grid, **meta)
    else:
        _fused_all_reduce_add_rmsnorm_kernel[grid](*args, **meta)
    return out
