"""`MaskJob` and `MaskWorker`: one batch's grammar work on the host, on a worker thread.

Under overlap scheduling the masks of step N+1 need the constrained rows' tokens of step N
accepted first (`attnserve.engine.step_sampling`). Both are xgrammar C++ work that releases
the GIL (measured on this project's 2-core CPU: a Python thread kept 75 % of its speed
during a 0.5 s ``batch_accept_token`` call): accepting a token costs tens to a hundred
microseconds a row (64 rows of `benchmarks/grammar_decode.py`'s schema: 7 ms a step here,
more than filling their masks, 1.2 ms), so a job does both off the scheduler thread:

1. **accept**: the pending step's tokens of its constrained rows, with
   ``BatchGrammarMatcher.batch_accept_token`` on `MaskWorker.accept_threads` threads
   (chunks of rows); each outcome (`ACCEPTED`, `TERMINATED`, `REJECTED`) is kept for
   `GrammarManager.accept`, which the scheduler calls when it appends the token (it waits
   for this phase, ``MaskJob.accepted``, if it gets there first);
2. **fill**: the masks of the batch's constrained rows whose matcher has not terminated,
   into the host buffer reserved on the scheduler thread (`TokenBitmask.fill`, xgrammar's
   own C++ threads).

While a job runs, the scheduler thread touches none of its matchers (the rows it accepts
are all in the job; the rows it masks are only read back after `MaskJob.result`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

ACCEPTED, TERMINATED, REJECTED = "accepted", "terminated", "rejected"

#: fewest rows worth splitting ``batch_accept_token`` over several threads
MIN_ROWS_PER_SPLIT = 8


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
    """The mask worker thread (one job at a time) and the accept threads.

    Args:
        bitmask: the `TokenBitmask` the jobs fill.
        accept_threads: threads ``batch_accept_token`` is split over (default: a quarter of
            the host's cores, 1 to 4; xgrammar's fill takes half of them).
    """

    def __init__(self, bitmask, accept_threads: Optional[int] = None):
        from attnserve.engine.constrained.spec import import_xgrammar

        self._batch_accept = import_xgrammar().BatchGrammarMatcher.batch_accept_token
        self.bitmask = bitmask
        self.accept_threads = accept_threads or max(1, min(4, (os.cpu_count() or 1) // 4))
        self._thread: Optional[ThreadPoolExecutor] = None
        self._accept_pool: Optional[ThreadPoolExecutor] = None

    def submit(self, job: MaskJob) -> None:
        """Run ``job`` on the worker thread (``job.future``)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="attnserve-grammar-mask")
        job.future = self._thread.submit(self.run, job)

    def run(self, job: MaskJob) -> None:
        """Accept phase, then fill (see the module doc); on the worker or inline."""
        try:
            if job.ahead_reqs:
                matchers = [r.grammar.matcher for r in job.ahead_reqs]
                ok = self._accept(matchers, job.ahead_tokens)
                for r, m, good in zip(job.ahead_reqs, matchers, ok):
                    job.outcomes[id(r)] = REJECTED if not good else TERMINATED if m.is_terminated() else ACCEPTED
        except BaseException as e:
            job.error = e
            raise
        finally:
            job.accepted.set()
        keep = [i for i, r in enumerate(job.reqs) if not r.grammar.matcher.is_terminated()]
        job.reqs = [job.reqs[i] for i in keep]
        job.rows = [job.rows[i] for i in keep]
        job.filled.rows = job.rows
        if keep:
            self.bitmask.fill(job.filled, [r.grammar.matcher for r in job.reqs])

    def _accept(self, matchers: List[Any], tokens: List[int]) -> List[bool]:
        n, t = len(matchers), self.accept_threads
        if t <= 1 or n < 2 * MIN_ROWS_PER_SPLIT:
            return list(self._batch_accept(matchers, tokens))
        if self._accept_pool is None:
            self._accept_pool = ThreadPoolExecutor(t, thread_name_prefix="attnserve-grammar-accept")
        step = -(-n // min(t, n // MIN_ROWS_PER_SPLIT))
        futures = [self._accept_pool.submit(self._batch_accept, matchers[i:i + step], tokens[i:i + step])
                   for i in range(0, n, step)]
        return [bool(x) for f in futures for x in f.result()]

    def shutdown(self) -> None:
        """Wait for a running job (it writes into the mask buffers) and stop the threads."""
        for pool in (self._thread, self._accept_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._thread = self._accept_pool = None
