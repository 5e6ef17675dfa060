"""Constrained decoding on a GPU (dummy weights): decode step time with every request under
a JSON schema against the same requests unconstrained, in the same run. Writes
``<out>/<device>-grammar-<date>.json``.

``PYTHONPATH=src python benchmarks/grammar_decode.py [--models llama-3-8b qwen3-0.6b]
[--requests 64] [--tokenizer DIR] [--out DIR]``

Dummy shapes have no tokenizer, so each model runs from a directory holding the shape's
``config.json`` and the tokenizer of ``--tokenizer`` (default: SmolLM2's, 49,152 tokens,
saved as ``tokenizer.json``; the model's wider LM head is then padded vocabulary, masked by
every grammar); the engine loads it with ``load_format="dummy"`` (random bf16 weights).
xgrammar's host work grows with the tokenizer's vocabulary, so a 128k-token tokenizer
would fill masks more slowly than this one (the device work, copy and masking kernel, is
sized by the model's vocabulary and is the real one).

Per model: a warm-up (Triton JIT of the masking kernel, the schema compiled and cached),
then ``--requests`` prompts of ``--input-len`` random ids, all decoded in one batch:

1. ``free``: unconstrained, greedy, ``ignore_eos``, ``--output-len`` tokens;
2. ``json``: greedy under `SCHEMA` (every string, number and array bounded, so even a
   random model's output ends: the mask alone makes it valid JSON) with room for the
   longest output. Its strings are bounded by ASCII patterns: a random model writes
   whatever bytes a mask allows, and xgrammar's UTF-8 classes let a few invalid
   sequences through (`attnserve.engine.constrained.json_schema`), which a trained model
   does not write. ``host_fill`` times the mask fill alone for 64 rows inside a string,
   with these patterns and with ``maxLength`` instead (the regex rewrite's path);
3. ``mixed``: half of the requests under the schema, half unconstrained.

A step's time is the wall time of one ``Engine.step`` call (overlap scheduling and CUDA
graphs on: in steady state the period of the GPU pipeline); only decode steps with the
full batch count (before the first request finishes). Reported: median step ms of each
run, ``ratio`` = json / free (targets: 1.10 for Llama-3-8B, 1.25 for Qwen3-0.6B), the
JSON outputs' validity under ``jsonschema`` (an output counts as valid only if its grammar
ended it, ``finish_reason`` ``stop``, and it validates; the finish reasons are recorded),
host ms spent filling masks per step (on the mask worker thread under overlap), the steps
whose pending step's tokens were accepted before the masks were filled (``early_syncs``)
and the fills run on the worker with the sampling deferred (``background_fills``; see
`attnserve.engine.step_sampling`), and the mask worker's ms per job (``worker``:
``accept_ms_per_job``, ``fill_ms_per_job``, ``queue_ms_per_job`` from submission to start;
`attnserve.engine.constrained.mask_job.MaskWorkerStats`). The host side of a step is
reproduced on the CPU by `benchmarks/grammar_host_cpu.py`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import tempfile
import time
from typing import Dict, List

import torch

from attnserve.bench.results import cuda_run_metadata, write_result
from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams

TARGETS = {"llama-3-8b": 1.10, "qwen3-0.6b": 1.25}
_STR = {"type": "string", "pattern": "^[a-zA-Z0-9 ]{1,12}$"}
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": _STR,
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "integer", "minimum": -100, "maximum": 100},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "gray"]}, "minItems": 2, "maxItems": 4},
        "location": {"type": "object", "properties": {"city": _STR, "zip": {"type": "integer", "minimum": 10000,
                                                                            "maximum": 99999}},
                     "required": ["city", "zip"]},
        "verified": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string", "pattern": "^[a-z]{0,8}$"}, {"type": "null"}]},
    },
    "required": ["id", "name", "status", "score", "tags", "location", "verified", "note"],
}
#: room for the longest output of `SCHEMA` (about 200 characters, at least one per token)
JSON_MAX_TOKENS = 320
DEFAULT_TOKENIZER = ".whl/grammar/smollm2-tokenizer"


def model_dir(shape: str, tokenizer_dir: str, root: str) -> str:
    """A directory with the dummy shape's config and the tokenizer's files."""
    from attnserve.model_loader.dummy import dummy_hf_config

    path = os.path.join(root, shape)
    os.makedirs(path, exist_ok=True)
    dummy_hf_config(shape).save_pretrained(path)
    tok = load_tokenizer(tokenizer_dir)
    tok.save_pretrained(path)
    return path


def load_tokenizer(tokenizer_dir: str):
    """A fast tokenizer from ``tokenizer.json`` (+ ``tokenizer_config.json`` for the special
    tokens), independent of the transformers version that saved it."""
    from transformers import PreTrainedTokenizerFast

    cfg = {}
    cfg_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if isinstance(cfg.get(k), str)}
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(tokenizer_dir, "tokenizer.json"), **special)


def _sync(llm: LLM) -> None:
    if llm.engine.model_runner.device.type == "cuda":
        torch.cuda.synchronize()


def timed_run(llm: LLM, prompts: List[List[int]], params: List[SamplingParams]) -> Dict:
    """Run one batch to completion with ``Engine.step``; time the full-batch decode steps."""
    engine, sched = llm.engine, llm.engine.scheduler
    _sync(llm)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    n = len(reqs)
    step_s: List[float] = []
    t_start = time.perf_counter()
    while any(not r.finished for r in reqs):
        decode0 = sched.stats.num_decode_steps
        full = all(not r.finished for r in reqs) and len(sched.running) == n
        t0 = time.perf_counter()
        engine.step()
        dt_s = time.perf_counter() - t0
        if full and sched.stats.num_decode_steps == decode0 + 1 and all(not r.finished for r in reqs):
            step_s.append(dt_s)
    sched.flush()
    _sync(llm)
    wall = time.perf_counter() - t_start
    outs = [(r.text, r.finish_reason.value, list(r.output_ids)) for r in reqs]
    for r in reqs:
        sched.forget(r.rid)
    steady = step_s[2:] if len(step_s) > 6 else step_s  # the first full steps still settle the pipeline
    return {"wall_s": wall, "full_batch_steps": len(steady),
            "median_step_ms": 1e3 * statistics.median(steady) if steady else None,
            "mean_step_ms": 1e3 * statistics.fmean(steady) if steady else None, "outputs": outs}


def validate(outs, schema) -> Dict:
    import jsonschema

    valid, errors = 0, []
    reasons: Dict[str, int] = {}
    for text, reason, _ in outs:
        reasons[reason] = reasons.get(reason, 0) + 1
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += reason == "stop"
            if reason != "stop":
                errors.append(f"{reason}: valid JSON, but the grammar did not end it | {text[:160]!r}")
        except Exception as e:  # noqa: BLE001 - reported, not raised
            errors.append(f"{reason}: {type(e).__name__}: {str(e)[:120]} | {text[:160]!r}")
    return {"valid": valid, "total": len(outs), "finish_reasons": reasons, "errors": errors[:5]}


def host_fill(llm: LLM, n: int) -> Dict:
    """Host ms to fill ``n`` masks inside a string of `SCHEMA` (xgrammar batch fill, as a
    step does), with the ASCII patterns and with ``maxLength`` bounds instead."""
    import xgrammar as xgr

    from attnserve.engine.constrained import GrammarSpec

    g = llm.engine.scheduler.grammar
    variants = {"patterns": SCHEMA, "max_length": {**SCHEMA, "properties": {
        **SCHEMA["properties"], "name": {"type": "string", "minLength": 1, "maxLength": 12}}}}
    out = {}
    for name, schema in variants.items():
        compiled = g.cache.get(GrammarSpec("json_schema", json.dumps(schema))).result()
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(n)]
        for i, m in enumerate(matchers):
            assert m.accept_string('{"id": %d, "name": "ab' % i)
        mask = torch.empty((n, (g.vocab_size + 31) // 32), dtype=torch.int32)
        batch = xgr.BatchGrammarMatcher()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            batch.batch_fill_next_token_bitmask(matchers, mask)
            times.append(time.perf_counter() - t0)
        out[name] = {"rows": n, "median_ms": 1e3 * statistics.median(times)}
    return out


def bench_model(shape: str, tokenizer_dir: str, n: int, input_len: int, output_len: int, root: str,
                device: str = "cuda") -> Dict:
    path = model_dir(shape, tokenizer_dir, root)
    llm = LLM(path, load_format="dummy", device=device, context_length=input_len + JSON_MAX_TOKENS + 16,
              max_running_requests=n, skip_server_warmup=True)  # the warm-up runs below cover the timed shapes
    tok_vocab = len(llm.tokenizer)
    gen = torch.Generator().manual_seed(0)
    hi = min(tok_vocab, llm.engine.model_config.vocab_size)
    prompts = [torch.randint(10, hi, (input_len,), generator=gen).tolist() for _ in range(n)]
    free = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=JSON_MAX_TOKENS, temperature=0.0, json_schema=SCHEMA)
    # warm-up: CUDA graphs are captured at start; this caches the schema and JITs both variants
    # of the masking kernel (every row constrained; some rows, by index)
    timed_run(llm, prompts[:8], [constrained] * 8)
    timed_run(llm, prompts[:8], [constrained] * 4 + [free] * 4)
    timed_run(llm, prompts, [free] * n)
    runs = {}
    g = llm.engine.scheduler.grammar
    for name, params in (("free", [free] * n), ("json", [constrained] * n),
                         ("mixed", [constrained, free] * (n // 2) + [free] * (n % 2))):
        syncs0, fill0, steps0 = g.stats.early_syncs, g.bitmask.stats.fill_seconds, g.bitmask.stats.steps
        bg0 = g.stats.background_fills
        w0 = vars(g.worker.stats).copy() if g.worker is not None else None
        host0, dec0 = llm.engine.scheduler.stats.decode_host_seconds, llm.engine.scheduler.stats.num_decode_steps
        run = timed_run(llm, prompts, params)
        masked = g.bitmask.stats.steps - steps0
        run["early_syncs"] = g.stats.early_syncs - syncs0
        run["background_fills"] = g.stats.background_fills - bg0
        run["fill_ms_per_masked_step"] = 1e3 * (g.bitmask.stats.fill_seconds - fill0) / max(masked, 1)
        if w0 is not None:  # the mask worker (engine/constrained/mask_job): accepts, fill, wake-up
            w1 = vars(g.worker.stats)
            jobs = max(w1["jobs"] - w0["jobs"], 1)
            run["worker"] = {k: w1[k] - w0[k] for k in ("jobs", "accepted_rows")}
            run["worker"].update({k.replace("_seconds", "_ms_per_job"): 1e3 * (w1[k] - w0[k]) / jobs
                                  for k in ("accept_seconds", "fill_seconds", "queue_seconds")})
        sched_stats = llm.engine.scheduler.stats
        run["host_ms_per_decode_step"] = 1e3 * (sched_stats.decode_host_seconds - host0) / max(
            sched_stats.num_decode_steps - dec0, 1)
        outs = run.pop("outputs")
        cons = [o for o, p in zip(outs, params) if p.json_schema is not None]
        if cons:
            run["validity"] = validate(cons, SCHEMA)
            run["mean_json_tokens"] = statistics.fmean(len(o[2]) for o in cons)
            eos = set(llm.engine.scheduler.eos_token_ids)  # the shape's EOS may lie past the tokenizer
            run["padded_ids_sampled"] = sum(t >= tok_vocab and t not in eos for o in cons for t in o[2])
        runs[name] = run
        print(f"{shape:12s} {name:5s} median step {run['median_step_ms']:.3f} ms over {run['full_batch_steps']} "
              f"full-batch steps; fill {run['fill_ms_per_masked_step']:.3f} ms/step; "
              f"early syncs {run['early_syncs']}; background fills {run['background_fills']}; "
              f"worker {({k: round(v, 3) for k, v in run['worker'].items()} if 'worker' in run else '')}; "
              f"{run.get('validity', '')}", flush=True)
    ratio = runs["json"]["median_step_ms"] / runs["free"]["median_step_ms"]
    row = {"model": shape, "requests": n, "input_len": input_len, "output_len_free": output_len,
           "tokenizer_vocab": tok_vocab, "model_vocab": llm.engine.model_config.vocab_size,
           "overlap": llm.engine.scheduler.overlap,
           "cuda_graphs": llm.engine.model_runner.cuda_graph_runner is not None,
           "ratio_json_over_free": ratio,
           "ratio_mixed_over_free": runs["mixed"]["median_step_ms"] / runs["free"]["median_step_ms"],
           "target": TARGETS.get(shape), "meets_target": None if shape not in TARGETS else ratio <= TARGETS[shape],
           "compile_cache": vars(g.cache.stats), "host_fill": host_fill(llm, n), "runs": runs}
    print(f"{shape:12s} json/free {ratio:.3f} (target {TARGETS.get(shape)}); "
          f"mixed/free {row['ratio_mixed_over_free']:.3f}", flush=True)
    llm.shutdown()
    del llm
    gc.collect()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "qwen3-0.6b"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="directory with tokenizer.json")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run of the script)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for shape in args.models:
            rows.append(bench_model(shape, args.tokenizer, args.requests, args.input_len, args.output_len, root,
                                    args.device))
    from importlib.metadata import version

    meta = cuda_run_metadata("grammar", t0) if args.device == "cuda" else {
        "benchmark": "grammar", "date": dt.date.today().isoformat(), "device": "cpu", "torch": torch.__version__}
    result = {**meta, "xgrammar": version("xgrammar"), "tokenizer": args.tokenizer, "schema": SCHEMA, "rows": rows}
    write_result(result, args.out, "grammar", args.device)
    return 0 if all(r["meets_target"] in (True, None) and r["runs"]["json"]["validity"]["valid"] == args.requests
                    for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
