"""Two-shot fused all-reduce + residual add + RMSNorm for mid-size messages.

The pull kernel (`fused_all_reduce_triton`) is one-shot: every rank reads all ``W - 1`` peers'
whole messages, ``(W - 1) * S`` bytes over NVLink per rank for an ``S``-byte message. Here the
flattened message is split into ``W`` pieces, rank ``o`` owning piece ``o`` (a reduce-scatter
then an all-gather, as PyTorch's ``two_shot_all_reduce`` and TensorRT-LLM's two-shot kernels
do; algorithm studied there, the code is our own), so each rank sends ``2 (W - 1) / W * S``
bytes: ``W / 2`` times fewer (1.5 MB -> 0.75 MB per rank for 64 bfloat16 rows of 4096 at
``W = 4``; at ``W = 2`` the same bytes, so two-shot is never chosen there by default). One
launch, on rank ``r``, call number ``e`` (``counters[0] + 1``, as the pull kernel's epoch):

1. *scatter*: each program stores its chunks of piece ``o`` of ``x`` into slot ``r`` of half
   ``e % 2`` of rank ``o``'s buffer (remote stores; its own piece into its own buffer), then
   *arrives*: one ``acq_rel`` add at system scope on the local count ``counters[1]``; the last
   program to arrive resets it and writes ``2e - 1`` into slot ``r`` of every rank's flags
   (release, system scope);
2. every program waits until all ``W`` flags of its own buffer are ``>= 2e - 1``; it sums its
   chunks of piece ``r`` over the ``W`` slots in rank order ``0..W-1`` with one rounding to the
   storage dtype per add (the pull kernel's order) and stores the sum into half ``e % 2`` of
   every rank's gather area; arrives again (flag ``2e``; the last program also stores ``e``
   into ``counters[0]``);
3. after waiting for flags ``>= 2e``, every rank reads all rows of the sum from its own gather
   area and runs the pull kernel's epilogue (`fused_all_reduce_triton.add_rmsnorm_row`) on its
   own residual: residual add in place and the norm.

The pieces are of elements (a multiple of 16), not rows: the sum is element-wise and the norm
runs on every rank in step 3 from local memory, so the ranks' loads stay even whatever ``M``
(``M`` not a multiple of ``W``, or ``M < W``: the last pieces are short or empty) and only the
sum crosses NVLink in step 2 (gathering the new residual and the normed rows instead would
send twice the bytes). As in the pull kernel each rank adds its own residual, so the result is
the pull kernel's bit for bit: the same sums in the same order, and the final sum is already
a storage-dtype value, so storing it in step 2 loses nothing.

Why two halves suffice and no barrier closes the launch: a rank stores into half ``h`` of a
peer in call ``e`` and next in call ``e + 2``; it starts call ``e + 2`` only after finishing
call ``e + 1``, which waited for every peer's first arrival of call ``e + 1``, so every peer had
finished call ``e`` (kernels on a stream run in order; no programmatic dependent launch), and
with it its reads of half ``h``. Flags only grow (int64), so a fast peer's later flag also
releases a slow rank; the local count is reset by its last arrival before that arrival's flag
is released, so the next arrivals (after the wait) start from zero. The region and the counters
are the two-shot kernel's own (`TwoShotRegion`, `counters` ``[2]``), apart from the pull
kernel's, so calls of the two kernels may interleave. Like the pull kernel, programs spin until
the others have arrived, so all programs of a launch must be resident at once
(``MAX_PROGRAMS`` <= the SMs) on every rank; no host state is read per call (CUDA graphs).

Selection: ``ATTNSERVE_ALLREDUCE_FUSION_MODE=twoshot`` (`fused_all_reduce_push.fusion_mode_from_env`)
gives `CustomAllReduce.fusion` a `TwoShotRegion`; its fused calls whose message has at least
`TwoShotRegion.min_bytes` (`two_shot_min_bytes`) run this kernel, smaller ones the pull kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from attnserve.distributed import fused_all_reduce as far

#: `two_shot_min_bytes`'s override: the smallest message (KiB) of the two-shot kernel
TWO_SHOT_MIN_ENV = "ATTNSERVE_TWO_SHOT_FUSED_MIN_KB"
#: default smallest message of the two-shot kernel at ``W >= 3`` (see `two_shot_min_bytes`)
DEFAULT_MIN_BYTES = 256 << 10
#: `TwoShotRegion.min_bytes` for "never" (two ranks by default)
NEVER = 1 << 62
#: elements a piece is a multiple of (16-byte vectors of float32 and bfloat16 alike)
PIECE_ALIGN = 16
_ALIGN = 256


def two_shot_min_bytes(world_size: int, environ: Optional[Mapping[str, str]] = None) -> int:
    """The smallest message (bytes) the two-shot kernel takes in ``twoshot`` mode.

    ``ATTNSERVE_TWO_SHOT_FUSED_MIN_KB`` (a number >= 0 of KiB) when set, for any world size.
    Else `NEVER` at two ranks (two-shot sends as many bytes as one-shot there, over one more
    barrier) and 256 KiB from three: on four H200s PyTorch's two-shot all-reduce cost 3.8 µs
    more than its one-shot at 1 KB (10.4 vs 6.6 µs, its second barrier round,
    ``benchmarks/results/h200x4-allreduce-2026-11-27.json``), and the pull kernel's time grew
    by 6.8 µs from 1 to 64 rows of 4096 (8 KB -> 512 KB, ``h200x4-fused-allreduce-push-2026-11-27.json``),
    about 13 µs per MB, half of which two-shot saves at ``W = 4``: ~1.7 µs at 256 KB, ~3.4 µs
    at 512 KB, so below 256 KB it cannot pay for a second barrier round unless that costs well
    under PyTorch's; 64 decode rows of Llama-3-8B (512 KB) take it. An estimate, not a
    measurement: `benchmarks/fused_allreduce_bench.py` times both kernels at 1 to 256 rows to
    set it; the override measures other thresholds inside an engine.

    Raises:
        ValueError: the variable is set but not a number >= 0.
    """
    from attnserve.env_options import env_bytes

    size = env_bytes(TWO_SHOT_MIN_ENV, 1 << 10, environ=environ)
    if size is not None:
        return size
    return NEVER if world_size <= 2 else DEFAULT_MIN_BYTES


@dataclass(frozen=True)
class TwoShotRegion:
    """Where the two-shot kernel's data and flags lie in every rank's symmetric buffer (bytes).

    Layout from ``offset``: scatter slots ``[2 halves][W sources][slot_bytes]``, the gather
    area ``[2 halves][slot_bytes]``, then int64 flags ``[W]`` (slot ``q``: the last value rank
    ``q`` signalled, ``2e - 1`` / ``2e`` in call ``e``), zero before the first call.

    Attributes:
        offset: start of the region (256-byte aligned).
        slot_bytes: the largest message (``one_shot_max_bytes``), padded to 256 bytes.
        world_size: ranks (``W``).
        min_bytes: the smallest message `CustomAllReduce` sends here (`two_shot_min_bytes`).
    """

    offset: int
    slot_bytes: int
    world_size: int
    min_bytes: int = DEFAULT_MIN_BYTES

    @classmethod
    def after(cls, used_bytes: int, max_message_bytes: int, world_size: int,
              min_bytes: int = DEFAULT_MIN_BYTES) -> "TwoShotRegion":
        """The region placed after the first ``used_bytes`` of the buffer."""
        return cls(far._round_up(used_bytes, _ALIGN), far._round_up(max(max_message_bytes, 16), _ALIGN), world_size,
                   min_bytes)

    @property
    def gather_offset(self) -> int:
        return self.offset + 2 * self.world_size * self.slot_bytes

    @property
    def flags_offset(self) -> int:
        return self.gather_offset + 2 * self.slot_bytes

    @property
    def end(self) -> int:
        """Buffer bytes the region needs (its end)."""
        return self.flags_offset + far._round_up(self.world_size * 8, _ALIGN)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `CustomAllReduce` sends ``x`` here (at least ``min_bytes``; shapes only, so
        every rank decides alike)."""
        return x.numel() * x.element_size() >= self.min_bytes


