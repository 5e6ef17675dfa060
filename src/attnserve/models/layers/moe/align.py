"""Token permutation of the fused MoE layer: slots sorted by expert, padded per expert to the block size.

`moe_align_block_size` turns the router's choice ``topk_ids [T, top_k]`` into the three
tensors the grouped GEMM of `attnserve.models.layers.moe.fused_moe_triton` walks: every
one of the ``S = T * top_k`` *slots* (flat index ``t * top_k + j``) is listed once, the
slots of expert 0 first, then those of expert 1, ..., each expert's run padded with the
sentinel ``S`` up to a multiple of ``block_size``, so that every ``block_size`` entries
(one *block*, the M tile of the GEMM) belong to one expert. The design is the
``moe_align_block_size`` of SGLang / vLLM (read for facts; the code is our own).

Everything runs on the device with static shapes derived from ``S``, ``E`` and
``block_size`` only: no host sync, CUDA-graph capturable. Two forms:

* ``S <= SMALL_ALIGN_MAX_SLOTS`` (decode, every layer of every step): one program of one
  launch. It zeroes per-expert counters in a scratch buffer, takes each slot's rank in
  its expert from ``atomic_add`` (the old value), forms the padded starts with a prefix
  sum, scatters the slots and writes the block expert ids, with CTA barriers between the
  phases (scratch re-read through L2, ``.cg``). Slots are walked in chunks of 1024
  (8 warps), so the kernel is compiled once per expert count, not per batch size, and
  each phase is one round trip to L2 up to 1024 slots (2048 slots, 128 experts, H100:
  25.4 µs with 256-slot chunks, 15.6 µs with 1024-slot chunks, 2026-11-26).
* larger ``S`` (prefill): a memset of the counters and three launches -- counting (many
  programs, which also fill the output with the sentinel), the prefix sum and block ids
  (one program), the scatter (many programs).

The order of the slots *within* an expert's run is the order in which the atomics were
served, so it can change from run to run; the GEMM computes every row independently of
its position in the tile, so results do not depend on it.

Under the Triton interpreter (``TRITON_INTERPRET=1``) the same kernels run on the CPU:
programs run one after another and barriers are no-ops, which preserves the phase order.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

__all__ = ["SMALL_ALIGN_MAX_SLOTS", "moe_align_block_size", "moe_align_sizes"]

#: largest number of slots (T * top_k) aligned by the single-program kernel
SMALL_ALIGN_MAX_SLOTS = 4096

_CHUNK = 1024  # slots (or output entries) per program of the multi-launch form
_SMALL_CHUNK = 1024  # slots (or output entries) per loop step of the single-program form
_BLOCK_ID_TILE = 8192  # block x expert comparisons per loop step when writing block expert ids


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def moe_align_sizes(num_slots: int, num_experts: int, block_size: int) -> Tuple[int, int]:
    """Static sizes of `moe_align_block_size`'s outputs: ``(max_num_tokens_padded, max_num_blocks)``.

    At most ``m = min(E, S)`` experts receive a slot, and padding adds at most
    ``block_size - 1`` entries to each, so the padded total never exceeds
    ``S + m * (block_size - 1)`` (``max_num_tokens_padded``, the length of
    ``sorted_token_ids``); the padded total is a multiple of ``block_size``, so at most
    ``max_num_tokens_padded // block_size`` blocks are used (the length of ``expert_ids``).
    """
    padded = num_slots + min(num_experts, num_slots) * (block_size - 1)
    return padded, padded // block_size


@triton.jit
def _block_expert_ids(expert_ids_ptr, ends, offs_e, E, total, max_blocks, block_size,
                      BLOCK_E: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr):
    """Write ``expert_ids[b]`` for every block ``b < max_blocks``: the expert whose padded
    run ``[end_{e-1}, end_e)`` holds entry ``b * block_size`` (= the number of experts
    whose run ends at or before it), or -1 past the padded ``total``."""
    valid_e = offs_e < E
    for b0 in range(0, max_blocks, BLOCKS_PER_STEP):
        offs_b = b0 + tl.arange(0, BLOCKS_PER_STEP)
        pos = offs_b * block_size
        before = (ends[None, :] <= pos[:, None]) & valid_e[None, :]
        e_of = tl.sum(before.to(tl.int32), axis=1)
        e_of = tl.where(pos < total, e_of, -1)
        tl.store(expert_ids_ptr + offs_b, e_of, mask=offs_b < max_blocks)


@triton.jit
def _padded_starts(cnt_ptr, start_ptr, ntpp_ptr, expert_ids_ptr, E, max_blocks, block_size,
                   BLOCK_E: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr):
    """From the per-expert counts at ``cnt_ptr``: store each expert's padded start at
    ``start_ptr``, the padded total at ``ntpp_ptr`` and the block expert ids."""
    offs_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(cnt_ptr + offs_e, mask=offs_e < E, other=0, cache_modifier=".cg")
    padded = (cnt + block_size - 1) // block_size * block_size
    ends = tl.cumsum(padded, 0)
    tl.store(start_ptr + offs_e, ends - padded, mask=offs_e < E)
    total = tl.sum(padded, 0)
    tl.store(ntpp_ptr, total)
    _block_expert_ids(expert_ids_ptr, ends, offs_e, E, total, max_blocks, block_size, BLOCK_E, BLOCKS_PER_STEP)


@triton.jit(do_not_specialize=["S", "max_len", "max_blocks"])
def _align_small_kernel(topk_ids_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr, scratch_ptr,
                        S, E, max_len, max_blocks, block_size,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr):
    """One program. ``scratch`` int32 ``[2 * BLOCK_E + S]``: counters, padded starts, ranks."""
    offs_e = tl.arange(0, BLOCK_E)
    rank_ptr = scratch_ptr + 2 * BLOCK_E
    tl.store(scratch_ptr + offs_e, tl.zeros((BLOCK_E,), dtype=tl.int32))
    for i0 in range(0, max_len, CHUNK):
        offs = i0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + S, mask=offs < max_len)
    tl.debug_barrier()
    for s0 in range(0, S, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < S, other=0)
        ok = (offs < S) & (ids >= 0) & (ids < E)
        rank = tl.atomic_add(scratch_ptr + ids, 1, mask=ok)
        tl.store(rank_ptr + offs, rank, mask=ok)
    tl.debug_barrier()
    _padded_starts(scratch_ptr, scratch_ptr + BLOCK_E, ntpp_ptr, expert_ids_ptr, E, max_blocks, block_size,
                   BLOCK_E, BLOCKS_PER_STEP)
    tl.debug_barrier()
    for s0 in range(0, S, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < S, other=0)
        ok = (offs < S) & (ids >= 0) & (ids < E)
        start = tl.load(scratch_ptr + BLOCK_E + ids, mask=ok, other=0, cache_modifier=".cg")
        rank = tl.load(rank_ptr + offs, mask=ok, other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + start + rank, offs, mask=ok)


@triton.jit(do_not_specialize=["S", "max_len"])
def _align_count_kernel(topk_ids_ptr, sorted_ptr, cnt_ptr, rank_ptr, S, E, max_len, CHUNK: tl.constexpr):
    """Grid ``cdiv(max_len, CHUNK)``: fill ``sorted`` with the sentinel ``S``; count the
    slots of this chunk (``cnt`` zeroed before) and keep each slot's rank."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(sorted_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + S, mask=offs < max_len)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < S, other=0)
    ok = (offs < S) & (ids >= 0) & (ids < E)
    rank = tl.atomic_add(cnt_ptr + ids, 1, mask=ok)
    tl.store(rank_ptr + offs, rank, mask=ok)


