"""`ConstrainedScheduling`: the scheduler's constrained-decoding steps, kept out of
`attnserve.engine.scheduler` (a mixin of `Scheduler`, whose state it uses: ``waiting``,
``_pending``, ``_current``, ``_process``).

Call sites in `Scheduler`: ``_init_grammar`` (constructor), ``grammar.check`` and
``grammar.enqueue`` (`add_request`: a request whose grammar compiles is held by the
`GrammarManager`, outside ``waiting``, so admission never sees it), ``grammar.compiling``
(`has_work`), ``_poll_grammars`` and ``_wait_for_grammars`` (`step`), ``_mask_grammar``
(`_launch_forward`, before sampling), ``grammar.accept`` (`_append`), ``grammar.shutdown``
(`release`).
"""

from __future__ import annotations

from typing import List

from attnserve.engine.constrained.manager import GrammarManager
from attnserve.engine.request import Req

#: longest the scheduler blocks on compiling grammars when nothing else can run (seconds)
IDLE_COMPILE_WAIT_S = 0.005


class ConstrainedScheduling:
    """Mixin of `Scheduler` for constrained decoding (`attnserve.engine.constrained`)."""

    def _init_grammar(self, model_runner) -> None:
        self.grammar = GrammarManager(self.tokenizer, model_runner.model_config.vocab_size, self.eos_token_ids,
                                      self.device, speculative=self.spec is not None)
        self._step_touched: List[Req] = []  # the running step's touched list (early syncs add to it)

    def _poll_grammars(self, touched: List[Req]) -> None:
        """Start of a step: requests whose grammar has compiled join the queue; those whose
        grammar failed are finished with their error (reported through ``touched``)."""
        self._step_touched = touched
        if self.grammar.compiling:
            touched.extend(self.grammar.poll(self.waiting))

    def _wait_for_grammars(self, batch) -> None:
        """Nothing was launched (``batch`` is None) and nothing is pending: rather than spin,
        wait a little for the grammars that held requests wait for."""
        if batch is None and self._pending is None and self.grammar.compiling:
            self.grammar.wait(IDLE_COMPILE_WAIT_S)

    def _mask_grammar(self, logits, reqs: List[Req]) -> None:
        """Mask the constrained rows of ``logits`` (the rows of ``reqs``) before sampling;
        nothing when no request of ``reqs`` has a grammar.

        Under overlap scheduling a constrained request may still have its previous token
        in flight (the pending step): that step's results are processed first, while the
        GPU runs the forward just enqueued, so every matcher has all its tokens. A failure
        there fails the pending step's requests and this batch's."""
        if not self.grammar.any_constrained(reqs):
            return
        if self._pending is not None and self.grammar.needs_tokens_first(reqs):
            pending, self._pending = self._pending, None
            current = self._current
            try:
                self._step_touched.extend(self._process(pending))
            except BaseException:
                ids = set(map(id, current))
                self._current = list(current) + [r for r in pending.batch.reqs if id(r) not in ids]
                raise
            self._current = current
            self.grammar.stats.early_syncs += 1
        self.grammar.apply(logits, reqs)
