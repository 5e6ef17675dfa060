"""`GrammarCompileCache`: xgrammar grammars compiled once per distinct grammar, off the
scheduler's thread.

Compiling a grammar against a vocabulary (xgrammar's ``GrammarCompiler``: the grammar's
automaton plus the token masks it can precompute) takes from a fraction of a millisecond
(a short regex) to seconds (a large schema with string patterns: 2.3 s for 40 patterned
string properties against SmolLM2's 49,152 tokens on this project's 2-core CPU). So:

* compilation runs on worker threads (xgrammar releases the GIL while it compiles: a
  Python thread kept ~90 % of its speed during a 2.3 s compile on the same machine), and
  the scheduler only looks at the returned futures;
* results are kept in an LRU cache keyed by (kind, text) (`GrammarSpec.key`), so repeated
  schemas, the ``n`` choices of one request, and retried requests compile once;
* the vocabulary's ``TokenizerInfo`` (a pass over the tokenizer's vocabulary, ~0.2 s for
  49k tokens) is built by the first worker task, not at engine start: engines that never
  see a constrained request pay nothing, and the first one waits for it alone; the same
  task builds the `TokenTable` that the mask worker accepts tokens with
  (`attnserve.engine.constrained.mask_job`).

Two or more workers, so that one slow compile never holds another request's grammar
back. xgrammar's own compiler cache is off (this one is the cache, with a bound).

JSON Schemas go through `attnserve.engine.constrained.json_schema` (fixes of xgrammar
0.2.8's length-bounded strings: speed and validity).

Threading: only the scheduler thread calls the methods; the workers run `_compile` and
`_make_compiler` only, and futures are the sole shared state.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from attnserve.engine.constrained.json_schema import json_schema_grammar
from attnserve.engine.constrained.mask_job import TokenTable
from attnserve.engine.constrained.spec import GrammarSpec, clean_error, import_xgrammar

#: compiled grammars kept (a small schema's compiled grammar is tens of KB; a large one a
#: few MB)
DEFAULT_MAX_ENTRIES = 512


@dataclass
class CompileCacheStats:
    """``hits`` / ``misses``: `GrammarCompileCache.get` calls that found / started a compile;
    ``evictions``: entries dropped by the LRU bound."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


class GrammarCompileCache:
    """Futures of xgrammar ``CompiledGrammar`` objects, keyed by `GrammarSpec.key`.

    Args:
        tokenizer: the HF tokenizer of the engine.
        vocab_size: the width of the model's logits (the LM head's rows, padding included);
            token ids the tokenizer lacks are masked out by every grammar.
        stop_token_ids: ids a grammar accepts once it is complete (the engine's EOS ids).
        max_entries: LRU bound.
        workers: compile threads (default: 2, or up to 4 on hosts with 8+ cores).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 max_entries: int = DEFAULT_MAX_ENTRIES, workers: Optional[int] = None):
        self._xgr = import_xgrammar()
        cores = os.cpu_count() or 1
        self.workers = workers or max(2, min(4, cores // 4))
        self.max_entries = max_entries
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size]
        self.stats = CompileCacheStats()
        self._entries: "OrderedDict[tuple, Future]" = OrderedDict()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="attnserve-grammar")
        self._tokens: Optional[TokenTable] = None  # set by the task below, before its result
        self._compiler: Future = self._pool.submit(self._make_compiler, tokenizer, min(8, cores))

    def _make_compiler(self, tokenizer, threads: int):
        xgr = self._xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        self._tokens = TokenTable.from_tokenizer_info(info)
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def token_table(self) -> TokenTable:
        """The vocabulary's `TokenTable` (waits for the task that builds it; it is done once
        any grammar has compiled). Raises what that task raised."""
        self._compiler.result()
        return self._tokens

    def get(self, spec: GrammarSpec) -> Future:
        """The future of ``spec``'s compiled grammar: cached, or compiling from now on.

        The future's exception is a ValueError (``"invalid <kind>: <reason>"``) when the
        grammar does not compile."""
        key = spec.key
        fut = self._entries.get(key)
        if fut is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return fut
        self.stats.misses += 1
        fut = self._pool.submit(self._compile, spec)
        self._entries[key] = fut
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)  # requests holding the future keep it
            self.stats.evictions += 1
        return fut

    def __len__(self) -> int:
        return len(self._entries)

    def _compile(self, spec: GrammarSpec):
        compiler = self._compiler.result()
        try:
            if spec.kind == "json_schema":
                return compiler.compile_grammar(json_schema_grammar(spec.text))
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.text)
        except RuntimeError as e:
            raise ValueError(f"invalid {spec.kind}: {clean_error(e)}") from None
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def shutdown(self) -> None:
        """Stop the workers (queued compiles are cancelled; a running one finishes in the
        background). Idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._entries.clear()

