"""Who is admitted next: the order of the waiting queue and the KV estimate.

* `AdmissionPolicy`: SGLang's estimate of future KV use (``new_token_ratio``).
* `order_waiting`: ``lpm`` puts the requests with the longest cached prefix first (they
  need the least new KV and compute, and they keep hot prefixes hot), falling back to
  arrival order when the queue is longer than `LPM_MAX_QUEUE` (matching every waiting
  request each step would cost more than it saves); ``fcfs`` is arrival order. Both are
  SGLang's ``schedule_policy.py`` policies of the same names and thresholds.
* `reserved_tokens`: the running requests' estimated future KV (`Scheduler._future_tokens` summed).
* `InBatchPrefixCheck`: requests that arrive together and share a prefix that is not
  cached yet compute it once. A request whose cached match is short but which shares at
  least `IN_BATCH_PREFIX_THRESHOLD` tokens with a request admitted in the same round is
  held back one step; by then the first one's prefill chunk is in the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from attnserve.mem_cache.radix_cache import RadixCache

#: above this many waiting requests ``lpm`` orders by arrival (SGLang: 128)
LPM_MAX_QUEUE = 128
#: cached-prefix length below which the in-batch check applies, and the shared length with
#: an already admitted request that holds a request back (SGLang: 32 and 32)
IN_BATCH_PREFIX_THRESHOLD = 32


@dataclass
class AdmissionPolicy:
    """SGLang's estimate of future KV use (``schedule_policy.py`` / ``global_config``):
    a running request is expected to still need ``new_token_ratio`` of its remaining
    ``max_new_tokens``. After a retraction the ratio is set to
    ``(decoded + retract_decode_steps * running) / sum(max_new_tokens)`` (at most 1)."""

    init_ratio: float = 0.7
    min_ratio: float = 0.098
    decay_steps: int = 600
    retract_decode_steps: int = 20

    @property
    def decay(self) -> float:
        return (self.init_ratio - self.min_ratio) / self.decay_steps

    @classmethod
    def for_conservativeness(cls, conservativeness: float) -> "AdmissionPolicy":
        """SGLang's ``--schedule-conservativeness c`` (its scheduler's constants): the initial
        ratio ``min(0.7 c, 1)`` and the floor ``min(0.14 * initial, 1)``, so ``c = 1`` is the
        default policy; a larger ``c`` admits fewer requests (fewer retractions), a smaller
        one more."""
        if conservativeness == 1.0:
            return cls()  # the defaults exactly (0.14 * 0.7 is 0.09799999999999999 in floats)
        init = min(0.7 * conservativeness, 1.0)
        return cls(init_ratio=init, min_ratio=min(0.14 * init, 1.0))


def order_waiting(waiting: Sequence, match_lens: Dict[int, int], policy: str) -> List:
    """The waiting requests in admission order.

    Args:
        waiting: requests in arrival order.
        match_lens: ``id(req) -> cached prefix length`` (used by ``lpm``; may be empty).
        policy: ``"lpm"`` or ``"fcfs"``.
    """
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE or not match_lens:
        return list(waiting)
    return sorted(waiting, key=lambda r: -match_lens.get(id(r), 0))  # stable: ties keep arrival order


def reserved_tokens(running: Sequence, ratio: float, page_size: int) -> float:
    """KV tokens the running requests are expected to still add: the sum over ``running`` of
    `Scheduler._future_tokens`, bit for bit (the same terms, evaluated in the same order and
    added by the same ``sum``), with the per-request method inlined. Admission computes it at
    every step while requests wait, over every running request (issue 33, item 4: ~3x fewer
    host cycles at 900 running requests than a generator of method calls).

    Args:
        running: admitted `Req` objects (a ``req_to_token`` row each, or none after a retraction).
        ratio: ``new_token_ratio`` (the share of the remaining ``max_new_tokens`` expected).
        page_size: KV page size in tokens (a partly filled page is reserved per request).

    Returns:
        tokens (float: the decode part is an estimate).
    """
    extra = page_size - 1
    return sum([(max(r.prefill_target - r.kv_len, 0) if r.req_pool_idx is not None
                 else len(r.prompt_ids) + len(r.output_ids))
                + ratio * max(r.sampling_params.max_new_tokens - (len(r.output_ids) + r.num_inflight), 0) + extra
                for r in running])


class InBatchPrefixCheck:
    """The prompts admitted in one scheduling round, as a key-only radix tree."""

    def __init__(self, page_size: int = 1):
        self._tree = RadixCache(None, page_size)

    def holds_back(self, key: Sequence[int], cached_len: int) -> bool:
        """True when ``key`` (cached for ``cached_len`` tokens) shares at least
        `IN_BATCH_PREFIX_THRESHOLD` uncached tokens with a prompt admitted this round."""
        if cached_len >= IN_BATCH_PREFIX_THRESHOLD:
            return False
        shared = int(self._tree.match_prefix(key).slots.numel())
        return shared - cached_len >= IN_BATCH_PREFIX_THRESHOLD

    def add(self, key: Sequence[int]) -> None:
        import torch

        self._tree.insert(key, torch.zeros(len(key), dtype=torch.int64))
