"""How much of a decode GEMV's weight to hint into the L2 before its PDL wait.

A decode step at batch 1 is a chain of weight streams (the skinny GEMVs) separated by short
kernels that move almost no bytes: RMSNorm, RoPE, decode attention and, under tensor
parallelism, the fused all-reduce + add + RMSNorm (8-9 µs a call on four H100s, 64 calls a
Llama-3-8B step). With programmatic dependent launch (`attnserve.pdl`) a GEMV's programs
are resident while that kernel runs, parked at ``griddepcontrol.wait``. Parked, a program
may read parameters but no activation, so it can ask the L2 for its own weight rows
(``prefetch.global.L2``, one instruction per 128-byte line): HBM then streams the GEMV's
weight during the kernel before it, which would otherwise leave the memory idle, and the
GEMV's loads after the wait hit the L2.

`l2_prefetch_lines` sizes the hint: ``L`` lines of every weight row (a power of two, the
kernel's ``tl.arange``), from the column after the program's first tile, so that all rows
together stay within a byte budget (the L2 is 50 MB on an H100; a budget well below it
keeps the hinted lines resident until they are read). ``ATTNSERVE_GEMV_L2_PREFETCH_MB``
sets the budget (0 turns the hint off; the default is `DEFAULT_BUDGET_MB`).

The hint changes no value: the GEMV computes the same bits with or without it.
"""

from __future__ import annotations

from typing import Optional

from attnserve.env_options import env_bytes

__all__ = ["DEFAULT_BUDGET_MB", "L2_LINE_BYTES", "PREFETCH_ENV", "l2_prefetch_budget", "l2_prefetch_lines"]

#: bytes of one L2 line, the unit of ``prefetch.global.L2`` (PTX ISA, "prefetch")
L2_LINE_BYTES = 128
#: environment variable of the budget, MiB (fractions allowed; 0: off)
PREFETCH_ENV = "ATTNSERVE_GEMV_L2_PREFETCH_MB"
#: the budget when the variable is unset, MiB
DEFAULT_BUDGET_MB = 0.0


def l2_prefetch_budget() -> int:
    """The budget in bytes, from `PREFETCH_ENV` (read at every call, so a benchmark can capture
    graphs with several budgets in one process).

    Raises:
        ValueError: the variable is set but not a number >= 0.
    """
    budget = env_bytes(PREFETCH_ENV, 1 << 20)
    return int(DEFAULT_BUDGET_MB * (1 << 20)) if budget is None else budget


def l2_prefetch_lines(weight_rows: int, k: int, itemsize: int, block_k: int,
                      budget_bytes: Optional[int] = None) -> int:
    """Lines of each weight row to hint into the L2 before the wait (0: no hint).

    Args:
        weight_rows: rows the launch streams (``2I`` for a gated ``gate_up``).
        k: columns of a row (elements).
        itemsize: bytes of a weight element (2 for 16-bit, 1 for FP8).
        block_k: columns of a program's first tile, which it loads into registers itself.
        budget_bytes: bytes for all rows together; None: `l2_prefetch_budget`.

    Returns:
        The largest power of two ``L`` with ``weight_rows * L * 128 <= budget``, at most the
        power of two covering the lines after the first tile; 0 when no line fits the budget
        or the first tile is the whole row.

    Raises:
        ValueError: a negative or zero size.
    """
    if weight_rows <= 0 or k <= 0 or itemsize <= 0 or block_k <= 0:
        raise ValueError(f"l2_prefetch_lines: rows={weight_rows}, k={k}, itemsize={itemsize}, block_k={block_k}")
    budget = l2_prefetch_budget() if budget_bytes is None else int(budget_bytes)
    rest = (k - block_k) * itemsize
    if budget <= 0 or rest <= 0:
        return 0
    per_row = budget // (weight_rows * L2_LINE_BYTES)
    if per_row < 1:
        return 0
    lines = 1 << (per_row.bit_length() - 1)  # largest power of two <= per_row
    cover = 1 << max(-(-rest // L2_LINE_BYTES) - 1, 0).bit_length()  # power of two >= the rest's lines
    return min(lines, cover)
