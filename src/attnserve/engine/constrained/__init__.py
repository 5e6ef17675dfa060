"""Constrained decoding with xgrammar (Dong et al., "XGrammar", arXiv:2411.15100): JSON
Schema, regex and EBNF grammars, OpenAI's ``response_format`` and SGLang's ``json_schema``
/ ``regex`` / ``ebnf`` sampling parameters.

Modules: `spec` (what a request asks for, checks without a tokenizer), `compile_cache`
(compile once per distinct grammar, on worker threads, LRU), `json_schema` (fixes of
xgrammar's length-bounded strings), `bitmask` (token masks filled on the host, applied on
the device), `mask_job` (a batch's accepts and fill on a worker thread), `manager`
(`GrammarManager`), `scheduler_hooks` (the scheduler's steps).

**Lifecycle of a constrained request.** `GrammarManager.check` refuses what the engine
cannot serve before the request is queued (the server has parsed the grammar already; the
offline API parses it in `Engine.check_prompt`). `GrammarManager.enqueue` looks the grammar
up in the compile cache, which starts compiling it on a worker thread if it is new. Until
its grammar is compiled the request is held by the manager, outside the scheduler's queue,
so it is never admitted to a batch; `poll` (each step) builds its `GrammarMatcher` and
queues it. Nobody else waits: the other requests are admitted and run meanwhile, and the
scheduler blocks on compiles (up to 5 ms at a time) only when nothing else can run. A
grammar that fails to compile finishes its request alone with an error (HTTP 400). Once
admitted, the request shares batches with unconstrained ones: its KV, the radix cache,
chunked prefill, retraction and the decode CUDA graphs are the same (the graph ends at the
logits; masking and sampling run after it). Each sampled token advances its matcher
(`accept`); when the matcher terminates (it accepted a stop token after a complete match)
the request finishes with ``stop``. Speculative decoding refuses constrained requests.

**Masks.** Before a batch is sampled, the rows of constrained requests get their
next-token bitmask (`TokenBitmask`): filled on the host by xgrammar (C++ threads), copied
to the device and applied to those rows' logits in place (-inf where the grammar forbids
a token); unconstrained rows are not touched. The mask covers the logits' full width, so
ids of a padded LM head that the tokenizer lacks are never sampled. Where the grammar
allows nothing but its stop token while ``min_tokens`` is not reached, the grammar wins:
``min_tokens`` does not mask that row, and the request ends with ``stop``
(`attnserve.engine.penalties`).

**Overlap with the GPU.** The mask of a step N+1 is filled on the host while the GPU runs
the forward of N+1. Under overlap scheduling (the CUDA default) N+1 is launched before the
host has step N's tokens, which the mask depends on; so after enqueueing forward N+1 the
scheduler reads step N's ids and hands a job to a worker thread (`mask_job`:
accept those ids into the constrained rows' matchers, then fill N+1's masks; xgrammar
releases the GIL), then defers the sampling of N+1 to the next launch (once its host
inputs are built):
meanwhile it processes step N and schedules N+2, the GPU runs forward N+1, and the worker
accepts and fills. The design and its ordering are in `attnserve.engine.step_sampling`. What it
costs against an unconstrained batch: the ids' round trip and the fill, overlapped with
forward N+1 and the host's other work (64 rows of `benchmarks/grammar_decode.py`'s schema,
inside strings, SmolLM2's 49,152 tokens: ~0.6 ms on one thread of the 2-core CPU, ~0.3 ms
over a whole output; xgrammar spreads it over half the host's cores; the accepts, ~0.1-0.4
ms for 64 rows, `mask_job`), one H2D copy of ``k * ceil(V/32) * 4`` bytes and
one masking kernel on the device, and an idle GPU only where the fill outlasts the forward.
(On the CPU, xgrammar's masking kernel takes ~24 ms for 64 rows of 49,152.) Without overlap
the fill runs on the scheduler thread right after the forward is enqueued. Batches without
a constrained row run exactly as before (one ``any()`` over the batch's requests is the
whole check).
"""

from attnserve.engine.constrained.manager import GrammarManager, RequestGrammar
from attnserve.engine.constrained.spec import (
    GRAMMAR_FIELDS,
    JSON_OBJECT_SCHEMA,
    GrammarSpec,
    check_fields,
    check_grammar_text,
    normalize_json_schema,
    spec_of,
)

__all__ = [
    "GRAMMAR_FIELDS", "JSON_OBJECT_SCHEMA", "GrammarManager", "GrammarSpec", "RequestGrammar", "check_fields",
    "check_grammar_text", "normalize_json_schema", "spec_of",
]
