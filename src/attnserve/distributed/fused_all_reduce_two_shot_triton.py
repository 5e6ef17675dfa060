"""Triton kernel behind `attnserve.distributed.fused_all_reduce_two_shot` (import that module, not this one).

The two-shot variant of `fused_all_reduce_triton`'s kernel: the same sum, residual add and
RMSNorm, bit for bit, with about ``W / 2`` times fewer bytes over NVLink per rank. The
protocol, the layout of the two-shot region and the argument for its two halves are in
`fused_all_reduce_two_shot`; the epilogue is the pull kernel's `add_rmsnorm_row`.

``STAGE`` splits the launch for the CPU tests only (the Triton interpreter runs one simulated
rank, and within it one program, at a time, so nothing may wait for a later launch or program):
``0`` does everything (the GPU path), ``1`` the scatter and the first arrival, ``2`` the first
wait, the reduction, the all-gather and the second arrival, ``3`` the second wait and the norm.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.distributed.fused_all_reduce_triton import add_rmsnorm_row


@triton.jit
def _arrive(counter_ptr, buf_table_ptr, flags_offset, rank, n_prog, value, epoch, BUMP: tl.constexpr,
            W: tl.constexpr, W_P2: tl.constexpr):
    """This program's stores are done: count it in ``counter_ptr[1]``; the last program of the
    launch to arrive resets the count (``BUMP``: stores ``epoch`` in ``counter_ptr[0]``) and
    writes ``value`` into slot ``rank`` of every rank's flags (release, system scope)."""
    tl.debug_barrier()  # every thread's stores are issued before the arrival
    # system scope: the fence waits for this program's stores into the peers' memory
    last = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="sys") == n_prog - 1
    if last:
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")
        if BUMP:
            tl.atomic_xchg(counter_ptr, epoch, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # the threads holding the flag lanes come after the reset (and the acquire)
    if last:
        lanes = tl.arange(0, W_P2)
        live = lanes < W
        bases = tl.load(buf_table_ptr + lanes, mask=live, other=0)
        dst = (bases + flags_offset + rank * 8).to(tl.pointer_type(tl.int64))
        # idempotent: a lane repeated over threads writes the same value
        tl.atomic_xchg(dst, tl.zeros([W_P2], tl.int64) + value, mask=live, sem="release", scope="sys")


@triton.jit
def _wait(own_flags, value, W: tl.constexpr):
    """Until every rank's flag in the own buffer is ``>= value`` (acquire, system scope)."""
    for q in tl.static_range(W):
        while tl.atomic_add(own_flags + q, 0, sem="acquire", scope="sys") < value:
            pass
    tl.debug_barrier()


@triton.jit
def _two_shot_fused_add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    buf_table_ptr,
    counter_ptr,
    rank,
    n_rows,
    n_cols,
    piece,
    eps,
    w_offset,
    scatter_offset,
    slot_bytes,
    gather_offset,
    flags_offset,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    STAGE: tl.constexpr,
):
    """Contiguous ``[n_rows, n_cols]`` tensors; rank ``o`` owns elements ``[o * piece, (o + 1) * piece)``
    of the flattened message (``piece``: a multiple of 16 elements; the last pieces may be short or empty).

    ``buf_table_ptr``: int64 ``[W]`` byte addresses of every rank's symmetric buffer;
    ``counter_ptr``: int64 ``[2]`` on this rank (completed calls, programs arrived);
    ``scatter_offset`` / ``slot_bytes`` / ``gather_offset`` / ``flags_offset``: the two-shot
    region (bytes): ``[2 halves][W sources][slot_bytes]``, then ``[2 halves][slot_bytes]``,
    then int64 ``[W]`` flags. ``CHUNK``: elements per program and step of the element-wise stages.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    dtype = res_ptr.dtype.element_ty
    epoch = tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu") + 1
    if STAGE == 3:  # alone, it runs after stage 2 bumped the count (CPU tests): the same call's epoch
        epoch = epoch - 1
    half = epoch % 2
    total = n_rows * n_cols  # < slot_bytes elements: int32 is enough
    n_units = tl.cdiv(piece, CHUNK)
    ch = tl.arange(0, CHUNK)
    own_base = tl.load(buf_table_ptr + rank)
    own_flags = (own_base + flags_offset).to(tl.pointer_type(tl.int64))
    if STAGE == 0 or STAGE == 1:
        # 1. scatter: piece o of x into slot `rank` of half `half` of rank o's buffer (peers first)
        for t in range(pid, W * n_units, n_prog):
            i = t // n_units
            start = ((rank + 1 + i) % W) * piece
            offs = start + (t - i * n_units) * CHUNK + ch
            m = offs < tl.minimum(start + piece, total)
            v = tl.load(x_ptr + offs, mask=m)
            base = tl.load(buf_table_ptr + (rank + 1 + i) % W)
            dst = tl.multiple_of((base + scatter_offset + (half * W + rank) * slot_bytes).to(tl.pointer_type(dtype)),
                                 16)
            tl.store(dst + offs, v, mask=m)
        _arrive(counter_ptr, buf_table_ptr, flags_offset, rank, n_prog, 2 * epoch - 1, epoch, False, W, W_P2)
    if STAGE == 0 or STAGE == 2:
        _wait(own_flags, 2 * epoch - 1, W)
        # 2. reduce the own piece over the sources in rank order, one rounding per add (the pull
        # kernel's order), and all-gather the sum into half `half` of every rank's gather area
        start = rank * piece
        end = tl.minimum(start + piece, total)
        for u in range(pid, n_units, n_prog):
            offs = start + u * CHUNK + ch
            m = offs < end
            acc = tl.zeros([CHUNK], tl.float32)
            for q in tl.static_range(W):
                src = tl.multiple_of(
                    (own_base + scatter_offset + (half * W + q) * slot_bytes).to(tl.pointer_type(dtype)), 16)
                v = tl.load(src + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
                if q == 0:
                    acc = v
                else:
                    acc = (acc + v).to(dtype).to(tl.float32)
            s = acc.to(dtype)  # exact: the last add rounded to the dtype already
            for i in tl.static_range(W):
                base = tl.load(buf_table_ptr + (rank + 1 + i) % W)
                dst = tl.multiple_of((base + gather_offset + half * slot_bytes).to(tl.pointer_type(dtype)), 16)
                tl.store(dst + offs, s, mask=m)
        _arrive(counter_ptr, buf_table_ptr, flags_offset, rank, n_prog, 2 * epoch, epoch, True, W, W_P2)
    if STAGE == 0 or STAGE == 3:
        _wait(own_flags, 2 * epoch, W)
        # 3. every row from the own gather area: residual add and norm (the pull kernel's epilogue)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + w_offset
        sums = tl.multiple_of((own_base + gather_offset + half * slot_bytes).to(tl.pointer_type(dtype)), 16)
        for row in range(pid, n_rows, n_prog):
            off = row * n_cols
            acc = tl.load(sums + off + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            add_rmsnorm_row(acc, res_ptr, out_ptr, w, off, cols, mask, n_cols, eps)
