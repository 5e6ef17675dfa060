"""Constrained decoding on the GPU: the dummy Qwen3-0.6B shape (random bf16 weights) with the
300-token byte-level tokenizer of `grammar_fixtures` under its 151,936-wide LM head. With
the CUDA defaults (decode CUDA graphs, overlap scheduling), 64 concurrent JSON-schema
requests must all validate (a random model's output is valid only through the mask, and
no padded id may be sampled), the decode steps replay graphs, the pending step's tokens
are read before the masks are filled on the worker thread, and unconstrained rows of a
mixed batch are untouched.
The speed comparison is `benchmarks/grammar_decode.py`."""

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from attnserve.engine.llm import LLM  # noqa: E402
from attnserve.engine.sampling_params import SamplingParams  # noqa: E402
from grammar_fixtures import TOKENIZER_VOCAB, tiny_bpe_tokenizer  # noqa: E402

pytestmark = pytest.mark.cuda

_STR = {"type": "string", "pattern": "^[a-zA-Z0-9 ]{1,10}$"}  # ASCII: see engine/constrained/json_schema.py
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": _STR,
        "status": {"enum": ["active", "inactive"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "where": {"type": "object", "properties": {"city": _STR, "zip": {"type": "integer", "minimum": 100,
                                                                         "maximum": 999}},
                  "required": ["city", "zip"]},
        "ok": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string", "pattern": "^[a-z]{0,6}$"}, {"type": "null"}]},
    },
    "required": ["id", "name", "status", "tags", "where", "ok", "note"],
}
N = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from attnserve.model_loader.dummy import dummy_hf_config

    path = str(tmp_path_factory.mktemp("qwen3-0.6b-tiny-tokenizer"))
    dummy_hf_config("qwen3-0.6b").save_pretrained(path)
    tiny_bpe_tokenizer().save_pretrained(path)
    with LLM(path, load_format="dummy", device="cuda", context_length=1024, max_running_requests=N,
             skip_server_warmup=True) as engine:
        yield engine


def _prompts(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TOKENIZER_VOCAB, (int(torch.randint(8, 64, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(n)]


def test_64_json_requests_validate_with_graphs_and_overlap(llm):
    engine = llm.engine
    runner, sched = engine.model_runner, engine.scheduler
    assert runner.cuda_graph_runner is not None and sched.overlap
    replays = {"n": 0}
    original = runner.cuda_graph_runner.replay

    def counting(fb):
        replays["n"] += 1
        return original(fb)

    runner.cuda_graph_runner.replay = counting
    try:
        params = [SamplingParams(max_new_tokens=320, temperature=1.0, seed=i, json_schema=SCHEMA) for i in range(N)]
        outs = llm.generate(_prompts(N, 0), params)
    finally:
        runner.cuda_graph_runner.replay = original
    eos = set(sched.eos_token_ids)  # the shape's EOS ids lie past this tokenizer: they may end an output
    for o in outs:
        assert o.finish_reason == "stop" and o.error is None, (o.finish_reason, o.text)
        assert all(t < TOKENIZER_VOCAB for t in o.token_ids[:-1]) and o.token_ids[-1] in eos
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > N // 2
    assert replays["n"] > 20  # decode steps ran as graph replays, masked after them
    assert sched.grammar.stats.early_syncs > 0 and sched.grammar.bitmask.stats.rows > N
    assert sched.grammar.stats.background_fills > 0  # masks filled on the worker, the sampling deferred


#: grammars that never have to end (a JSON value may close, leaving only EOS), so that with
#: ``min_tokens == max_new_tokens`` their rows live exactly as long as the unconstrained
#: ones (each step's batch is the same in both runs)
OPEN_GRAMMARS = [{"regex": r"[a-z]+"}, {"ebnf": 'root ::= ("x" | "y" [0-9])+'}, {"regex": r"[0-9a-f]+( [0-9a-f]+)*"}]
OPEN_LANGUAGES = [re.compile(r"[a-z]+"), re.compile(r"(x|y[0-9])*y?"), re.compile(r"[0-9a-f]+( [0-9a-f]+)* ?")]


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    """Rows of a batch that are masked must not change the others: the same batch runs
    twice, the rows 8.. under grammars and then unconstrained. Every row lives exactly
    ``F`` tokens in both runs (``ignore_eos``; the grammars never force an end and
    ``min_tokens`` keeps them from ending), and the prefix cache is flushed before each
    run, so every step's batch, CUDA graph and kernels are the same: the unconstrained rows'
    bf16 tokens must be identical. (Batches of different sizes may differ legitimately.)"""
    F = 24
    sched = llm.engine.scheduler
    free = SamplingParams(max_new_tokens=F, temperature=0.0, ignore_eos=True)
    cons = [SamplingParams(max_new_tokens=F, min_tokens=F, temperature=0.0, **g) for g in OPEN_GRAMMARS] * 3
    prompts = _prompts(8 + len(cons), 1)
    assert sched.flush_prefix_cache()
    mixed = llm.generate(prompts, [free] * 8 + cons)
    assert sched.flush_prefix_cache()
    plain = llm.generate(prompts, [free] * (8 + len(cons)))
    assert all(len(o.token_ids) == F and o.finish_reason == "length" for o in mixed + plain)
    assert [o.token_ids for o in mixed[:8]] == [o.token_ids for o in plain[:8]]
    assert any(t >= TOKENIZER_VOCAB for o in plain[8:] for t in o.token_ids)  # unmasked, these rows reach the padding
    for o, lang in zip(mixed[8:], OPEN_LANGUAGES * 3):
        assert all(t < TOKENIZER_VOCAB for t in o.token_ids), o.token_ids
        assert lang.fullmatch(o.text), o.text
