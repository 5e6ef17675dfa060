"""Token logprobs: of the sampled tokens, of the most likely alternatives, and of the prompt.

What they are: ``log_softmax`` of the model's float32 logits, i.e. the model's own
distribution, taken before the logit controls (`attnserve.engine.penalties`), before
temperature and before the top-k/top-p/min-p filters. The issue that asked for them
(35) fixes this choice. For comparison (read for facts, not copied): SGLang's sampler
reports ``log_softmax(logits / temperature)`` after its penalties and logit bias by
default, and under ``SGLANG_RETURN_ORIGINAL_LOGPROB`` the values before temperature (still
after penalties and bias); vLLM's default ``logprobs_mode`` ``raw_logprobs`` is the
distribution before any processing, as here. For greedy requests without controls all of
these coincide.

Cost: only the rows that ask pay. For ``m`` such rows of a step: one ``logsumexp`` over
``[m, V]``, one ``gather`` and, when top lists are asked, one ``topk`` (k = the largest
``top_logprobs`` among them); the ``[m, 1 + 2k]`` result goes to the host with one
non-blocking copy, read when the step's results are processed (`LaunchedLogprobs`).

Prompt logprobs (``SamplingParams.prompt_logprobs``, the completions API's ``echo``):
the logits of a prefill chunk's positions are computed only for the requests that ask
(`PromptLogprobPlan`, evaluated inside `ModelRunner.forward` in blocks of
`PROMPT_LOGIT_BLOCK` rows so a long prompt never materialises ``[T, V]``). Chunked
prefill is covered (each chunk adds its positions; a launch-time cursor per request,
``LogprobRecord.prompt_cursor``, says which are done). A cached prefix has no logits, so
such requests never take a prefix from the cache (`attnserve.engine.sampling_extras`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

#: Most alternatives per position (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20
#: Prompt positions whose logits are computed at once (bounds the ``[block, V]`` temporary).
PROMPT_LOGIT_BLOCK = 512

#: One position's result: (logprob of the token, [(token id, logprob), ...] most likely first).
Entry = Tuple[float, List[Tuple[int, float]]]


def verify_logprob_params(p) -> None:
    """Raise ValueError naming the first invalid logprob field of `SamplingParams` ``p``."""
    for name in ("logprobs", "prompt_logprobs"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(p, name)!r}")
    k = p.top_logprobs
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
    if k and not (p.logprobs or p.prompt_logprobs):
        raise ValueError("top_logprobs needs logprobs (or prompt_logprobs) to be true")


@dataclass
class LogprobRecord:
    """One request's logprobs so far (host lists, aligned with ``output_ids`` / ``prompt_ids``).

    Attributes:
        top_k: alternatives per position (``top_logprobs``).
        output: whether output logprobs were asked.
        output_token_logprobs: logprob of each output token.
        output_top_logprobs: per output token, ``[(id, logprob)]`` most likely first
            (empty lists when ``top_k`` is 0).
        prompt_token_logprobs / prompt_top_logprobs: the same for the prompt (None at
            position 0, which has no context); empty when not asked.
        prompt_cursor: launch-time cursor: prompt positions below it have their logits
            computed by a launched step (position q predicts prompt token q + 1).
        prompt_len: the prompt's length when prompt logprobs are asked, else 0.
    """

    top_k: int
    output: bool
    output_token_logprobs: List[float] = field(default_factory=list)
    output_top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)
    prompt_token_logprobs: List[Optional[float]] = field(default_factory=list)
    prompt_top_logprobs: List[Optional[List[Tuple[int, float]]]] = field(default_factory=list)
    prompt_cursor: int = 0
    prompt_len: int = 0

    @classmethod
    def for_request(cls, params, prompt_len: int) -> "LogprobRecord":
        rec = cls(top_k=params.top_logprobs, output=bool(params.logprobs))
        if params.prompt_logprobs:
            rec.prompt_len = prompt_len
            rec.prompt_token_logprobs.append(None)
            rec.prompt_top_logprobs.append(None)
        return rec

    @property
    def prompt_pending(self) -> bool:
        """Prompt positions whose logits are still to be launched."""
        return self.prompt_cursor < self.prompt_len - 1

    def add_output(self, entry: Entry) -> None:
        self.output_token_logprobs.append(entry[0])
        self.output_top_logprobs.append(entry[1])

    def add_prompt(self, entries: Sequence[Entry]) -> None:
        for lp, top in entries:
            self.prompt_token_logprobs.append(lp)
            self.prompt_top_logprobs.append(top)


def token_logprob_stats(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Logprob of ``targets`` and the top ``k`` of each row, packed for one host copy.

    Args:
        logits: float32 ``[m, V]``.
        targets: int64 ``[m]`` token of each row.
        k: alternatives per row (0: none).

    Returns:
        float32 ``[m, 1 + 2k]``: ``[:, 0]`` the targets' logprobs, ``[:, 1:1+k]`` the top
        logprobs (descending), ``[:, 1+k:]`` their token ids (exact in float32 below 2^24).
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = logits.gather(1, targets.view(-1, 1)) - lse
    if k == 0:
        return chosen
    vals, ids = logits.topk(k, dim=-1)
    return torch.cat([chosen, vals - lse, ids.to(torch.float32)], dim=1)


def unpack_row(row: Sequence[float], k_max: int, k: int) -> Entry:
    """One host row of `token_logprob_stats` (computed with ``k_max``) as an `Entry` with
    the first ``k`` alternatives."""
    return row[0], [(int(row[1 + k_max + j]), row[1 + j]) for j in range(k)]


@dataclass
class PromptLogprobPlan:
    """The prompt positions of one step whose logprobs are wanted (travels in the
    `StepMessage`, so every tensor-parallel rank computes the same logits).

    Attributes:
        token_index: int64 ``[P]`` rows of the step's flat token array.
        targets: int64 ``[P]`` the prompt token each row predicts.
        k: alternatives per row (the largest ``top_logprobs`` of the owners).
        result: device float32 ``[P, 1 + 2k]`` (`token_logprob_stats`), set by `consume`.
    """

    token_index: torch.Tensor
    targets: torch.Tensor
    k: int
    result: Optional[torch.Tensor] = None

    def consume(self, hidden: torch.Tensor, compute_logits) -> None:
        """Compute `result` from the step's hidden states ``[T, H]`` with the model's
        ``compute_logits`` (called on every rank alike: it may all-gather)."""
        idx = self.token_index.to(hidden.device)
        targets = self.targets.to(hidden.device)
        parts = []
        for s in range(0, idx.numel(), PROMPT_LOGIT_BLOCK):
            logits = compute_logits(hidden.index_select(0, idx[s:s + PROMPT_LOGIT_BLOCK]))
            parts.append(token_logprob_stats(logits, targets[s:s + PROMPT_LOGIT_BLOCK], self.k))
        self.result = torch.cat(parts) if len(parts) > 1 else parts[0]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "result": None}


def plan_prompt_logprobs(reqs: Sequence, prefix_lens: Sequence[int], extend_lens: Sequence[int]
                         ) -> Tuple[Optional[PromptLogprobPlan], List[Tuple[object, int]]]:
    """The positions of a prefill step whose logits give wanted prompt logprobs; advances
    each owner's ``prompt_cursor``.

    Position q (of the request's ``fill_ids``) predicts token q + 1; the prompt's positions
    ``0 .. len(prompt) - 2`` are wanted once each, so a retracted request that prefills
    again skips those it has.

    Returns:
        ``(plan or None, [(req, rows in the plan), ...])`` in plan order.
    """
    index: List[int] = []
    targets: List[int] = []
    owners: List[Tuple[object, int]] = []
    k = 0
    offset = 0
    for r, p, e in zip(reqs, prefix_lens, extend_lens):
        rec = r.logprobs
        if rec is not None and rec.prompt_pending:
            lo, hi = max(p, rec.prompt_cursor), min(p + e, rec.prompt_len - 1)
            if hi > lo:
                index.extend(range(offset + lo - p, offset + hi - p))
                targets.extend(r.prompt_ids[lo + 1:hi + 1])
                owners.append((r, hi - lo))
                k = max(k, rec.top_k)
                rec.prompt_cursor = hi
        offset += e
    if not index:
        return None, []
    plan = PromptLogprobPlan(torch.tensor(index, dtype=torch.int64), torch.tensor(targets, dtype=torch.int64), k)
    return plan, owners


# ---- delivery ------------------------------------------------------------------------------
def reported_len(req) -> int:
    """Output tokens whose logprobs a client sees: all, but the EOS / stop token that ended
    the request (it is not part of the text either)."""
    n = min(len(req.output_ids), len(req.logprobs.output_token_logprobs))
    reason = getattr(req.finish_reason, "value", None)
    if reason == "stop" and n == len(req.output_ids) and n and not isinstance(req.matched_stop, str):
        n -= 1
    return n


#: One streamed output token: (token id, logprob, [(id, logprob), ...]).
StreamEntry = Tuple[int, float, List[Tuple[int, float]]]


@dataclass
class StreamCursor:
    """What of a request's logprobs was already sent (server streaming)."""

    sent: int = 0
    prompt_sent: bool = False

    def take(self, req) -> Tuple[Optional[List[StreamEntry]], Optional[List[Tuple[int, Optional[float], list]]]]:
        """``(new output entries, prompt entries)`` since the last call; None for what the
        request did not ask or has nothing new of. Prompt entries (token id, logprob or
        None, alternatives or None) come once, complete."""
        rec = req.logprobs
        if rec is None:
            return None, None
        prompt = None
        if rec.prompt_len and not self.prompt_sent and len(rec.prompt_token_logprobs) >= rec.prompt_len:
            self.prompt_sent = True
            prompt = [(t, lp, top) for t, lp, top in zip(req.prompt_ids, rec.prompt_token_logprobs,
                                                          rec.prompt_top_logprobs)]
        out = None
        if rec.output:
            end = reported_len(req)
            if end > self.sent:
                ids = req.output_ids
                lps, tops = rec.output_token_logprobs, rec.output_top_logprobs
                out = [(ids[i], lps[i], tops[i]) for i in range(self.sent, end)]
                self.sent = end
        return out, prompt
