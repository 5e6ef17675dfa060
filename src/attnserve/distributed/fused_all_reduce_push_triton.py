"""Triton kernel behind `attnserve.distributed.fused_all_reduce_push` (import that module, not this one).

The push-mode ("Lamport") variant of `fused_all_reduce_triton`'s kernel: the same sum, residual
add and RMSNorm, but every rank *stores* its rows into every peer's buffer and then polls its
own buffer, so no flag and no remote read is on the critical path. The protocol, the layout
of the Lamport region and the argument for the three phases are in `fused_all_reduce_push`.

``STAGE`` splits the launch for the CPU tests only (the Triton interpreter runs one simulated
rank at a time, so a rank cannot spin while a later rank pushes): ``0`` does everything (the
GPU path), ``1`` only the push, ``2`` the rest (clear, wait, reduce, norm, counters). The
split-row kernel (`_lamport_split_rows_kernel`, several programs a row for small batches)
also waits for the other programs of its launch, so its CPU tests run three stages.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.distributed.fused_all_reduce_triton import add_rmsnorm_row, rmsnorm_row_store


@triton.jit
def _lamport_fused_add_rmsnorm_kernel(
    x_bits_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    buf_table_ptr,
    counter_ptr,
    rank,
    n_rows,
    n_cols,
    n_vec,
    eps,
    w_offset,
    region_offset,
    slot_bytes,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr,
    DTYPE_INDEX: tl.constexpr,
    SENTINEL: tl.constexpr,
    SENTINEL_WORD: tl.constexpr,
    STAGE: tl.constexpr,
):
    """Rows ``pid, pid + G, ...`` (``G`` programs) of contiguous ``[n_rows, n_cols]`` tensors.

    ``x_bits_ptr``: the partial sums viewed as int16 (bfloat16) / int32 (float32);
    ``buf_table_ptr``: int64 ``[W]`` byte addresses of every rank's symmetric buffer;
    ``n_vec``: the message's size in 16-byte vectors (rounded up);
    ``counter_ptr``: int64 ``[5]`` on this rank (completed calls, programs finished, the
    previous call's message in 16-byte vectors, its phase's byte offset, its sentinel word);
    ``region_offset`` / ``slot_bytes``: the Lamport region (bytes); ``DTYPE_INDEX``: which
    of its two dtype halves (0 float32, 1 bfloat16); ``SENTINEL``: negative zero's bits in
    the storage dtype (as a signed integer); ``SENTINEL_WORD``: two of them (or one float32)
    as an int32, what the next call's clear writes.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    dtype = res_ptr.dtype.element_ty
    bits_ty = x_bits_ptr.dtype.element_ty
    epoch = tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu") + 1
    phase_off = region_offset + ((DTYPE_INDEX * 3 + epoch % 3) * W) * slot_bytes  # slot 0 of this call
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    own_base = tl.load(buf_table_ptr + rank)
    if STAGE != 2:
        # 1. push: this rank's rows into slot `rank` of every rank's buffer (its own included)
        for row in range(pid, n_rows, n_prog):
            off = row * n_cols  # < slot_bytes elements: int32 is enough
            bits = tl.load(x_bits_ptr + off + cols, mask=mask, other=0)
            # -0.0 -> +0.0: no pushed element equals the sentinel
            bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)
            for i in tl.static_range(W):
                q = (rank + 1 + i) % W  # peers first, own buffer last
                base = tl.load(buf_table_ptr + q)
                dst = tl.multiple_of((base + phase_off + rank * slot_bytes).to(tl.pointer_type(bits_ty)), 16)
                tl.store(dst + off + cols, bits, mask=mask)
    if STAGE != 1:
        # 2. clear the previous call's phase in the own buffer (nobody writes or reads it now)
        _clear_previous_call(counter_ptr, own_base, slot_bytes, pid, n_prog, W, CLEAR_BLOCK)
        # 3. wait for each rank's rows in the own buffer, summing in rank order
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + w_offset
        for row in range(pid, n_rows, n_prog):
            off = row * n_cols
            acc = tl.zeros([BLOCK], tl.float32)
            for r in tl.static_range(W):
                src = tl.multiple_of((own_base + phase_off + r * slot_bytes).to(tl.pointer_type(bits_ty)), 16)
                bits = tl.load(src + off + cols, mask=mask, other=0, volatile=True)
                while tl.sum((bits == SENTINEL).to(tl.int32), axis=0) > 0:
                    bits = tl.load(src + off + cols, mask=mask, other=0, volatile=True)
                v = bits.to(dtype, bitcast=True).to(tl.float32)
                if r == 0:
                    acc = v
                else:
                    acc = (acc + v).to(dtype).to(tl.float32)  # one rounding per add, as the pull kernel
            add_rmsnorm_row(acc, res_ptr, out_ptr, w, off, cols, mask, n_cols, eps)  # the pull kernel's epilogue
        # 4. the last program records this call (what the next call clears) and bumps the epoch
        _record_call(counter_ptr, n_prog, n_vec, phase_off, epoch, SENTINEL_WORD)


