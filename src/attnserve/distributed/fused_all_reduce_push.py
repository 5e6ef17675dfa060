"""Push-mode ("Lamport") fused all-reduce + residual add + RMSNorm: no flags, no remote reads.

The pull kernel (`fused_all_reduce_triton`) copies its rows into its own buffer, raises a
flag in every peer's buffer, waits for its own flags and then *reads* every peer's rows over
NVLink: a flag round trip and a remote-read round trip per call. Here each rank *stores* its
rows straight into every rank's buffer and polls its own buffer until the data is there: the
data itself is the signal (the one-shot "Lamport" all-reduce of TensorRT-LLM and its fused
all-reduce + RMSNorm; algorithm studied there, the code is our own). It is the default kernel
(`fusion_mode_from_env`, read once when the custom all-reduce starts);
``ATTNSERVE_ALLREDUCE_FUSION_MODE=pull`` runs the pull kernel instead.

Why the default (four H200s, NV18 between every pair, Llama-3-8B shape, decode steps timed
inside full runs, ``benchmarks/tp_decode.py --allreduce-fusion-mode push pull``,
``benchmarks/results/h200x4-tp-push-pull-in-run-2026-11-28.json``): ms a step push / pull at
tp 4, 64 requests 3.22 / 3.41 (two processes each, spread 0.01 ms), batch 1 2.00 / 2.00;
tp 2, 64 requests 4.23 / 4.34, batch 1 2.85 / 2.84. Per call, 64 rows of 4,096 bfloat16
(512 KB) on those GPUs: push 11.2 µs, pull 14.6 (``h200x4-fused-allreduce-twoshot-2026-11-27.json``).
With one program a row, push lost at rows of 8,192 at 1 and 8 rows (9.37 / 8.61 and 9.80 / 9.75
µs push / pull in that table); the split rows below made it the faster kernel everywhere.

Layout (`LamportRegion`, past the pull kernel's region of every rank's symmetric buffer):
``[2 dtypes (float32, bfloat16)][3 phases][W source slots][slot_bytes]``. Every element of
every slot starts as the *sentinel*, negative zero in the slot's dtype (``0x80000000`` /
``0x8000``), written on the host before the rendezvous (no peer knows the address before).
The two dtypes get separate halves because a slot cleared for one dtype does not read as
cleared in the other (float32's ``-0.0`` is bfloat16 ``+0.0`` and ``-0.0``).

Call number ``e`` (``counters[0] + 1``, as the pull kernel's epoch) of dtype ``D`` and ``N``
elements, on rank ``r``, one program per row as the pull kernel (rows strided over programs):

1. *push*: the program's rows of ``x``, with every ``-0.0`` replaced by ``+0.0`` (so no real
   element equals the sentinel), go to slot ``r`` of phase ``e % 3`` of half ``D`` of every
   rank's buffer (plain 16-byte vector stores, remote over NVLink; no fence, no flag);
2. *clear*: it writes the sentinel back over the previous call's data in its own buffer
   (``counters[2:5]``: that call's size in 16-byte vectors, phase offset and sentinel word);
3. *wait and reduce*: for ``src = 0..W-1`` it loads its rows of slot ``src`` of the own
   buffer with volatile loads until no element is the sentinel, and adds them in rank order
   with one rounding to the storage dtype per add; then the residual add and the norm with
   the pull kernel's float32 arithmetic;
4. the last program to finish records this call in ``counters[2:5]`` and bumps the epoch.

*Split rows* (`row_splits`, small batches): one program a row leaves a batch of 1-8 rows to
1-8 SMs, each pushing, clearing and polling a whole row (at one row of 8,192, 64 KB of
stores and 64 KB of polled loads by one SM). The split-row kernel cuts every row into
``SPLITS`` programs of ``CHUNK`` columns: steps 1-3 on its columns (the wait loads all ranks'
columns as one tile, so the ``W`` loads are in flight together), the residual add on its
columns, stored in place; then each program raises its flag (``counters[ROW_FLAGS_AT + pid]
= e``, release), waits for the flags of its row's programs, loads the whole new residual row
and computes the norm's sum of squares over it exactly as the one-program kernel does (same
values, same layout, same order: the same bits), storing only its own columns. The flags are
local and only grow, so they need no clearing; the phases and the clear are unchanged (the
split kernel pushes the same bytes to the same places). ``ATTNSERVE_PUSH_ROW_SPLITS`` caps
the programs a row (1: one program a row), `DEFAULT_ROW_SPLITS` when unset. The sum over ranks
reads each rank's columns again as 1-D loads once the tile is complete: taking rank ``r``'s row
out of the 2-D tile made Triton convert layouts through shared memory from 4 programs a row up
(27 barriers against 10) and cost 10-25 µs a call.

Measured (four H200s, µs per call in a CUDA graph, ``benchmarks/fused_allreduce_bench.py
--push-splits 1 2 4 8 16``, ``results/h200x4-fused-allreduce-push-split-rows-2026-11-28.json``),
one program a row -> at most 8 (the default) / pull: 1 row of 4,096 6.89 -> 5.94 / 7.11; 8 rows
7.41 -> 6.67 / 9.72; 1 row of 8,192 9.36 -> 6.63 / 7.98; 8 rows 9.75 -> 7.86 / 9.01; 64 rows of
4,096 (two programs a row) 11.94 -> 10.89. Llama-3-70B at tp 4, batch 1 (160 calls a step), decode
steps timed inside the run: 11.45 -> 11.04 ms (``results/h200x4-tp-70b-push-split-rows-2026-11-28.json``);
Llama-3-8B at tp 4, batch 1: 2.00 -> 1.94 ms. At two ranks splitting loses at rows of 4,096 (1 row
5.23 -> 5.73 µs, 64 rows 6.73 -> 7.60; ``results/h200x2of4-fused-allreduce-push-split-rows-2026-11-28.json``)
and the tp 2 batch-1 step went 2.84 -> 2.88 ms, so two ranks keep one program a row.

Why three phases, and why the previous call's phase is the one to clear. (a) *A peer is
never more than one call ahead*: a peer finishes call ``e + 1`` only after it has seen our
data of call ``e + 1``, which we store only after our call ``e`` has finished (kernels on a
stream run in order); so while we run call ``e``, a peer is in call ``e - 1`` (past its push:
we have its data), ``e`` or ``e + 1``. (b) *Writes into our buffer during our call ``e``*
therefore belong to call ``e`` (phase ``e % 3``) or ``e + 1`` (phase ``(e + 1) % 3``); call
``e - 1``'s writes have all landed (we saw every element of them). (c) So phase
``(e - 1) % 3 = (e + 2) % 3`` is quiet: nobody writes it and we finished reading it in call
``e - 1``. Call ``e`` clears it; the next writes into it come from call ``e + 2``, which no
peer can start before it has our data of call ``e + 1``, stored after call ``e``'s kernel,
and so after the clear. Clearing phase ``(e + 1) % 3`` instead would race a fast peer's
call ``e + 1`` data; clearing our own phase ``e % 3`` would race slow peers' call ``e``
data. With two phases, a fast peer's call ``e + 1`` would land in the phase we still read.
The clear covers the previous call's size (recorded by the device), so a call of any size
always finds all its elements at the sentinel whatever the earlier calls' sizes and dtypes.

Numbers: bit-identical to the pull kernel and to a one-shot ``all_reduce`` followed by
``fused_add_rmsnorm``, except that a ``-0.0`` partial sum is taken as ``+0.0``: only the sign
of a zero sum (and of a zero residual after it) can differ. No host state is read per call,
so the launch is captured in CUDA graphs; every rank must issue the same sequence of calls.
Like the pull kernel, a program spins until its peers' programs have run, so all programs of
a launch must be resident at once (``MAX_PROGRAMS`` <= the SMs) on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from attnserve.distributed import fused_all_reduce as far

#: `fusion_mode_from_env`'s variable and its values
FUSION_MODE_ENV = "ATTNSERVE_ALLREDUCE_FUSION_MODE"
PULL = "pull"
PUSH = "push"
#: the pull kernel below `fused_all_reduce_two_shot.two_shot_min_bytes`, the two-shot kernel from it
TWOSHOT = "twoshot"
FUSION_MODES = (PULL, PUSH, TWOSHOT)
#: the mode when the variable is unset (see the module docstring for the measurement)
DEFAULT_MODE = PUSH
#: phases of the Lamport region (see the module docstring)
PHASES = 3
#: int64 counters of the push kernel: epoch, programs finished, previous call's 16-byte vectors, its
#: phase's byte offset, its sentinel word; then, from the next 128-byte line (the counters are read
#: and bumped by every program), the split-row kernel's flags, one per program
CALL_COUNTERS = 5
ROW_FLAGS_AT = 16
PUSH_COUNTERS = ROW_FLAGS_AT + far.MAX_PROGRAMS
#: `row_splits_from_env`'s variable: the most programs a row is cut into (1: one program a row)
ROW_SPLITS_ENV = "ATTNSERVE_PUSH_ROW_SPLITS"
#: the most programs per row when the variable is unset (see `row_splits`)
DEFAULT_ROW_SPLITS = 8
#: the fewest columns a split-row program takes
MIN_SPLIT_COLS = 256
#: the fewest ranks at which rows are split (`row_splits`)
MIN_SPLIT_WORLD = 3
_ALIGN = 256
#: dtype -> (half of the region, sentinel element bits, sentinel as an int32 word, the integer
#: dtype whose elements carry the bits)
_SENTINELS = {
    torch.float32: (0, -(1 << 31), -(1 << 31), torch.int32),  # 0x80000000
    torch.bfloat16: (1, -(1 << 15), -(1 << 31) | (1 << 15), torch.int16),  # 0x8000, word 0x80008000
}


def fusion_mode_from_env(environ: Optional[Mapping[str, str]] = None) -> str:
    """``ATTNSERVE_ALLREDUCE_FUSION_MODE``: ``push`` (default, unset or empty), ``pull`` or
    ``twoshot`` (`fused_all_reduce_two_shot`).

    Raises:
        ValueError: any other value.
    """
    env = os.environ if environ is None else environ
    mode = (env.get(FUSION_MODE_ENV) or DEFAULT_MODE).strip().lower()
    if mode not in FUSION_MODES:
        raise ValueError(f"{FUSION_MODE_ENV}={env.get(FUSION_MODE_ENV)!r}: expected one of {FUSION_MODES}")
    return mode


def row_splits_from_env() -> int:
    """``ATTNSERVE_PUSH_ROW_SPLITS``: the most programs one row is cut into (an integer in
    ``1..MAX_PROGRAMS``; unset or empty: `DEFAULT_ROW_SPLITS`). Read once when the custom
    all-reduce starts.

    Raises:
        ValueError: set but not such an integer (`env_options.env_int`).
    """
    from attnserve.env_options import env_int

    return env_int(ROW_SPLITS_ENV, DEFAULT_ROW_SPLITS, 1, far.MAX_PROGRAMS, "1: one program a row")


def row_splits(rows: int, n_cols: int, max_splits: int, world_size: int) -> tuple:
    """``(splits, chunk)``: each of ``rows`` rows of ``n_cols`` columns goes to ``splits`` programs
    of ``chunk`` columns (a power of two; the last program's columns may run past ``n_cols``).

    One program a row (``splits`` 1, ``chunk`` the row's power of two) at fewer than
    `MIN_SPLIT_WORLD` ranks, when ``max_splits`` is 1, or when two programs a row would pass
    `fused_all_reduce.MAX_PROGRAMS`; else the largest power of two at most ``max_splits``,
    ``MAX_PROGRAMS // rows`` and ``n_cols / MIN_SPLIT_COLS``. A small batch's row is then pushed,
    polled and summed by several SMs at once instead of one (at one row of 8,192 and four ranks a
    single program moves 64 KB of stores and 64 KB of polls by itself). At two ranks a program
    sends to one peer only and the flag exchange costs more than it saves (see the module doc).
    """
    block = far._next_pow2(n_cols)
    if world_size < MIN_SPLIT_WORLD:
        return 1, block
    limit = min(int(max_splits), far.MAX_PROGRAMS // max(rows, 1), max(n_cols // MIN_SPLIT_COLS, 1))
    if limit < 2:
        return 1, block
    chunk = block // (1 << (limit.bit_length() - 1))
    return -(-n_cols // chunk), chunk


@dataclass(frozen=True)
class LamportRegion:
    """Where the push kernel's slots lie in every rank's symmetric buffer (bytes).

    Attributes:
        offset: start of the region (``[2 dtypes][3 phases][W][slot_bytes]``).
        slot_bytes: one source rank's message (the largest, ``one_shot_max_bytes``, padded).
        world_size: ranks (``W``).
        max_row_splits: the most programs a call cuts one row into (`row_splits`).
    """

    offset: int
    slot_bytes: int
    world_size: int
    max_row_splits: int = DEFAULT_ROW_SPLITS

    @classmethod
    def after(cls, used_bytes: int, max_message_bytes: int, world_size: int,
              max_row_splits: int = DEFAULT_ROW_SPLITS) -> "LamportRegion":
        """The region placed after the first ``used_bytes`` of the buffer."""
        return cls(far._round_up(used_bytes, _ALIGN), far._round_up(max(max_message_bytes, 16), _ALIGN), world_size,
                   max_row_splits)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one dtype's half (all phases and slots)."""
        return PHASES * self.world_size * self.slot_bytes

    @property
    def end(self) -> int:
        """Buffer bytes the region needs (its end)."""
        return self.offset + 2 * self.dtype_bytes

    def slot_offset(self, dtype: torch.dtype, phase: int, src: int) -> int:
        """Byte offset of source rank ``src``'s slot of ``phase`` for messages of ``dtype``."""
        half = _SENTINELS[dtype][0]
        return self.offset + ((half * PHASES + phase) * self.world_size + src) * self.slot_bytes

    def fill_sentinels(self, buffer: torch.Tensor) -> None:
        """Set every slot of ``buffer`` (this rank's uint8 symmetric buffer) to the sentinel."""
        for half, element, _, bits_dtype in _SENTINELS.values():
            start = self.offset + half * self.dtype_bytes
            buffer[start:start + self.dtype_bytes].view(bits_dtype).fill_(element)


def push_unsupported_reason(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            lamport: LamportRegion) -> Optional[str]:
    """Why `fused_all_reduce_add_rmsnorm_push` cannot take ``(x, residual, weight)`` (None:
    it can): the pull kernel's conditions (`fused_all_reduce.fused_unsupported_reason`),
    with a slot in place of a half."""
    # only the message limit of the region is read: a slot is as large as a half
    return far.fused_unsupported_reason(x, residual, weight, far.FusedRegion(0, lamport.slot_bytes, 0,
                                                                             lamport.world_size))


def fused_all_reduce_add_rmsnorm_push(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                      weight_offset: float, buffer_ptrs: torch.Tensor, counters: torch.Tensor,
                                      rank: int, lamport: LamportRegion) -> torch.Tensor:
    """``residual += sum over ranks of x`` (in place) and return ``rmsnorm(residual)``, push mode.

    A collective: every rank of the group calls it with the same shapes, in the same order.

    Args:
        x: ``[..., N]`` this rank's partial sums (float32 / bfloat16, contiguous); not modified.
        residual: ``[..., N]`` residual stream, same shape and dtype; overwritten.
        weight / eps / weight_offset: the norm's ``x_hat * (weight + weight_offset)``.
        buffer_ptrs: int64 ``[W]`` on ``x``'s device: each rank's symmetric buffer address.
        counters: int64 ``[PUSH_COUNTERS]`` zeros at start, on ``x``'s device, private to this group.
        rank: this rank.
        lamport: the region of the buffers, every slot at the sentinel before the first call.

    Returns:
        new ``[..., N]`` tensor in ``x``'s dtype (the pull kernel's bits, up to the sign of zeros).
    Raises:
        ValueError: `push_unsupported_reason` gives a reason.
    """
    return _launch(x, residual, weight, eps, weight_offset, buffer_ptrs, counters, rank, lamport, stage=0)


def compile_fused_push(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, buffer_ptrs: torch.Tensor,
                       counters: torch.Tensor, rank: int, lamport: LamportRegion) -> None:
    """Compile the push kernel for these arguments without launching it (Triton's ``warmup``)."""
    _launch(x, residual, weight, 1e-6, 0.0, buffer_ptrs, counters, rank, lamport, stage=0, warmup=True)


def _launch(x, residual, weight, eps, weight_offset, buffer_ptrs, counters, rank, lamport, stage: int,
            warmup: bool = False):
    """The launch; ``stage`` 1 (push only) / 2 (the rest; split rows: up to the flags) / 3 (split
    rows: the rest) cut it for the CPU tests (see the kernels)."""
    why = push_unsupported_reason(x, residual, weight, lamport)
    if why is not None:
        raise ValueError(f"fused_all_reduce_add_rmsnorm_push: {why}")
    if counters.dtype != torch.int64 or counters.numel() < PUSH_COUNTERS:
        raise ValueError(f"fused_all_reduce_add_rmsnorm_push: counters must be int64 [{PUSH_COUNTERS}], got "
                         f"{counters.dtype} {tuple(counters.shape)}")
    from attnserve.distributed import fused_all_reduce_push_triton as kernels

    n = x.shape[-1]
    rows = x.numel() // n
    out = torch.empty_like(residual)
    block = far._next_pow2(n)
    warps = far.norm_warps(block)  # fused_add_rmsnorm's: tl.sum adds in the same order
    half, sentinel, word, bits_dtype = _SENTINELS[x.dtype]
    bits = x.view(bits_dtype)
    n_vec = (x.numel() * x.element_size() + 15) // 16
    splits, chunk = row_splits(rows, n, lamport.max_row_splits, lamport.world_size)
    head = (bits, residual, weight.contiguous(), out, buffer_ptrs, counters)
    tail = (rank, rows, n, n_vec, float(eps), float(weight_offset), lamport.offset, lamport.slot_bytes)
    meta = dict(W=lamport.world_size, BLOCK=block, CLEAR_BLOCK=128 * warps, DTYPE_INDEX=half, SENTINEL=sentinel,
                SENTINEL_WORD=word, STAGE=stage, num_warps=warps)
    if splits == 1:
        kernel, args, grid = kernels._lamport_fused_add_rmsnorm_kernel, head + tail, (min(rows, far.MAX_PROGRAMS),)
    else:
        kernel, args, grid = kernels._lamport_split_rows_kernel, head + (counters[ROW_FLAGS_AT:],) + tail, \
            (rows * splits,)
        meta.update(W_P2=far._next_pow2(lamport.world_size), CHUNK=chunk, SPLITS=splits,
                    SPLITS_P2=far._next_pow2(splits))
    if warmup:
        kernel.warmup(*args, grid=grid, **meta)
    else:
        kernel[grid](*args, **meta)
    return out
