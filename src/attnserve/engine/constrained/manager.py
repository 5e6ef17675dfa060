"""`GrammarManager`: the scheduler's one entry point to constrained decoding.

The scheduler calls it at these points (see `attnserve.engine.constrained` for the design):

============================  ===================================================================
``check(params, parse)``      before a request is queued: ValueError for a grammar this engine
                              cannot serve (speculative decoding, no tokenizer, no xgrammar,
                              and with ``parse`` a grammar that does not parse)
``enqueue(req, waiting)``     a new request: queued at once if it has no grammar or a cached
                              one, else held here while its grammar compiles
``poll(waiting)``             each step while grammars compile: queue the requests whose
                              grammar compiled (with their matcher), return those whose grammar
                              failed (finished, to be answered with a 400)
``wait(timeout)``             nothing can run: block briefly on the compiles instead of spinning
``start_masks(reqs, bg, ..)`` accept the pending step's tokens (overlap), then fill the
                              constrained rows' masks on the host (``bg``: on the mask worker
                              thread, `mask_job`, while the scheduler thread goes on)
``finish_masks(job, pos)``    wait for the fill; mark the rows whose grammar can only end
``apply_masks(logits, job)``  mask those rows of the batch's logits on the device
``accept(req, token)``        each new token of a constrained request: advance its matcher
                              (or take the outcome of the job that accepted it ahead); a terminated matcher
                              finishes the request with ``stop``
============================  ===================================================================
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from attnserve.engine.constrained.mask_job import ACCEPTED, REJECTED, TERMINATED, MaskJob, MaskWorker
from attnserve.engine.constrained.spec import GrammarSpec, check_grammar_text, import_xgrammar, spec_of
from attnserve.engine.detokenizer import finalize_text
from attnserve.engine.request import FinishReason, Req


@dataclass
class RequestGrammar:
    """One request's grammar (``Req.grammar``).

    Attributes:
        spec: what it must match.
        compiled: future of the xgrammar ``CompiledGrammar`` (shared by every request with
            the same grammar).
        matcher: the request's own xgrammar ``GrammarMatcher`` once compiled (None before).
        ahead_job: the `MaskJob` that accepts the request's next token before it is
            appended (overlap); `GrammarManager.accept` takes the outcome from it.
        must_end: at the last mask fill the grammar allowed nothing but its stop tokens
            while ``min_tokens`` was not reached (the grammar wins: ``min_tokens`` yields).
    """

    spec: GrammarSpec
    compiled: Future
    matcher: Any = None
    ahead_job: Optional[MaskJob] = None
    must_end: bool = False


@dataclass
class GrammarStats:
    """``requests``: constrained requests queued; ``failed``: those whose grammar did not
    compile; ``early_syncs``: overlap steps that read the previous step's tokens before
    filling masks (see the package doc); ``background_fills``: mask fills run on the worker
    thread (their step's sampling deferred); ``terminated``: requests the grammar
    finished; ``min_tokens_yielded``: rows where ``min_tokens`` let the grammar end."""

    requests: int = 0
    failed: int = 0
    early_syncs: int = 0
    background_fills: int = 0
    terminated: int = 0
    min_tokens_yielded: int = 0


class GrammarManager:
    """Compile cache, per-request matchers and token masks of one scheduler.

    Built with every scheduler; xgrammar is imported, and the compile workers and mask
    buffers created, at the first constrained request only.

    Args:
        tokenizer: the engine's HF tokenizer (None: constrained requests are refused).
        vocab_size: the width of the model's logits.
        eos_token_ids: the ids a complete grammar accepts to end the output.
        device: the logits' device.
        speculative: the engine decodes speculatively (constrained requests are refused).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], device,
                 speculative: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.speculative = speculative
        self.stats = GrammarStats()
        self.cache = None  # GrammarCompileCache, at the first constrained request
        self.bitmask = None  # TokenBitmask, at the first masked batch
        self._compiling: List[Req] = []  # held requests whose grammar is compiling
        self._failed: List[Req] = []  # failed at `enqueue` (a cached failure), reported by `poll`
        self.worker: Optional[MaskWorker] = None  # the mask worker thread, at the first masked batch

    # ---- before queueing -------------------------------------------------------------------
    def check(self, params, parse: bool = False) -> None:
        """Raise ValueError if ``params``' grammar cannot be served by this engine; nothing
        for a request without one.

        Args:
            parse: also parse the grammar text (`check_grammar_text`); the server does this
                in its HTTP handler already, the offline API in `Engine.check_prompt`.
        """
        spec = spec_of(params)
        if spec is None:
            return
        if self.speculative:
            raise ValueError(f"{spec.kind}: constrained decoding is not supported together with speculative "
                             "decoding (--speculative-algorithm); serve constrained requests from an engine "
                             "without it")
        if self.tokenizer is None:
            raise ValueError(f"{spec.kind}: constrained decoding needs the model's tokenizer, and this engine "
                             "has none")
        if parse:
            check_grammar_text(spec)
        else:
            try:
                import_xgrammar()
            except ImportError as e:
                raise ValueError(str(e)) from None

    def enqueue(self, req: Req, waiting) -> None:
        """Put ``req`` (a new request, checked with `check`) in ``waiting`` (the scheduler's
        queue) if it has no grammar or its grammar is compiled already (cached); otherwise
        hold it here while its grammar compiles on a worker thread (`poll` queues it)."""
        spec = spec_of(req.sampling_params)
        if spec is None:
            waiting.append(req)
            return
        if self.cache is None:
            from attnserve.engine.constrained.compile_cache import GrammarCompileCache

            self.cache = GrammarCompileCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
        req.grammar = RequestGrammar(spec, self.cache.get(spec))
        self.stats.requests += 1
        self._compiling.append(req)
        if req.grammar.compiled.done():  # cached: queued now; a cached failure is reported by `poll`
            failed = self.poll(waiting)  # poll rebinds self._failed: extend the new list
            self._failed.extend(failed)

    # ---- while grammars compile ------------------------------------------------------------
    @property
    def compiling(self) -> bool:
        """Some request waits for its grammar (held here, not in the scheduler's queue)."""
        return bool(self._compiling or self._failed)

    def poll(self, waiting) -> List[Req]:
        """Queue (append to ``waiting``) the held requests whose grammar has compiled, with
        their matcher; return those whose grammar failed, finished (``abort``; ``error``
        says why, ``error_status`` is 400). Aborted held requests are dropped."""
        failed, self._failed, still = self._failed, [], []
        for req in self._compiling:
            g = req.grammar
            if req.finished:  # aborted while compiling
                continue
            if not g.compiled.done():
                still.append(req)
                continue
            exc = g.compiled.exception()
            if exc is None:
                g.matcher = import_xgrammar().GrammarMatcher(g.compiled.result())
                waiting.append(req)
                continue
            req.finish_reason = FinishReason.ABORT
            req.error = str(exc) if isinstance(exc, ValueError) else f"{g.spec.kind}: {type(exc).__name__}: {exc}"
            req.error_status = 400
            req.finished_at = time.perf_counter()
            failed.append(req)
            self.stats.failed += 1
        self._compiling = still
        return failed

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for any held request's grammar to compile (the
        scheduler calls this when nothing else can run, instead of spinning)."""
        futures = [r.grammar.compiled for r in self._compiling]
        if futures:
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- sampling --------------------------------------------------------------------------
    @staticmethod
    def any_constrained(reqs: Sequence[Req]) -> bool:
        return any(r.grammar is not None for r in reqs)

    @staticmethod
    def needs_tokens_first(reqs: Sequence[Req]) -> bool:
        """Some constrained row of ``reqs`` has a sampled token not yet on the host (overlap
        scheduling): its matcher must accept it before the next mask can be filled."""
        return any(r.grammar is not None and r.num_inflight > 0 and not r.finished for r in reqs)

    def start_masks(self, reqs: Sequence[Req], background: bool, ahead_reqs: Sequence[Req] = (),
                    ahead_tokens: Sequence[int] = ()) -> Optional[MaskJob]:
        """Start the grammar work of a batch (``reqs``: its sampling rows, in order): accept
        ``ahead_tokens`` into the matchers of ``ahead_reqs`` (overlap: the pending step's
        constrained rows, not yet processed; `accept` takes the outcomes), then fill the
        masks of the rows whose request has a grammar, is not finished and whose matcher
        has not terminated. None when there is nothing to do.

        Args:
            background: run on the mask worker thread (`MaskWorker`); the job's matchers
                must then not be touched until `finish_masks`. Else run now.
        """
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished]
        if not rows and not ahead_reqs:
            return None
        if self.bitmask is None:
            from attnserve.engine.constrained.bitmask import TokenBitmask

            self.bitmask = TokenBitmask(self.vocab_size, self.device)
            self.worker = MaskWorker(self.bitmask, self.cache.token_table())
        job = MaskJob([reqs[i] for i in rows], rows, self.bitmask.reserve(rows, len(reqs)),
                      list(ahead_reqs), list(ahead_tokens))
        for r in job.ahead_reqs:
            r.grammar.ahead_job = job
        if background:
            self.worker.submit(job)
            self.stats.background_fills += 1
        else:
            self.worker.run(job)
        return job

    def finish_masks(self, job: Optional[MaskJob], positions: Sequence[int]) -> None:
        """Wait for ``job`` (re-raising its error), then set ``must_end`` of its masked
        rows: True where ``min_tokens`` still applies (``positions[row]``, the row's output
        tokens before this step, is below it) and the mask allows only stop tokens."""
        if job is None:
            return
        job.result()
        for i, (row, r) in enumerate(zip(job.rows, job.reqs)):
            g, p = r.grammar, r.sampling_params
            g.must_end = bool(p.min_tokens > positions[row]
                              and self.bitmask.only_stop_allowed(job.filled, i, g.matcher.stop_token_ids))
            self.stats.min_tokens_yielded += g.must_end

    def apply_masks(self, logits, job: Optional[MaskJob]) -> None:
        """Mask, in place, ``job``'s rows of ``logits`` (float ``[n, V]``, the batch's
        sampling rows) after `finish_masks`; nothing when ``job`` is None."""
        if job is not None:
            self.bitmask.apply_filled(logits, job.filled)

    def accept(self, req: Req, token: int) -> None:
        """Advance ``req``'s matcher by ``token`` (just appended to its output), or take the
        outcome of the `MaskJob` that accepted it ahead; no-op for a request without a
        grammar. A matcher that terminates (it accepted a stop token after a complete
        match) finishes the request with ``stop``; a token the grammar rejects (a masking
        bug) fails it alone (``error`` set)."""
        g = req.grammar
        if g is None:
            return
        if g.ahead_job is not None:
            job, g.ahead_job = g.ahead_job, None
            outcome = job.outcome(req)
        elif self.worker is not None and self.worker.tokens is not None:
            outcome = self.worker.tokens.accept_one(g.matcher, token)  # mask_job: not accept_token
        elif not g.matcher.accept_token(token):
            outcome = REJECTED
        else:
            outcome = TERMINATED if g.matcher.is_terminated() else ACCEPTED
        if outcome == REJECTED:
            req.finish_reason = FinishReason.ABORT
            req.error = f"the {g.spec.kind} grammar rejected the sampled token {token}"
        elif outcome == TERMINATED:
            req.finish_reason = FinishReason.STOP
            req.matched_stop = token
            finalize_text(req, self.tokenizer)
            self.stats.terminated += 1

    def shutdown(self) -> None:
        """Stop the compile workers; the requests held for their grammar end with ``abort``
        (``error`` says why). Idempotent."""
        for req in self._compiling:
            if not req.finished:
                req.finish_reason = FinishReason.ABORT
                req.error = "the engine was shut down"
        if self.cache is not None:
            self.cache.shutdown()
        if self.worker is not None:
            self.worker.shutdown()  # a running job writes into the mask buffers
        self.cache = self.bitmask = self.worker = None
        self._compiling, self._failed = [], []
