"""Triton kernel behind `attnserve.distributed.fused_all_reduce` (import that module, not this one).

One launch does a one-shot all-reduce of a row-parallel layer's partial sums, the residual
add and the RMSNorm that follows (the decoder's ``o_proj`` / ``down_proj`` -> add -> norm).
Every rank's symmetric buffer (`custom_all_reduce`) holds, past the region PyTorch's own
kernels use, two halves for the message and one int64 flag per (program, source rank):

1. each program copies its rows of the local partial sums into the own buffer's half
   ``epoch % 2`` (``epoch``: calls completed on this rank, read from ``counter_ptr``, + 1);
2. it writes ``epoch`` into its flag slot of every rank's buffer (release, system scope),
   then waits until every rank's flag in its own slots is ``>= epoch`` (acquire);
3. it sums the rows of all ranks' halves in rank order ``0..W-1``, rounding to the storage
   dtype after every add (as ``torch.ops.symm_mem.one_shot_all_reduce`` does: ``vecs[0]``,
   then ``add_vec`` per rank), adds the residual (rounded), stores it in place and writes
   the normalised row with the float32 arithmetic of ``_fused_add_rmsnorm_kernel``;
4. the last program to finish stores ``epoch`` (the next call's halves and flags move on).

No barrier closes the kernel: a rank writes a half again two calls later, and by then
every peer has started the call in between, so it has finished reading that half (kernels
on a stream run one after the other). With ``USE_PDL`` the kernel is launched with
programmatic dependent launch (`attnserve.pdl`): a program first waits for the kernel before
it (``gdc_wait``, before it reads the counter, ``x`` or a buffer), then lets the next kernel
launch (``gdc_launch_dependents``), so the next GEMV's programs start and hint their weight
into the L2 while this one exchanges its rows (`attnserve.models.layers.l2_prefetch`). The
order argument above still holds: every PDL kernel of a step waits for the one before it
before it completes, so call ``k + 1``'s work after its wait follows call ``k``'s completion
on this rank. Flags only grow (int64), so a fast peer's later flag also releases a
slow rank. Algorithm studied in PyTorch's ``CUDASymmetricMemoryOps.cu`` (one-shot kernel,
``sync_remote_blocks``) and TensorRT-LLM's fused all-reduce + RMSNorm; the code is our own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.pdl_triton import gdc_launch_dependents, gdc_wait


@triton.jit
def add_rmsnorm_row(acc, res_ptr, out_ptr, w, off, cols, mask, n_cols, eps):
    """One row's epilogue, shared by the pull and push kernels: ``residual[row] += acc``
    (rounded to the residual's dtype, stored in place) and ``out[row] = rmsnorm(residual[row])
    * w`` with the float32 arithmetic of ``_fused_add_rmsnorm_kernel`` (fused_kernels_triton.py),
    so both kernels are bit-identical to all-reduce followed by ``fused_add_rmsnorm``.
    ``acc``: the row's float32 all-reduced sum; ``w``: float32 weight (offset included)."""
    dtype = res_ptr.dtype.element_ty
    r_val = tl.load(res_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
    s = (acc + r_val).to(dtype)
    tl.store(res_ptr + off + cols, s, mask=mask)
    rmsnorm_row_store(s.to(tl.float32), out_ptr, w, off, cols, mask, n_cols, eps)


@triton.jit
def rmsnorm_row_store(s, out_ptr, w, off, cols, store_mask, n_cols, eps):
    """``out[row, cols] = rmsnorm(s) * w`` where ``store_mask``: ``s`` is the whole new residual
    row in float32 (zeros past ``n_cols``), the float32 arithmetic of ``_fused_add_rmsnorm_kernel``.
    The push kernel's split-row variant stores only its own columns of the row it normalises."""
    mean_sq = tl.sum(s * s, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    y = s * rstd * w
    tl.store(out_ptr + off + cols, y.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _fused_all_reduce_add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    buf_table_ptr,
    counter_ptr,
    rank,
    n_rows,
    n_cols,
    eps,
    w_offset,
    data_offset,
    half_bytes,
    flags_offset,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Rows ``pid, pid + G, ...`` (``G`` programs) of contiguous ``[n_rows, n_cols]`` tensors.

    ``buf_table_ptr``: int64 ``[W]`` byte addresses of every rank's symmetric buffer;
    ``counter_ptr``: int64 ``[2]`` on this rank (completed calls, programs finished);
    ``data_offset`` / ``half_bytes`` / ``flags_offset``: the fused region, bytes.
    """
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    dtype = res_ptr.dtype.element_ty
    epoch = tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu") + 1
    half = (epoch % 2) * half_bytes
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    own_base = tl.load(buf_table_ptr + rank)
    own_data = tl.multiple_of((own_base + data_offset + half).to(tl.pointer_type(dtype)), 16)
    for row in range(pid, n_rows, n_prog):
        off = row * n_cols  # < half_bytes elements: int32 is enough
        v = tl.load(x_ptr + off + cols, mask=mask, other=0.0)
        tl.store(own_data + off + cols, v, mask=mask)
    tl.debug_barrier()  # every thread's rows are written before the flags say so
    lanes = tl.arange(0, W_P2)
    live = lanes < W
    bases = tl.load(buf_table_ptr + lanes, mask=live, other=0)
    send = (bases + flags_offset + (pid * W + rank) * 8).to(tl.pointer_type(tl.int64))
    # idempotent: a lane repeated over threads writes the same value
    tl.atomic_xchg(send, tl.zeros([W_P2], tl.int64) + epoch, mask=live, sem="release", scope="sys")
    own_flags = (own_base + flags_offset + pid * W * 8).to(tl.pointer_type(tl.int64))
    for r in tl.static_range(W):
        while tl.atomic_add(own_flags + r, 0, sem="acquire", scope="sys") < epoch:
            pass
    tl.debug_barrier()
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + w_offset
    for row in range(pid, n_rows, n_prog):
        off = row * n_cols  # < half_bytes elements: int32 is enough
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(W):
            base = tl.load(buf_table_ptr + r)
            src = tl.multiple_of((base + data_offset + half).to(tl.pointer_type(dtype)), 16)
            v = tl.load(src + off + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            if r == 0:
                acc = v
            else:
                acc = (acc + v).to(dtype).to(tl.float32)  # one rounding per add, as the one-shot kernel
        add_rmsnorm_row(acc, res_ptr, out_ptr, w, off, cols, mask, n_cols, eps)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == n_prog - 1:
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr, epoch, sem="release", scope="gpu")