def piece_elements(numel: int, world_size: int) -> int:
    """Elements of the message each rank reduces (the last pieces may be short or empty):
    ``ceil(numel / W)`` rounded up to `PIECE_ALIGN` (16-byte aligned pieces)."""
    return far._round_up(-(-numel // world_size), PIECE_ALIGN)


def two_shot_unsupported_reason(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                region: TwoShotRegion) -> Optional[str]:
    """Why `fused_all_reduce_add_rmsnorm_two_shot` cannot take ``(x, residual, weight)`` (None:
    it can): the pull kernel's conditions (`fused_all_reduce.fused_unsupported_reason`), with a
    slot in place of a half."""
    # only the message limit of the region is read: a slot is as large as a half
    return far.fused_unsupported_reason(x, residual, weight, far.FusedRegion(0, region.slot_bytes, 0,
                                                                             region.world_size))


def fused_all_reduce_add_rmsnorm_two_shot(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                          weight_offset: float, buffer_ptrs: torch.Tensor, counters: torch.Tensor,
                                          rank: int, region: TwoShotRegion) -> torch.Tensor:
    """``residual += sum over ranks of x`` (in place) and return ``rmsnorm(residual)``, two-shot.

    A collective: every rank of the group calls it with the same shapes, in the same order
    (whatever ``region.min_bytes``: it is `CustomAllReduce`'s choice, not checked here).

    Args:
        x: ``[..., N]`` this rank's partial sums (float32 / bfloat16, contiguous); not modified.
        residual: ``[..., N]`` residual stream, same shape and dtype; overwritten.
        weight / eps / weight_offset: the norm's ``x_hat * (weight + weight_offset)``.
        buffer_ptrs: int64 ``[W]`` on ``x``'s device: each rank's symmetric buffer address.
        counters: int64 ``[2]`` zeros at start, on ``x``'s device, private to this kernel and group.
        rank: this rank.
        region: the two-shot region of the buffers (flags zero before the first call).

    Returns:
        new ``[..., N]`` tensor in ``x``'s dtype: the pull kernel's bits.
    Raises:
        ValueError: `two_shot_unsupported_reason` gives a reason, or ``counters`` is not int64 ``[>= 2]``.
    """
    return _launch(x, residual, weight, eps, weight_offset, buffer_ptrs, counters, rank, region, stage=0)


def compile_two_shot(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, buffer_ptrs: torch.Tensor,
                     counters: torch.Tensor, rank: int, region: TwoShotRegion) -> None:
    """Compile the two-shot kernel for these arguments without launching it (Triton's ``warmup``)."""
    _launch(x, residual, weight, 1e-6, 0.0, buffer_ptrs, counters, rank, region, stage=0, warmup=True)


def probe_two_shot(buffer_ptrs: torch.Tensor, counters: torch.Tensor, rank: int, region: TwoShotRegion,
                   device: torch.device) -> Optional[str]:
    """Run the kernel twice (both halves) on a probe of ``W + 1`` rows (an uneven split) and
    check the sums; None when right, else what it gave. A collective, as the kernel."""
    w = region.world_size
    x = torch.full((w + 1, 64), float(rank + 1), dtype=torch.float32, device=device)
    residual = torch.full_like(x, 0.5)
    weight = torch.ones(64, dtype=torch.float32, device=device)
    for call in (1, 2):
        out = fused_all_reduce_add_rmsnorm_two_shot(x, residual, weight, 1e-6, 0.0, buffer_ptrs, counters, rank,
                                                    region)
        want = call * w * (w + 1) / 2 + 0.5
        if not (bool((residual == want).all()) and float((out - 1).abs().max()) < 1e-3):
            return f"two-shot probe gave residual {residual.flatten()[:2].tolist()}, expected {want}"
    return None


def _launch(x, residual, weight, eps, weight_offset, buffer_ptrs, counters, rank, region, stage: int,
            warmup: bool = False, chunk: Optional[int] = None):
    """The launch; ``stage`` 1 / 2 / 3 split it for the CPU tests (see the kernel), ``chunk``
    (elements, a power of two) overrides the element-wise stages' step there."""
    why = two_shot_unsupported_reason(x, residual, weight, region)
    if why is not None:
        raise ValueError(f"fused_all_reduce_add_rmsnorm_two_shot: {why}")
    if counters.dtype != torch.int64 or counters.numel() < 2:
        raise ValueError(f"fused_all_reduce_add_rmsnorm_two_shot: counters must be int64 [2], got "
                         f"{counters.dtype} {tuple(counters.shape)}")
    from attnserve.distributed.fused_all_reduce_two_shot_triton import _two_shot_fused_add_rmsnorm_kernel

    n = x.shape[-1]
    rows = x.numel() // n
    world = region.world_size
    out = torch.empty_like(residual)
    block = far._next_pow2(n)
    warps = far.norm_warps(block)  # fused_add_rmsnorm's: tl.sum adds in the same order
    if chunk is None:
        chunk = 32 * warps * (16 // x.element_size())  # one 16-byte vector per thread per step
    piece = piece_elements(x.numel(), world)
    units = -(-piece // chunk)
    args = (x, residual, weight.contiguous(), out, buffer_ptrs, counters, rank, rows, n, piece, float(eps),
            float(weight_offset), region.offset, region.slot_bytes, region.gather_offset, region.flags_offset)
    meta = dict(W=world, W_P2=far._next_pow2(world), BLOCK=block, CHUNK=chunk, STAGE=stage, num_warps=warps)
    grid = (min(far.MAX_PROGRAMS, max(rows, world * units)),)
    if warmup:
        _two_shot_fused_add_rmsnorm_kernel.warmup(*args, grid=grid, **meta)
    else:
        _two_shot_fused_add_rmsnorm_kernel[grid](*args, **meta)
    return out