@triton.jit(do_not_specialize=["max_blocks"])
def _align_starts_kernel(cnt_ptr, start_ptr, ntpp_ptr, expert_ids_ptr, E, max_blocks, block_size,
                         BLOCK_E: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr):
    """One program: padded starts, padded total and block expert ids."""
    _padded_starts(cnt_ptr, start_ptr, ntpp_ptr, expert_ids_ptr, E, max_blocks, block_size, BLOCK_E,
                   BLOCKS_PER_STEP)


@triton.jit(do_not_specialize=["S"])
def _align_scatter_kernel(topk_ids_ptr, sorted_ptr, start_ptr, rank_ptr, S, E, CHUNK: tl.constexpr):
    """Grid ``cdiv(S, CHUNK)``: ``sorted[start[e] + rank] = slot``."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < S, other=0)
    ok = (offs < S) & (ids >= 0) & (ids < E)
    start = tl.load(start_ptr + ids, mask=ok, other=0)
    rank = tl.load(rank_ptr + offs, mask=ok, other=0)
    tl.store(sorted_ptr + start + rank, offs, mask=ok)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``T * top_k`` slots by expert and pad each expert's run to ``block_size``.

    Args:
        topk_ids: ``[T, top_k]`` (or any shape; flattened row-major into ``S`` slots) int32
            (other integer dtypes are converted) expert ids in ``[0, num_experts)``, on CUDA
            or on the CPU under the Triton interpreter. Ids outside that range are dropped
            (their slots are listed nowhere); the fused layer never produces them.
        block_size: the GEMM's ``BLOCK_SIZE_M`` (>= 1).
        num_experts: ``E`` (>= 1).

    Returns:
        ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, all int32 on
        ``topk_ids``' device, shapes fixed by ``(S, E, block_size)`` (`moe_align_sizes`):

        * ``sorted_token_ids`` ``[S + min(E, S) * (block_size - 1)]``: entries
          ``[pstart_e, pstart_e + count_e)`` are the slots routed to expert ``e`` (each slot
          exactly once over the whole tensor); the rest, including everything at or past
          the padded total, hold the sentinel ``S``; ``pstart_e`` = sum over ``e' < e`` of
          ``count_e'`` rounded up to a multiple of ``block_size``.
        * ``expert_ids`` ``[len(sorted_token_ids) // block_size]``: the expert of each block
          of ``block_size`` entries; -1 for blocks at or past the padded total (the GEMM
          skips them).
        * ``num_tokens_post_padded`` ``[1]``: the padded total ``sum_e roundup(count_e)``.

    Raises:
        ValueError: ``block_size`` or ``num_experts`` < 1, or ``topk_ids`` neither on CUDA
            nor on the CPU under the Triton interpreter.
    """
    from attnserve.triton_env import triton_interpreting

    if block_size < 1 or num_experts < 1:
        raise ValueError(f"moe_align_block_size: block_size ({block_size}) and num_experts ({num_experts}) must be >= 1")
    dev = topk_ids.device
    if not (topk_ids.is_cuda or (dev.type == "cpu" and triton_interpreting())):
        raise ValueError(f"moe_align_block_size: topk_ids is on {dev}; needs CUDA (or CPU under TRITON_INTERPRET=1)")
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    s = ids.numel()
    max_len, max_blocks = moe_align_sizes(s, num_experts, block_size)
    sorted_ids = torch.empty(max_len, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    ntpp = torch.empty(1, dtype=torch.int32, device=dev)
    if s == 0:
        ntpp.zero_()
        return sorted_ids, expert_ids, ntpp
    block_e = max(_next_pow2(num_experts), 16)
    blocks_per_step = max(8, min(64, _BLOCK_ID_TILE // block_e))
    if s <= SMALL_ALIGN_MAX_SLOTS:
        scratch = torch.empty(2 * block_e + s, dtype=torch.int32, device=dev)
        _align_small_kernel[(1,)](ids, sorted_ids, expert_ids, ntpp, scratch, s, num_experts, max_len,
                                  max_blocks, block_size, BLOCK_E=block_e, CHUNK=_SMALL_CHUNK,
                                  BLOCKS_PER_STEP=blocks_per_step, num_warps=8)
        return sorted_ids, expert_ids, ntpp
    cnt = torch.zeros(2 * block_e, dtype=torch.int32, device=dev)  # counters, then padded starts
    rank = torch.empty(s, dtype=torch.int32, device=dev)
    _align_count_kernel[(triton.cdiv(max_len, _CHUNK),)](ids, sorted_ids, cnt, rank, s, num_experts, max_len,
                                                         CHUNK=_CHUNK, num_warps=4)
    _align_starts_kernel[(1,)](cnt, cnt[block_e:], ntpp, expert_ids, num_experts, max_blocks, block_size,
                               BLOCK_E=block_e, BLOCKS_PER_STEP=blocks_per_step, num_warps=4)
    _align_scatter_kernel[(triton.cdiv(s, _CHUNK),)](ids, sorted_ids, cnt[block_e:], rank, s, num_experts,
                                                     CHUNK=_CHUNK, num_warps=4)
    return sorted_ids, expert_ids, ntpp
