"""`row_argmax`: each row's argmax over a vocabulary, in two Triton passes.

Greedy decoding and Gumbel-max sampling (`attnserve.engine.sampler`) take one argmax per
row of ``[n, V]`` logits every step. PyTorch's CUDA ``argmax`` reduces a row in one block
when there are few rows: 28 µs for one 128,256-wide float32 row and 41 µs for 64 rows on an
H100 (torch 2.11, ``benchmarks/results/h100x4-tp-8b-nopdl-profile-2026-11-27.json``),
~1% of a Llama-3-8B decode step at batch 1 with FP8 weights or at tp 4. Here stage 1 spreads
a row over ``cdiv(V, 4096)`` programs (32 for Llama-3's vocabulary), each reducing 4,096
entries to one candidate, and stage 2 reduces a row's candidates; the result is
``torch.argmax``'s, bit for bit (NaN above every number, the first index on ties; see
`row_argmax_triton`). CUDA-graph capturable (allocates its scratch and output, reads
nothing back).
"""

from __future__ import annotations

from types import ModuleType

import torch

from attnserve.triton_env import triton_interpreting

__all__ = ["ARGMAX_PIECE", "row_argmax", "row_argmax_supported"]

#: entries of a row one stage-1 program reduces (16 KB of float32: enough bytes in flight
#: per program, and few enough candidates for one stage-2 tile)
ARGMAX_PIECE = 4096


def _kernels() -> ModuleType:
    """`row_argmax_triton`, imported on the first launch (it imports Triton)."""
    from attnserve.engine import row_argmax_triton

    return row_argmax_triton


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: the index of each row's largest entry of ``x`` ``[n, V]``, as
    ``torch.argmax(x, dim=-1)`` gives it (a NaN counts as the largest; ties go to the
    lowest index).

    Args:
        x: ``[n, V]`` float32 / bfloat16 / float16 on a CUDA device (or the CPU under
            ``TRITON_INTERPRET=1``), any row stride, unit stride along ``V``.

    Raises:
        ValueError: ``x`` not 2-D, ``V == 0``, ``V >= 2**31``, or a non-unit stride along ``V``.
    """
    if x.dim() != 2:
        raise ValueError(f"row_argmax: x must be 2-D [n, V], got shape {tuple(x.shape)}")
    n, v = x.shape
    if v == 0 or v >= 2**31 or (x.stride(1) != 1 and v > 1):
        raise ValueError(f"row_argmax: need 0 < V < 2**31 and a unit stride along V, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    block = min(ARGMAX_PIECE, 1 << max(v - 1, 0).bit_length())
    pieces = -(-v // block)
    vals = torch.empty(n, pieces, dtype=torch.float32, device=x.device)
    idxs = torch.empty(n, pieces, dtype=torch.int32, device=x.device)
    k = _kernels()
    k._argmax_stage1_kernel[(n, pieces)](x, vals, idxs, x.stride(0), v, pieces, BLOCK=block, num_warps=8)
    k._argmax_stage2_kernel[(n,)](vals, idxs, out, v, pieces, BLOCK_P=max(16, 1 << max(pieces - 1, 0).bit_length()),
                                  num_warps=1)
    return out


def row_argmax_supported(x: torch.Tensor) -> bool:
    """Whether `row_argmax` takes ``x``: a 2-D float tensor on CUDA (or the CPU under the
    Triton interpreter) with a unit stride along its last dim."""
    return (x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape[1] > 0
            and x.stride(1) == 1 and (x.is_cuda or (x.device.type == "cpu" and triton_interpreting())))
