"""Token sampling for a whole batch in one call: greedy, temperature, top-k, top-p, min-p.

Per-request settings are tensors (`SamplingBatchInfo`), so a batch costs the same few
tensor operations whatever its mix of settings, with no Python loop over requests.

* Greedy rows (temperature below `SAMPLING_EPS`, or ``top_k == 1``) take ``argmax``.
* Sampled rows use the Gumbel-max trick (Gumbel 1954; e.g. Maddison et al., "A* Sampling",
  NeurIPS 2014): ``argmax(logits / T + g)`` with ``g = -log(-log u)`` is a sample of
  ``softmax(logits / T)``. The uniforms ``u`` come from a counter-based hash of (request
  seed, output position, token id), so a request's tokens depend only on its own seed and
  logits, never on the batch it runs in or on the other requests (seeded requests are
  reproducible; requests without a seed draw one from the engine's generator at arrival).
* Filters follow their usual definitions on the temperature-scaled distribution: top-k,
  top-p (nucleus; Holtzman et al., arXiv:1904.09751: keep the smallest prefix of the sorted
  tokens whose mass reaches ``top_p``), min-p (Nguyen et al., arXiv:2407.01082: drop
  tokens below ``min_p * p_max``). One sort serves every row that needs top-k or top-p.

Logits are scaled in float32 and temperatures below `SAMPLING_EPS` act as greedy, so no
accepted parameter can produce inf or NaN (a temperature of 1e-300 is simply greedy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from attnserve.engine.row_argmax import row_argmax, row_argmax_supported

_M31 = 0x7FFFFFFF


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An avalanche mix of int64 values in [0, 2^31) to [0, 2^31) (xor-shift-multiply; the
    multipliers are below 2^31 so no product leaves int64)."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M31
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _M31
    return x ^ (x >> 15)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 ``[n, vocab_size]`` uniforms in (0, 1), a pure function of (seed, position,
    token id).

    Args:
        seeds: int64 ``[n]`` (any value; only the low 31 bits are used).
        positions: int64 ``[n]`` output index of the token being sampled.
    """
    row = _mix31(_mix31(seeds & _M31) ^ (positions & _M31))
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix31((row[:, None] + vocab[None, :] * 0x9E3779B1) & _M31)
    h = _mix31(h ^ row[:, None])
    return unit_interval(h)


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1) strictly from 31-bit integers ``h``: the top 23 bits plus one half, exact in float32.
    (All 31 bits round to 2**31 for the top 128 values: u == 1, a Gumbel of +inf, and
    ``-inf + inf`` = NaN, which argmax picks, for a token masked to -inf.)"""
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**23)


@dataclass
class SamplingBatchInfo:
    """Sampling settings of the rows of one batch, as tensors on the logits' device.

    Attributes:
        temperatures / top_ps / min_ps: float32 ``[n]`` (greedy rows hold temperature 1).
        top_ks: int64 ``[n]`` (0: no limit).
        seeds / positions: int64 ``[n]`` inputs of `counter_uniform`.
        greedy: bool ``[n]``.
        all_greedy / need_sort / need_min_p: host flags that skip unused work.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    need_sort: bool
    need_min_p: bool

    @classmethod
    def from_params(cls, params: Sequence, seeds: Sequence[int], positions: Sequence[int],
                    device) -> "SamplingBatchInfo":
        """Build from ``n`` `SamplingParams`, the rows' seeds and output positions.

        One host->device copy for the floats and one for the integers.
        """
        return cls.from_host(*host_sampling_tensors(params, seeds, positions), device)

    @classmethod
    def from_host(cls, floats: torch.Tensor, ints: torch.Tensor, flags: Tuple[bool, bool, bool],
                  device) -> "SamplingBatchInfo":
        """Build from `host_sampling_tensors`' output (e.g. as another tensor-parallel rank
        received it); one host->device copy each for ``floats`` and ``ints``."""
        floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
        all_greedy, need_sort, need_min_p = flags
        return cls(
            temperatures=floats[0], top_ps=floats[1], min_ps=floats[2], top_ks=ints[0], seeds=ints[1],
            positions=ints[2], greedy=ints[3].bool(), all_greedy=all_greedy, need_sort=need_sort,
            need_min_p=need_min_p,
        )


def host_sampling_tensors(params: Sequence, seeds: Sequence[int], positions: Sequence[int]
                          ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[bool, bool, bool]]:
    """The host half of `SamplingBatchInfo.from_params`.

    Args:
        params: ``n`` `SamplingParams`; seeds / positions: ``n`` ints each.

    Returns:
        ``(floats, ints, flags)``: float32 ``[3, n]`` (temperature, top_p, min_p), int64
        ``[4, n]`` (top_k, seed, position, greedy) on the CPU, and the host flags
        ``(all_greedy, need_sort, need_min_p)``.
    """
    greedy = [p.is_greedy for p in params]
    temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
    floats = torch.tensor([temps, [float(p.top_p) for p in params], [float(p.min_p) for p in params]],
                          dtype=torch.float32)
    ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    ints = torch.tensor([ks, list(seeds), list(positions), [int(g) for g in greedy]], dtype=torch.int64)
    flags = (all(greedy),
             any(not g and (p.top_p < 1.0 or p.top_k > 0) for p, g in zip(params, greedy)),
             any(not g and p.min_p > 0.0 for p, g in zip(params, greedy)))
    return floats, ints, flags


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]`` index of each row's largest value of ``x`` ``[n, V]`` (the first one on
    ties, as ``torch.argmax``). On the CPU through ``max(dim=-1).indices``: PyTorch's CPU
    ``argmax`` over a 49,152-wide row is ~7x slower (4.2 vs 0.57 ms for 16 rows on 2 cores,
    benchmarks/NOTES.md, session 11). On CUDA through the two-pass `row_argmax` (PyTorch's
    one-block-per-row reduction takes 28 µs for one Llama-3 row on an H100)."""
    if x.device.type == "cpu":
        return x.max(dim=-1).indices
    if row_argmax_supported(x):
        return row_argmax(x)
    return torch.argmax(x, dim=-1)


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Next token of every row.

    Args:
        logits: ``[n, V]`` (any float dtype; computed in float32).
        info: the rows' settings (`SamplingBatchInfo`), on ``logits.device``.

    Returns:
        int64 ``[n]`` token ids on ``logits.device`` (no host synchronisation).
    """
    logits = logits.float()
    greedy_ids = argmax_last(logits)
    if info.all_greedy:
        return greedy_ids
    n, vocab = logits.shape
    scaled = logits / info.temperatures[:, None]
    if info.need_min_p:
        probs = torch.softmax(scaled, dim=-1)
        keep = probs >= info.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(~keep, float("-inf"))
    if info.need_sort:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        drop = (info.top_ks[:, None] > 0) & (rank >= info.top_ks[:, None])
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (torch.cumsum(probs, dim=-1) - probs) >= info.top_ps[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter_(1, order, sorted_logits)
    u = counter_uniform(info.seeds, info.positions, vocab)
    gumbel = -torch.log(-torch.log(u))
    sampled_ids = argmax_last(scaled + gumbel)
    return torch.where(info.greedy, greedy_ids, sampled_ids)
