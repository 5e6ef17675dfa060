"""Constrained decoding with xgrammar (Dong et al., "XGrammar", arXiv:2411.15100): JSON
Schema, regex and EBNF grammars, OpenAI's ``response_format`` and SGLang's ``json_schema``
/ ``regex`` / ``ebnf`` sampling parameters.

Modules: `spec` (what a request asks for, checks without a tokenizer), `compile_cache`
(compile once per distinct grammar, on worker threads, LRU), `json_schema` (fixes of
xgrammar's length-bounded strings), `bitmask` (token masks filled on the host, applied on
the device), `manager` (`GrammarManager`), `scheduler_hooks` (the scheduler's steps).

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
ids of a padded LM head that the tokenizer lacks are never sampled.

**Overlap with the GPU.** The forward of a step is enqueued first; the host fills the masks
while the GPU runs it, then enqueues the mask copy, the masking kernel and the sampling
behind it. Under overlap scheduling (the CUDA default), step N+1 is launched before the
host has step N's tokens, but a constrained row's mask for N+1 depends on its token of
step N. So when a batch holds a constrained request with a token in flight, the scheduler
processes step N's results (waits for its ids, appends them, advances the matchers:
`ConstrainedScheduling._mask_grammar`) right after enqueueing step N+1's forward, then
fills the masks and enqueues the sampling. The forward of N+1 still overlaps the host's
processing of N and the mask fill, as in SGLang's overlap scheduler, which also defers
only the sampling of a grammar batch until the masks are ready. What it costs against an
unconstrained batch: the mask fill on the host (64 rows of
`benchmarks/grammar_decode.py`'s schema, inside strings, SmolLM2's 49,152 tokens: 0.5 ms
on one thread of the 2-core CPU; xgrammar spreads it over half the host's cores), one H2D
copy of ``k * ceil(V/32) * 4`` bytes and one masking kernel on the device, and, only if
the host's processing of step N plus the fill outlasts the forward of N+1, an idle GPU
for the difference before sampling. (On the CPU, xgrammar's masking kernel takes ~24 ms
for 64 rows of 49,152.) Batches without a constrained row run exactly as before (one
``any()`` over the batch's requests is the whole check).
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
