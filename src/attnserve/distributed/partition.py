"""Which attention heads and vocabulary rows each tensor-parallel rank holds.

Query heads are split evenly. KV heads are split evenly when there are at least as many as
ranks; with fewer, each KV head is replicated on ``size / num_kv_heads`` consecutive ranks,
so the query heads of a rank always share one KV head (Megatron-LM / SGLang's GQA
replication). The vocabulary is split in equal row blocks, padded to a multiple of the
group size (the padding rows are zeros and their logits are cut off after the gather).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRange:
    """Heads ``start .. start + count`` of ``total`` held by one rank (``replicas`` ranks
    hold the same range when heads are replicated)."""

    start: int
    count: int
    total: int
    replicas: int = 1


def q_head_range(num_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """Query heads of ``tp_rank``.

    Raises:
        ValueError: ``num_heads`` not a multiple of ``tp_size``.
    """
    if num_heads % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the {num_heads} attention heads; "
                         f"use a tp size that divides {num_heads}")
    per = num_heads // tp_size
    return HeadRange(tp_rank * per, per, num_heads)


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """KV heads of ``tp_rank`` (one replicated head when ``num_kv_heads < tp_size``).

    Raises:
        ValueError: ``num_kv_heads`` neither a multiple nor a divisor of ``tp_size``.
    """
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"--tp-size {tp_size} does not divide the {num_kv_heads} KV heads; "
                             f"use a tp size that divides {num_kv_heads} or a multiple of it")
        per = num_kv_heads // tp_size
        return HeadRange(tp_rank * per, per, num_kv_heads)
    if tp_size % num_kv_heads:
        raise ValueError(f"--tp-size {tp_size} is not a multiple of the {num_kv_heads} KV heads, so they cannot "
                         f"be replicated evenly; use a tp size that divides or is a multiple of {num_kv_heads}")
    replicas = tp_size // num_kv_heads
    return HeadRange(tp_rank // replicas, 1, num_kv_heads, replicas)


def check_tp_size(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raise ValueError when ``tp_size`` cannot split these heads (see the two functions
    above); ``num_kv_heads`` 0 skips the KV check (MLA: one latent, replicated)."""
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
    q_head_range(num_heads, tp_size, 0)
    if num_kv_heads:
        kv_head_range(num_kv_heads, tp_size, 0)


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple:
    """``(start, local_rows, valid_rows)``: rows ``start .. start + local_rows`` of the
    padded vocabulary, of which the first ``valid_rows`` are real tokens."""
    per = -(-vocab_size // tp_size)
    start = tp_rank * per
    return start, per, max(0, min(per, vocab_size - start))
