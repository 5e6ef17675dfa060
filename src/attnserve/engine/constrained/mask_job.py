"""`MaskJob` and `MaskWorker`: one batch's grammar work on the host, on a worker thread;
`TokenTable`: how the worker accepts tokens.

Under overlap scheduling the masks of step N+1 need the constrained rows' tokens of step N
accepted first (`attnserve.engine.step_sampling`). Both are xgrammar C++ work that releases
the GIL, so a job does both off the scheduler thread:

1. **accept**: the pending step's tokens of its constrained rows; each outcome
   (`ACCEPTED`, `TERMINATED`, `REJECTED`) is kept for `GrammarManager.accept`, which the
   scheduler calls when it appends the token (it waits for this phase, ``MaskJob.accepted``,
   if it gets there first);
2. **fill**: the masks of the batch's constrained rows whose matcher has not terminated,
   into the host buffer reserved on the scheduler thread (`TokenBitmask.fill`, xgrammar's
   own C++ threads).

**Accepting without ``accept_token``.** xgrammar 0.2.8's ``GrammarMatcher.accept_token``
looks the token up in the vocabulary's special-token list with a linear search before it
matches the token's bytes, and ``TokenizerInfo`` lists every id of a padded LM head past
the tokenizer as special: with SmolLM2's 49,152 tokens under Qwen3-0.6B's 151,936 logits
(`benchmarks/grammar_decode.py`) that is 102,784 ids, ~40 us a token (~1 us without
padding), 2.5-4 ms for 64 rows on this project's 2-core CPU, more than the fill. A
`TokenTable` sorts each id once (ordinary, stop, special), and the job accepts the
ordinary tokens' bytes with one ``batch_accept_string`` call, which is exactly what
``accept_token`` does for an ordinary token after its two look-ups (same parser steps,
same rollback history); a stop token goes through ``accept_token`` (once per request),
a special one is rejected as ``accept_token`` would. 64 rows: ~0.1-0.4 ms here.

While a job runs, the scheduler thread touches none of its matchers (the rows it accepts
are all in the job; the rows it masks are only read back after `MaskJob.result`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

ACCEPTED, TERMINATED, REJECTED = "accepted", "terminated", "rejected"
#: `TokenTable.kinds` values
ORDINARY, STOP, SPECIAL = 0, 1, 2


@dataclass
class TokenTable:
    """What accepting a token id needs, per id of the grammar's vocabulary (see the module
    doc).

    Attributes:
        texts: the decoded bytes of each id (xgrammar's ``TokenizerInfo.decoded_vocab``).
        kinds: one byte per id: `ORDINARY`, `STOP` (the grammar's stop tokens) or `SPECIAL`
            (special tokens and padded ids: never accepted).
    """

    texts: List[bytes]
    kinds: bytearray

    @classmethod
    def from_tokenizer_info(cls, info) -> "TokenTable":
        """From an xgrammar ``TokenizerInfo`` (~0.4 s for 151,936 ids)."""
        texts = list(info.decoded_vocab)
        kinds = bytearray(len(texts))
        for t in info.special_token_ids:
            kinds[t] = SPECIAL
        for t in info.stop_token_ids:
            kinds[t] = STOP
        return cls(texts, kinds)

    def accept(self, batch_accept_string, matchers: List[Any], tokens: List[int]) -> List[str]:
        """Advance ``matchers[i]`` by ``tokens[i]``; the outcome of each (`ACCEPTED`,
        `TERMINATED` after a stop token, `REJECTED`: the matcher is unchanged), as xgrammar's
        ``accept_token`` would give them. ``batch_accept_string``: xgrammar's
        ``BatchGrammarMatcher.batch_accept_string``."""
        out = [REJECTED] * len(tokens)
        rows, texts = [], []
        kinds, n = self.kinds, len(self.kinds)
        for i, t in enumerate(tokens):
            kind = kinds[t] if 0 <= t < n else SPECIAL
            if kind == ORDINARY:
                rows.append(i)
                texts.append(self.texts[t])
            elif kind == STOP:
                out[i] = self.accept_one(matchers[i], t)
        if rows:
            ok = batch_accept_string([matchers[i] for i in rows], texts)
            for i, good in zip(rows, ok):
                if good:
                    out[i] = ACCEPTED
        return out

    def accept_one(self, matcher, token: int) -> str:
        """`accept` of one row (the scheduler thread's path without overlap)."""
        kind = self.kinds[token] if 0 <= token < len(self.kinds) else SPECIAL
        if kind == ORDINARY:
            return ACCEPTED if matcher.accept_string(self.texts[token]) else REJECTED
        if kind == STOP and matcher.accept_token(token):
            return TERMINATED if matcher.is_terminated() else ACCEPTED
        return REJECTED


@dataclass
class MaskWorkerStats:
    """``jobs``: jobs run; ``accepted_rows``: tokens accepted by them; ``accept_seconds`` /
    ``fill_seconds``: the worker's wall time accepting and filling (xgrammar; the fill's
    also counted in `BitmaskStats`); ``queue_seconds``: from a job's submission to its
    start on the worker (thread wake-up and the GIL)."""

    jobs: int = 0
    accepted_rows: int = 0
    accept_seconds: float = 0.0
    fill_seconds: float = 0.0
    queue_seconds: float = 0.0


@dataclass
class MaskJob:
    """The grammar work of one batch (`GrammarManager.start_masks`).

    Attributes:
        reqs / rows: the batch's constrained requests and their row indices (ascending);
            after the job, only those whose matcher had not terminated (the masked rows).
        filled: the host masks (`attnserve.engine.constrained.bitmask.FilledMask`), its
            ``rows`` set by the fill.
        ahead_reqs / ahead_tokens: the pending step's constrained requests and their
            tokens, accepted first.
        outcomes: ``id(req) -> outcome`` of those tokens, once ``accepted`` is set.
        accepted: set when the accept phase is over (``error`` set if it failed).
        future: the job on the worker thread; None when it ran inline or was collected.
    """

    reqs: List[Any]
    rows: List[int]
    filled: Any
    ahead_reqs: List[Any] = field(default_factory=list)
    ahead_tokens: List[int] = field(default_factory=list)
    outcomes: Dict[int, str] = field(default_factory=dict)
    accepted: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    future: Optional[Future] = None

    def outcome(self, req) -> str:
        """``req``'s accept outcome, waiting for the accept phase; re-raises its error."""
        if not self.accepted.is_set():  # the flag alone: no lock once the phase is over
            self.accepted.wait()
        if self.error is not None:
            raise RuntimeError(f"accepting the grammar's tokens failed: {self.error}") from self.error
        return self.outcomes[id(req)]

    def result(self) -> None:
        """Wait for the whole job (re-raising its error); scheduler thread."""
        if self.future is not None:
            future, self.future = self.future, None
            future.result()


class MaskWorker:
    """The mask worker thread (one job at a time).

    Args:
        bitmask: the `TokenBitmask` the jobs fill.
        tokens: the vocabulary's `TokenTable` (`GrammarCompileCache.token_table`); None:
            accept with xgrammar's ``batch_accept_token`` (slow with a padded vocabulary).
    """

    def __init__(self, bitmask, tokens: Optional[TokenTable] = None):
        from attnserve.engine.constrained.spec import import_xgrammar

        batch = import_xgrammar().BatchGrammarMatcher
        self._batch_accept_token = batch.batch_accept_token
        self._batch_accept_string = batch.batch_accept_string
        self.bitmask = bitmask
        self.tokens = tokens
        self.stats = MaskWorkerStats()
        self._thread: Optional[ThreadPoolExecutor] = None

    def submit(self, job: MaskJob) -> None:
        """Run ``job`` on the worker thread (``job.future``)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="attnserve-grammar-mask")
        job.future = self._thread.submit(self.run, job, time.perf_counter())

    def run(self, job: MaskJob, submitted: Optional[float] = None) -> None:
        """Accept phase, then fill (see the module doc); on the worker or inline."""
        st = self.stats
        t0 = time.perf_counter()
        if submitted is not None:
            st.queue_seconds += t0 - submitted
        st.jobs += 1
        try:
            if job.ahead_reqs:
                outcomes = self._accept([r.grammar.matcher for r in job.ahead_reqs], job.ahead_tokens)
                job.outcomes = {id(r): o for r, o in zip(job.ahead_reqs, outcomes)}
                st.accepted_rows += len(outcomes)
        except BaseException as e:
            job.error = e
            raise
        finally:
            job.accepted.set()
        t1 = time.perf_counter()
        st.accept_seconds += t1 - t0
        done = job.outcomes
        keep = [i for i, r in enumerate(job.reqs)
                if done.get(id(r), TERMINATED) != TERMINATED  # accepted by this job (or rejected)
                or (id(r) not in done and not r.grammar.matcher.is_terminated())]
        if len(keep) < len(job.reqs):
            job.reqs = [job.reqs[i] for i in keep]
            job.rows = [job.rows[i] for i in keep]
        job.filled.rows = job.rows
        if keep:
            self.bitmask.fill(job.filled, [r.grammar.matcher for r in job.reqs])
        st.fill_seconds += time.perf_counter() - t1

    def _accept(self, matchers: List[Any], tokens: List[int]) -> List[str]:
        if self.tokens is not None:
            return self.tokens.accept(self._batch_accept_string, matchers, tokens)
        ok = self._batch_accept_token(matchers, tokens)
        return [REJECTED if not good else TERMINATED if m.is_terminated() else ACCEPTED
                for m, good in zip(matchers, ok)]

    def shutdown(self) -> None:
        """Wait for a running job (it writes into the mask buffers) and stop the thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self._thread = None
