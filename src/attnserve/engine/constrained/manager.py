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
``apply(logits, reqs)``       masks the constrained rows of a batch's logits before sampling
``accept(req, token)``        each new token of a constrained request: advance its matcher;
                              a terminated matcher finishes the request with ``stop``
============================  ===================================================================
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, List, Sequence

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
    """

    spec: GrammarSpec
    compiled: Future
    matcher: Any = None


@dataclass
class GrammarStats:
    """``requests``: constrained requests queued; ``failed``: those whose grammar did not
    compile; ``early_syncs``: overlap steps that read the previous step's tokens before
    sampling (see the package doc); ``terminated``: requests the grammar finished."""

    requests: int = 0
    failed: int = 0
    early_syncs: int = 0
    terminated: int = 0


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

    def apply(self, logits, reqs: Sequence[Req]) -> None:
        """Mask, in place, the rows of ``logits`` (float ``[len(reqs), V]``) whose request
        has a grammar and is not finished; call only once every earlier token of those
        requests has been accepted (`needs_tokens_first` is False)."""
        rows, matchers = [], []
        for i, r in enumerate(reqs):
            if r.grammar is not None and not r.finished:
                rows.append(i)
                matchers.append(r.grammar.matcher)
        if not rows:
            return
        if self.bitmask is None:
            from attnserve.engine.constrained.bitmask import TokenBitmask

            self.bitmask = TokenBitmask(self.vocab_size, self.device)
        self.bitmask.apply(logits, rows, matchers)

    def accept(self, req: Req, token: int) -> None:
        """Advance ``req``'s matcher by ``token`` (just appended to its output); no-op for a
        request without a grammar. A matcher that terminates (it accepted a stop token
        after a complete match) finishes the request with ``stop``; a token the grammar
        rejects (a masking bug) fails it alone (``error`` set)."""
        if req.grammar is None:
            return
        m = req.grammar.matcher
        if not m.accept_token(token):
            req.finish_reason = FinishReason.ABORT
            req.error = f"the {req.grammar.spec.kind} grammar rejected the sampled token {token}"
            return
        if m.is_terminated():
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
        self.cache = self.bitmask = None
        self._compiling, self._failed = [], []
