"""MLA's expanded (per-head) path over a cached prefix: when it pays, and the prefix rows.

An MLA extend step whose requests have cached prefixes used to run entirely in the absorbed
form (`mla_paths`): queries ``[q_nope W_UK | q_pe]`` against the latent cache, head dims
``kv_lora_rank + rope`` / ``kv_lora_rank`` (576 / 512 for DeepSeek-V2/V3). One request left
over from the previous prefill chunk (a cached prefix of a few hundred tokens) then moved
every other prompt of the chunk to that form too, at 3.4x the attention FLOPs of the expanded
form (``nope + rope`` / ``v_head_dim``, 192 / 128) and with a slower kernel: on an H100 a
64-prompt prefill of DeepSeek-V2-Lite (36,546 tokens in five chunks) spent 144 ms of 531 ms in
attention; 39 ms in this form (`benchmarks/NOTES.md`, 2026-11-27).

The expanded form extends to cached prefixes by up-projecting the prefix's latent rows to
per-head K / V once per layer (``kv_b_proj``, as SGLang's FlashAttention-3 MLA backend does for
prefixes in its "MHA chunked KV" path; here in one pass with the new tokens, not in chunks
merged afterwards). That costs ``2 * kv_lora_rank * (nope + v_head_dim)`` FLOPs a prefix token
and head and saves ``2 * ((r + rope + r) - (nope + rope + v))`` a (query, key) pair and head,
so it pays when the step's pairs outnumber its prefix tokens by a large factor: chunked
prefill of many prompts and radix-cache hits followed by long prompts do; a short extend over a
long prefix (a few tokens after a cache hit, speculative verification) does not and stays
absorbed.

The decision (`expanded_prefix_worthwhile`) uses host lengths only; `plan_expanded_prefix`
builds, once per step (cached on the `ForwardBatch`), the prefix's latent-pool slots in
request order and the CSR the extend kernel reads the expanded rows through.
``ATTNSERVE_MLA_EXPANDED_PREFIX``: ``0`` never, ``1`` whenever allowed (A/B runs and tests),
unset the cost rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from attnserve.env_options import OFF_VALUES

__all__ = [
    "EXPANDED_PREFIX_ENV",
    "EXPANSION_WEIGHT",
    "MAX_EXPANDED_PREFIX_BYTES",
    "ExpandedPrefix",
    "ExpandedPrefixPlan",
    "expanded_prefix_worthwhile",
    "gather_prefix_latent",
    "plan_expanded_prefix",
]

EXPANDED_PREFIX_ENV = "ATTNSERVE_MLA_EXPANDED_PREFIX"
#: the expansion's FLOPs count this many times in the rule: it is a separate GEMM whose
#: output (``nope + rope + v`` values a head and token) is written and read back
EXPANSION_WEIGHT = 2.0
#: largest expanded prefix (K and the up-projection's output, bytes) a step may allocate per
#: layer; beyond it the step stays absorbed (the latent form reads the pool in place)
MAX_EXPANDED_PREFIX_BYTES = 512 << 20


@dataclass(frozen=True)
class ExpandedPrefixPlan:
    """Where an extend step's cached prefixes are, for the expanded path.

    Attributes:
        slots: int64 ``[P]`` latent-pool slots of every request's prefix, request by
            request, positions ``0 .. prefix_len - 1`` in order.
        kv_indptr: int32 ``[bs + 1]`` offsets of each request's prefix rows in ``slots``
            (and in the expanded K / V).
        kv_indices: int32 ``[P]`` ``arange(P)``: the expanded buffers are read in order.
        num_tokens: ``P`` (host int).
    """

    slots: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    num_tokens: int


@dataclass(frozen=True)
class ExpandedPrefix:
    """Per-head K / V of the cached prefixes (the ``prefix_kv`` argument of an MLA backend's
    expanded layer): ``k`` ``[P, H, nope + rope]``, ``v`` ``[P, H, v_head_dim]`` (last dim
    contiguous), rows in ``plan.slots`` order."""

    k: torch.Tensor
    v: torch.Tensor
    plan: ExpandedPrefixPlan


def expanded_prefix_worthwhile(prefix_lens: Sequence[int], extend_lens: Sequence[int], num_heads: int,
                               kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                               itemsize: int = 2, setting: Optional[str] = None) -> bool:
    """Whether an extend step with cached prefixes runs cheaper in the expanded form.

    With ``S = sum_i E_i * (P_i + E_i / 2)`` (query, key) pairs, ``P = sum_i P_i`` prefix tokens:
    expanded iff ``S * 2 * ((2 r + rope) - (nope + rope + v)) >= EXPANSION_WEIGHT * P * 2 r
    (nope + v)`` (FLOPs a head; ``r`` = ``kv_lora_rank``) and the expanded prefix fits
    `MAX_EXPANDED_PREFIX_BYTES`. ``setting`` (default: ``ATTNSERVE_MLA_EXPANDED_PREFIX``):
    an off value (`env_options.OFF_VALUES`: ``0`` / ``off`` / ...) never, any other
    non-empty value (``1``) always (size cap still applies), empty the rule.

    Args:
        prefix_lens / extend_lens: host ints per request (cached / new tokens).
        num_heads: this rank's query heads; itemsize: bytes of the model dtype.
    """
    if setting is None:
        setting = os.environ.get(EXPANDED_PREFIX_ENV, "")
    setting = setting.strip().lower()
    if setting in OFF_VALUES:
        return False
    p_total = int(sum(prefix_lens))
    if p_total == 0:
        return False
    k_dim = qk_nope_head_dim + qk_rope_head_dim
    expanded_bytes = p_total * num_heads * (k_dim + qk_nope_head_dim + v_head_dim) * itemsize
    if expanded_bytes > MAX_EXPANDED_PREFIX_BYTES:
        return False
    if setting:
        return True
    pairs = sum(int(e) * (int(p) + int(e) / 2) for p, e in zip(prefix_lens, extend_lens))
    saved = 2 * ((2 * kv_lora_rank + qk_rope_head_dim) - (k_dim + v_head_dim))
    cost = EXPANSION_WEIGHT * 2 * kv_lora_rank * (qk_nope_head_dim + v_head_dim)
    return pairs * saved >= cost * p_total


def plan_expanded_prefix(prefix_lens: List[int], req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                         prefix_lens_dev: Optional[torch.Tensor] = None) -> ExpandedPrefixPlan:
    """The prefix slots of an extend step, gathered on the device.

    Args:
        prefix_lens: host ints ``[bs]`` (some > 0).
        req_pool_indices: int ``[bs]`` rows of ``req_to_token`` (device).
        req_to_token: int ``[rows, max_context]`` token position -> pool slot.
        prefix_lens_dev: the same lengths already on the device (the step's
            ``extend_prefix_lens``). Pass it on a GPU: built here from the host list instead,
            the copy waits for the device queue to drain, and the host then enqueues the rest
            of the step behind an idle GPU (measured: 113 ms of idle GPU in a 0.56 s
            DeepSeek-V2-Lite prefill, H100). Nothing here reads the device.
    """
    dev = req_to_token.device
    bs = len(prefix_lens)
    if prefix_lens_dev is None:
        lens = torch.tensor(prefix_lens, dtype=torch.int64).to(dev)
    else:
        lens = prefix_lens_dev[:bs].to(device=dev, dtype=torch.int64)
    p_total = int(sum(prefix_lens))
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
    owner = torch.repeat_interleave(torch.arange(bs, device=dev), lens, output_size=p_total)
    pos = torch.arange(p_total, device=dev) - kv_indptr[:-1].to(torch.int64)[owner]
    rows = req_pool_indices.to(device=dev, dtype=torch.int64)[owner]
    slots = req_to_token[rows, pos].to(torch.int64)
    kv_indices = torch.arange(p_total, dtype=torch.int32, device=dev)
    return ExpandedPrefixPlan(slots, kv_indptr, kv_indices, p_total)


def gather_prefix_latent(latent_buffer: torch.Tensor, plan: ExpandedPrefixPlan, scale: float,
                         dtype: torch.dtype) -> torch.Tensor:
    """The cached latent rows ``[P, kv_lora_rank + rope]`` in ``dtype``: ``latent_buffer``
    ``[slots, 1, kv_lora_rank + rope]`` read at ``plan.slots``, an FP8 pool dequantised with
    its per-tensor ``scale``."""
    from attnserve.mem_cache.kv_quant import dequantize_kv

    rows = latent_buffer.index_select(0, plan.slots).squeeze(1)
    return dequantize_kv(rows, scale, dtype)