@triton.jit
def _clear_previous_call(counter_ptr, own_base, slot_bytes, pid, n_prog, W: tl.constexpr, CLEAR_BLOCK: tl.constexpr):
    """Write the sentinel back over the previous call's data in the own buffer (its size in
    16-byte vectors, phase offset and sentinel word are ``counter_ptr[2:5]``), chunks strided
    over the programs; nobody writes or reads that phase now (see `fused_all_reduce_push`)."""
    prev_vec = tl.load(counter_ptr + 2, volatile=True)
    prev_off = tl.load(counter_ptr + 3, volatile=True)
    prev_word = tl.load(counter_ptr + 4, volatile=True).to(tl.int32)
    cw = tl.arange(0, CLEAR_BLOCK)
    fill = tl.zeros([CLEAR_BLOCK], tl.int32) + prev_word
    n_chunks = tl.cdiv(prev_vec * 4, CLEAR_BLOCK).to(tl.int32)  # a slot is < 2 GB
    for s in tl.static_range(W):
        slot = tl.multiple_of((own_base + prev_off + s * slot_bytes).to(tl.pointer_type(tl.int32)), 16)
        for c in range(pid, n_chunks, n_prog):
            words = c * CLEAR_BLOCK + cw
            # whole 16-byte vectors (one mask per 4 words: vector stores); past the message
            # they overwrite the sentinel with itself (slots are 256-byte multiples)
            tl.store(slot + words, fill, mask=(words // 4) < prev_vec)


@triton.jit
def _record_call(counter_ptr, n_prog, n_vec, phase_off, epoch, SENTINEL_WORD: tl.constexpr):
    """The last program of the launch to get here records this call in ``counter_ptr[2:5]``
    (what the next call clears) and then stores ``epoch`` (release)."""
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == n_prog - 1:
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 2, tl.full([], 0, tl.int64) + n_vec, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 3, phase_off.to(tl.int64), sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 4, tl.full([], SENTINEL_WORD, tl.int64), sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr, epoch, sem="release", scope="gpu")


@triton.jit
def _lamport_split_rows_kernel(
    x_bits_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    buf_table_ptr,
    counter_ptr,
    flag_ptr,
    rank,
    n_rows,
    n_cols,
    n_vec,
    eps,
    w_offset,
    region_offset,
    slot_bytes,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr,
    DTYPE_INDEX: tl.constexpr,
    SENTINEL: tl.constexpr,
    SENTINEL_WORD: tl.constexpr,
    STAGE: tl.constexpr,
):
    """The push kernel with each row cut into ``SPLITS`` programs: program ``pid`` takes columns
    ``[c * CHUNK, (c + 1) * CHUNK)`` (``c = pid % SPLITS``) of row ``pid // SPLITS``; the grid is
    exactly ``n_rows * SPLITS`` programs (``SPLITS = cdiv(n_cols, CHUNK)``, ``SPLITS_P2`` its next
    power of two). Arguments as `_lamport_fused_add_rmsnorm_kernel`'s, and
    ``flag_ptr``: int64 ``[>= n_prog]`` on this rank, ``flag_ptr[pid]`` the last call in which
    program ``pid`` stored its columns of the new residual (they only grow).

    Steps 1-3 of the one-program-per-row kernel on the program's columns (push, clear, wait
    until one ``[W_P2, CHUNK]`` tile of all ranks' columns holds no sentinel, sum them in rank
    order from 1-D loads, residual add, stored in place); then it raises its flag, waits for the
    flags of its row's other programs, loads the whole new residual row and normalises it with
    `rmsnorm_row_store`, storing its own columns only: every program of a row computes the same
    sum of squares in the same order, the one the pull kernel computes. ``STAGE`` (CPU tests):
    ``1`` push, ``2`` up to the flag, ``3`` the rest, each launched for every rank in turn; ``0``
    everything (GPUs).
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    row = pid // SPLITS
    dtype = res_ptr.dtype.element_ty
    bits_ty = x_bits_ptr.dtype.element_ty
    epoch = tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu") + 1
    phase_off = region_offset + ((DTYPE_INDEX * 3 + epoch % 3) * W) * slot_bytes  # slot 0 of this call
    c0 = (pid % SPLITS) * CHUNK
    ccols = c0 + tl.arange(0, CHUNK)
    cmask = ccols < n_cols
    off = row * n_cols  # < slot_bytes elements: int32 is enough
    own_base = tl.load(buf_table_ptr + rank)
    if STAGE == 0 or STAGE == 1:
        # 1. push: the program's columns into slot `rank` of every rank's buffer (its own last)
        bits = tl.load(x_bits_ptr + off + ccols, mask=cmask, other=0)
        bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)  # -0.0 -> +0.0
        for i in tl.static_range(W):
            base = tl.load(buf_table_ptr + (rank + 1 + i) % W)
            dst = tl.multiple_of((base + phase_off + rank * slot_bytes).to(tl.pointer_type(bits_ty)), 16)
            tl.store(dst + off + ccols, bits, mask=cmask)
    if STAGE == 0 or STAGE == 2:
        # 2. clear the previous call's phase in the own buffer
        _clear_previous_call(counter_ptr, own_base, slot_bytes, pid, n_prog, W, CLEAR_BLOCK)
        # 3. wait until every rank's columns are in: one tile of all ranks' columns (the W loads
        # in flight together) reduced to a count of sentinels
        srcs = tl.arange(0, W_P2)
        slots = tl.multiple_of((own_base + phase_off + srcs * slot_bytes).to(tl.pointer_type(bits_ty)), 16)
        tile = slots[:, None] + (off + ccols)[None, :]
        tmask = (srcs < W)[:, None] & cmask[None, :]
        waiting = 1
        while waiting > 0:
            got = tl.load(tile, mask=tmask, other=0, volatile=True)
            waiting = tl.sum(tl.sum((got == SENTINEL).to(tl.int32), axis=1), axis=0)
        # then sum them in rank order, one rounding per add, from 1-D loads in the chunk's own
        # layout (taking rank r's row out of the tile costs layout conversions through shared
        # memory from 4 programs a row up: 27 barriers against 10)
        for r in tl.static_range(W):
            src = tl.multiple_of((own_base + phase_off + r * slot_bytes).to(tl.pointer_type(bits_ty)), 16)
            v = tl.load(src + off + ccols, mask=cmask, other=0, volatile=True).to(dtype, bitcast=True).to(tl.float32)
            if r == 0:
                acc = v
            else:
                acc = (acc + v).to(dtype).to(tl.float32)
        r_val = tl.load(res_ptr + off + ccols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(res_ptr + off + ccols, (acc + r_val).to(dtype), mask=cmask)
        tl.debug_barrier()  # every thread's columns are stored before the flag says so
        tl.atomic_xchg(flag_ptr + pid, epoch, sem="release", scope="gpu")
    if STAGE == 0 or STAGE == 3:
        # 4. the row's programs' flags (one vector of atomics), then the whole row's norm
        # polled with plain volatile loads (read-modify-write atomics from every program of the
        # row on one line serialised at the L2: 15-25 µs a call at 4-8 programs a row), then
        # read once more with acquire atomics: they read the released values, so the row's
        # residual stores are visible to the loads below
        ks = tl.arange(0, SPLITS_P2)
        live = ks < SPLITS
        row_flags = flag_ptr + row * SPLITS + ks
        waiting = 1
        while waiting > 0:  # only a scalar carried round the loop (a carried vector of atomics crashes Triton 3.6)
            seen = tl.load(row_flags, mask=live, other=0, volatile=True)
            waiting = tl.sum((live & (seen < epoch)).to(tl.int32), axis=0)
        tl.atomic_add(row_flags, tl.zeros([SPLITS_P2], tl.int64), mask=live, sem="acquire", scope="gpu")
        tl.debug_barrier()
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        s = tl.load(res_ptr + off + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + w_offset
        rmsnorm_row_store(s, out_ptr, w, off, cols, mask & (cols >= c0) & (cols < c0 + CHUNK), n_cols, eps)
        # 5. as the one-program-per-row kernel
        _record_call(counter_ptr, n_prog, n_vec, phase_off, epoch, SENTINEL_WORD)
