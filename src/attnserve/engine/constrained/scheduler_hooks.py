"""`ConstrainedScheduling`: the scheduler's constrained-decoding steps, kept out of
`attnserve.engine.scheduler` (a mixin of `Scheduler`, whose state it uses: ``waiting``,
``_pending``).

Call sites in `Scheduler`: ``_init_grammar`` (constructor), ``grammar.check`` and
``grammar.enqueue`` (`add_request`: a request whose grammar compiles is held by the
`GrammarManager`, outside ``waiting``, so admission never sees it), ``grammar.compiling``
(`has_work`), ``_poll_grammars`` and ``_wait_for_grammars`` (`step`), ``grammar.accept``
(`_append`), ``grammar.shutdown`` (`release`). The masks are `attnserve.engine.step_sampling`'s
(``start_masks``, ``finish_masks``, ``apply_masks``).
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

    def _poll_grammars(self, touched: List[Req]) -> None:
        """Start of a step: requests whose grammar has compiled join the queue; those whose
        grammar failed are finished with their error (reported through ``touched``)."""
        if self.grammar.compiling:
            touched.extend(self.grammar.poll(self.waiting))

    def _wait_for_grammars(self, batch) -> None:
        """Nothing was launched (``batch`` is None) and nothing is pending: rather than spin,
        wait a little for the grammars that held requests wait for."""
        if batch is None and self._pending is None and self.grammar.compiling:
            self.grammar.wait(IDLE_COMPILE_WAIT_S)
