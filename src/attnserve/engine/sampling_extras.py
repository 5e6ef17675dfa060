"""`SamplingExtras`: the scheduler's one entry point to logit controls
(`attnserve.engine.penalties`) and logprobs (`attnserve.engine.logprobs`).

While no running or waiting request asks for either, a step costs four calls that each
return after a truthiness test of a set or None (`plan_prompt`, `before_sampling`,
`after_sampling`, `deliver`); the sampling itself (`sampler.sample`) runs as before. A
request that asks for nothing never holds device state, whatever its batch. Otherwise,
around the step's sampling on the device:

1. `before_sampling`: the controlled rows get the controls (out of place when some rows
   also want logprobs, whose values come from the untouched logits);
2. the scheduler samples from the processed logits;
3. `after_sampling`: the sampled ids are counted for the penalties (on the device, in
   stream order: the next step, launched before the host sees these ids under overlap
   scheduling, sees the counts), the logprob rows and the step's prompt-logprob rows
   (`PromptLogprobPlan`) go to pinned host memory with one non-blocking copy each;
4. `deliver`, when the scheduler processes the step: the values reach the requests'
   `LogprobRecord`.

Not supported with speculative decoding (refused at admission with a ValueError).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Set, Tuple

import torch

from attnserve.engine.logprobs import (
    LogprobRecord,
    PromptLogprobPlan,
    plan_prompt_logprobs,
    token_logprob_stats,
    unpack_row,
)
from attnserve.engine.penalties import NO_SLOT, ControlStep, LogitControls, check_logit_bias_vocab


@dataclass
class _PendingSampling:
    """What `before_sampling` leaves for `after_sampling`."""

    raw_logits: torch.Tensor
    control: Optional[ControlStep]
    logprob_rows: List[int]
    k: int
    num_rows: int


@dataclass
class LaunchedLogprobs:
    """A launched step's logprob results, on the host once ``event`` completed.

    Attributes:
        rows / ks: the sampling rows that asked and their ``top_logprobs``.
        k: the alternatives computed per row.
        out_host: float32 ``[len(rows), 1 + 2k]`` or None.
        prompt_owners / prompt_k / prompt_host: the step's prompt-logprob rows, in order.
    """

    rows: List[int]
    ks: List[int]
    k: int
    out_host: Optional[torch.Tensor]
    prompt_owners: List[Tuple[object, int]]
    prompt_k: int
    prompt_host: Optional[torch.Tensor]
    event: Optional["torch.cuda.Event"] = None


def _to_host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class SamplingExtras:
    """Logit controls and logprobs of one scheduler.

    Args:
        device: the logits' device.
        eos_token_ids: the engine's EOS ids (masked by ``min_tokens``).
        vocab_size: the logits' width.
        speculative: speculative decoding is on (requests that ask for extras are refused).
    """

    def __init__(self, device, eos_token_ids: Sequence[int], vocab_size: int, speculative: bool = False):
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.speculative = speculative
        self.controls = LogitControls(self.device, eos_token_ids, vocab_size)
        self._control_users: Set[int] = set()
        self._logprob_users: Set[int] = set()
        self._prompt_users: Set[int] = set()

    @classmethod
    def of(cls, scheduler) -> "SamplingExtras":
        """The extras of a `Scheduler` (its device, EOS ids, vocabulary, speculative mode)."""
        return cls(scheduler.device, scheduler.eos_token_ids, scheduler.runner.model_config.vocab_size,
                   scheduler.spec is not None)

    # ---- requests ------------------------------------------------------------------------
    def check(self, params) -> None:
        """Raise ValueError if this engine cannot serve ``params``' extras (a ``logit_bias``
        key outside the vocabulary; any extra under speculative decoding)."""
        if not (params.has_logit_controls or params.wants_logprobs):
            return
        if self.speculative:
            raise ValueError("logprobs, penalties, logit_bias and min_tokens are not supported with speculative "
                             "decoding; start the engine without --speculative-algorithm to use them")
        check_logit_bias_vocab(params, self.vocab_size)

    def register(self, req) -> None:
        """`check` ``req``'s parameters (ValueError) and set up its state at arrival."""
        p = req.sampling_params
        self.check(p)
        if p.has_logit_controls:
            req.control_slot = NO_SLOT
            self._control_users.add(id(req))
        if p.wants_logprobs:
            req.logprobs = LogprobRecord.for_request(p, len(req.prompt_ids))
            if p.logprobs:
                self._logprob_users.add(id(req))
            if req.logprobs.prompt_pending:
                self._prompt_users.add(id(req))

    def forget(self, req) -> None:
        """``req`` finished or was aborted: its slot goes back (idempotent; its
        `LogprobRecord` stays for the output)."""
        key = id(req)
        if key in self._control_users:
            self._control_users.discard(key)
            self.controls.release(req)
            req.control_slot = None
        self._logprob_users.discard(key)
        self._prompt_users.discard(key)

    def prefix_match(self, req, match, tree_cache):
        """``match`` (a `MatchResult`), or the empty match when ``req`` still needs the
        logits of prompt positions, which a cached prefix lacks (the prompt is computed)."""
        if self._prompt_users and req.logprobs is not None and req.logprobs.prompt_pending:
            return tree_cache.match_prefix([])
        return match

    def release(self) -> None:
        self.controls.release_all()
        self._control_users.clear()
        self._logprob_users.clear()
        self._prompt_users.clear()

    # ---- one step ------------------------------------------------------------------------
    def plan_prompt(self, mode, reqs, prefix_lens, extend_lens) -> Tuple[Optional[PromptLogprobPlan], list]:
        """The prompt-logprob rows of a step of `ForwardMode` ``mode`` (see
        `plan_prompt_logprobs`); ``(None, [])`` at once for a decode step or when no request
        wants prompt logprobs."""
        if not self._prompt_users or mode.is_decode():
            return None, []
        plan, owners = plan_prompt_logprobs(reqs, prefix_lens, extend_lens)
        for r, _ in owners:
            if not r.logprobs.prompt_pending:
                self._prompt_users.discard(id(r))
        return plan, owners

    def before_sampling(self, reqs: Sequence, logits: torch.Tensor, positions: Optional[Sequence[int]] = None
                        ) -> Tuple[torch.Tensor, Optional[_PendingSampling]]:
        """Apply the controls of ``reqs`` (the sampling rows, in order) to ``logits``
        (float32 ``[n, V]``); returns the logits to sample from and the state for
        `after_sampling` (None: nothing to do). ``positions``: see `LogitControls.prepare`."""
        if not self._control_users and not self._logprob_users:
            return logits, None
        control = self.controls.prepare(reqs, positions) if self._control_users else None
        rows: List[int] = []
        k = 0
        if self._logprob_users:
            for i, r in enumerate(reqs):
                rec = r.logprobs
                if rec is not None and rec.output:
                    rows.append(i)
                    k = max(k, rec.top_k)
        if control is None and not rows:
            return logits, None
        raw = logits
        if control is not None:
            logits = self.controls.apply(logits, control, inplace=not rows)
        return logits, _PendingSampling(raw, control, rows, k, len(reqs))

    def after_sampling(self, pending: Optional[_PendingSampling], next_ids: Optional[torch.Tensor],
                       plan: Optional[PromptLogprobPlan], owners: list,
                       reqs: Sequence = ()) -> Optional[LaunchedLogprobs]:
        """Count the sampled ids and start the logprob copies (see the module doc);
        ``reqs``: the sampling rows. None when the step has no logprobs."""
        if pending is None and plan is None:
            return None
        out_dev = None
        rows: List[int] = []
        ks: List[int] = []
        k = 0
        if pending is not None:
            if pending.control is not None:
                self.controls.record(next_ids, pending.control)
            rows, k = pending.logprob_rows, pending.k
            if rows:
                raw, ids = pending.raw_logits, next_ids
                if len(rows) != pending.num_rows:
                    idx = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
                    raw, ids = raw.index_select(0, idx), ids.index_select(0, idx)
                out_dev = token_logprob_stats(raw, ids, k)
                ks = [reqs[i].logprobs.top_k for i in rows]
        prompt_dev = plan.result if plan is not None else None
        if out_dev is None and prompt_dev is None:
            return None
        launched = LaunchedLogprobs(rows, ks, k, _to_host(out_dev), owners, plan.k if plan is not None else 0,
                                    _to_host(prompt_dev))
        if self.device.type == "cuda":
            launched.event = torch.cuda.Event()
            launched.event.record()
        return launched

    def deliver(self, launched: Optional[LaunchedLogprobs], reqs: Sequence) -> float:
        """Wait for ``launched``'s copies (nothing to do when None) and add the logprobs to
        their requests: the prompt rows', and the output entry of each sampling row (``reqs``,
        in order) whose request is not finished, i.e. will get this step's token.

        Returns:
            seconds spent waiting for the device.
        """
        if launched is None:
            return 0.0
        t = time.perf_counter()
        if launched.event is not None:
            launched.event.synchronize()
        waited = time.perf_counter() - t
        if launched.prompt_host is not None:
            vals = launched.prompt_host.tolist()
            start = 0
            for r, count in launched.prompt_owners:
                k = r.logprobs.top_k
                r.logprobs.add_prompt([unpack_row(v, launched.prompt_k, k) for v in vals[start:start + count]])
                start += count
        if launched.out_host is not None:
            for i, k, v in zip(launched.rows, launched.ks, launched.out_host.tolist()):
                r = reqs[i]
                if not r.finished:
                    r.logprobs.add_output(unpack_row(v, launched.k, k))
        return waited
