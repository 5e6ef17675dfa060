"""Triton kernels behind `attnserve.engine.row_argmax` (import that module, not this one).

A row's argmax in two passes: stage 1 reduces each ``BLOCK``-wide piece of a row to one
candidate (value, index); stage 2 reduces a row's candidates. The order on candidates is
``torch.argmax``'s: a NaN is larger than every number (the first NaN wins), and among equal
values the lowest index wins. A piece is reduced as

* ``nan_idx``: the lowest index of a NaN in it (``V``, past every index, when none);
* otherwise ``best``: its largest value, and the lowest index holding it.

Stage 1 writes ``(best, idx)`` with ``best`` set to NaN when the piece has a NaN (``idx``
its first NaN); stage 2 applies the same rule to the candidates, which are in index order,
so the lowest candidate index is the lowest token index.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _reduce_piece(vals, offs, valid, V):
    """(value, index) of the piece ``vals`` (float32, ``offs`` their token indices, ``valid``
    the mask) under torch.argmax's order; the value is NaN when the piece holds a NaN."""
    is_nan = (vals != vals) & valid
    nan_idx = tl.min(tl.where(is_nan, offs, V), axis=0)
    clean = tl.where(valid & (vals == vals), vals, float("-inf"))
    best = tl.max(clean, axis=0)
    # the lowest valid index holding ``best`` (a piece of only -inf values: its first index)
    best_idx = tl.min(tl.where(valid & (clean == best), offs, V), axis=0)
    has_nan = nan_idx < V
    idx = tl.where(has_nan, nan_idx, best_idx)
    val = tl.where(has_nan, float("nan"), best)
    return val, idx


@triton.jit
def _argmax_stage1_kernel(x_ptr, val_ptr, idx_ptr, stride_x, V, num_pieces, BLOCK: tl.constexpr):
    """Grid ``(rows, num_pieces)``: candidate of piece ``program_id(1)`` of row
    ``program_id(0)`` into ``val[row, piece]`` / ``idx[row, piece]``."""
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    offs = piece * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    vals = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=float("-inf")).to(tl.float32)
    val, idx = _reduce_piece(vals, offs, valid, V)
    tl.store(val_ptr + row * num_pieces + piece, val)
    tl.store(idx_ptr + row * num_pieces + piece, idx)


@triton.jit
def _argmax_stage2_kernel(val_ptr, idx_ptr, out_ptr, V, num_pieces, BLOCK_P: tl.constexpr):
    """Grid ``(rows,)``: the row's argmax from its ``num_pieces`` candidates (int64 out)."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    valid = p < num_pieces
    vals = tl.load(val_ptr + row * num_pieces + p, mask=valid, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * num_pieces + p, mask=valid, other=V)
    _, out = _reduce_piece(vals, idxs, valid, V)  # candidates: the same order on (value, index)
    tl.store(out_ptr + row, out.to(tl.int64))
