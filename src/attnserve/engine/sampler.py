"""Token sampling from logits: greedy, temperature, top-k, top-p (nucleus), min-p.

The filters follow their usual definitions (top-p: Holtzman et al., arXiv:1904.09751;
min-p: Nguyen et al., arXiv:2407.01082). Greedy rows take ``argmax``; sampled rows use the
request's own `torch.Generator` when it has a seed, so seeded requests are reproducible
regardless of the batch they run in.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from attnserve.engine.sampling_params import SamplingParams


def _filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to one row ``[V]`` (float32)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[Optional[torch.Generator]],
    default_generator: Optional[torch.Generator] = None,
) -> List[int]:
    """Pick the next token of every row.

    Args:
        logits: float ``[bs, V]``.
        params: ``bs`` sampling settings.
        generators: ``bs`` per-request generators (None: use ``default_generator``). They
            must live on ``logits.device``.

    Returns:
        ``bs`` token ids.
    """
    logits = logits.float()
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        probs = torch.softmax(_filter_logits(logits[i], p), dim=-1)
        gen = generators[i] if generators[i] is not None else default_generator
        out[i] = torch.multinomial(probs, 1, generator=gen)[0]
    return out.tolist()
