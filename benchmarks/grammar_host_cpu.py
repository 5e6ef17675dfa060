"""Host cost of a constrained decode step, measured on the CPU (issue 35, the Qwen3-0.6B
speed target of `benchmarks/grammar_decode.py`).

``PYTHONPATH=src:benchmarks python benchmarks/grammar_host_cpu.py [--requests 64]
[--repeats 3] [--no-overlap] [--label after] [--out FILE] [--profile]``

A sibling of `benchmarks/host_step_cpu.py` for grammars: the model is ``qwen3-tiny`` with
Qwen3-0.6B's vocabulary (151,936 logits, EOS 151645) and SmolLM2's tokenizer (49,152
tokens, as `grammar_decode.py` uses on the GPU: the rest of the LM head is padded
vocabulary, which xgrammar's ``TokenizerInfo`` lists as special tokens), dummy weights.
The forward is replaced by fixed random logits, so what a step costs here is the host
work the GPU run has to hide behind its forward. The device work of the sampling half
(xgrammar's masking kernel, ~40x slower on the CPU than the whole GPU step, and the
argmax) is timed and subtracted from both figures below.

Runs (each ``--repeats`` times after a warm-up; the same batch of ``--requests`` prompts):
``free`` (greedy, ``ignore_eos``, ``--output-len`` tokens), ``json`` (every request under
`grammar_decode.SCHEMA`) and ``mixed`` (half of them). Per run, over the full-batch decode
steps (before the first request finishes):

* ``step_ms``: median wall time of one ``Engine.step`` (overlap on: the scheduler thread
  waits for the mask worker inside it, so this is the host chain a GPU step must cover);
* ``sched_cpu_ms``: median CPU time of the scheduler thread per step (``time.thread_time``:
  robust to other processes on a shared machine);
* the grammar counters (`GrammarStats`, `BitmaskStats`, `MaskWorker` timings) per step
  and the JSON outputs' validity (`grammar_decode.validate`).

Reported: the median over the repeats of each figure, and ``json_over_free`` of
``step_ms``. ``--out`` appends the rows under ``--label`` to a JSON file.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

from grammar_decode import DEFAULT_TOKENIZER, JSON_MAX_TOKENS, SCHEMA, load_tokenizer, validate

#: Qwen3-0.6B's logits width and EOS (`attnserve.model_loader.dummy`)
VOCAB, EOS = 151936, 151645


def model_dir(tokenizer_dir: str, root: str) -> str:
    """qwen3-tiny with Qwen3-0.6B's vocabulary, and the tokenizer's files."""
    import transformers

    from attnserve.model_loader.dummy import DUMMY_MODEL_CONFIGS

    cfg = dict(DUMMY_MODEL_CONFIGS["qwen3-tiny"], vocab_size=VOCAB, bos_token_id=151643, eos_token_id=EOS)
    transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"], **cfg).save_pretrained(root)
    load_tokenizer(tokenizer_dir).save_pretrained(root)
    return root


class DeviceTimer:
    """Wall and thread-CPU seconds spent in the wrapped calls (the device work)."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.wall += time.perf_counter() - t
                self.cpu += time.thread_time() - c
        return timed


class CandidateSampler:
    """The device work of a step, cheaply: row ``r`` ranks ``K`` random ids of the
    tokenizer (fixed per row) and takes the first its mask allows (greedy over fixed
    logits, restricted to those ids); a masked row where none is allowed takes the lowest
    id its mask allows (e.g. a stop token). Stands for `TokenBitmask._mask` (records the
    masks) and ``argmax_last``, whose CPU versions over 151,936 columns would cost ~60 ms
    a step and evict the host's caches."""

    def __init__(self, n: int, tok_vocab: int, gen: torch.Generator, k: int = 256):
        self.cand = torch.stack([torch.randperm(tok_vocab, generator=gen)[:k] for _ in range(n)])
        self.words, self.bits = self.cand >> 5, self.cand & 31
        self.masked = None  # (mask [n, W] int32, rows) of the current step

    def record_mask(self, _bitmask, logits, mask, indices, rows) -> None:
        self.masked = (mask, [int(r) for r in rows])

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        ids = self.cand[:n, 0].clone()
        if self.masked is not None:
            mask, rows = self.masked
            self.masked = None
            idx = torch.tensor(rows, dtype=torch.int64)
            allowed = (mask[idx.unsqueeze(1), self.words[idx]] >> self.bits[idx]) & 1
            first = allowed.argmax(1)
            for j, r in enumerate(rows):
                if allowed[j, first[j]]:
                    ids[r] = self.cand[r, first[j]]
                else:  # the lowest allowed id
                    w = int(torch.nonzero(mask[r])[0])
                    word = int(mask[r, w]) & 0xFFFFFFFF
                    ids[r] = 32 * w + ((word & -word).bit_length() - 1)
        return ids


class VirtualGPU:
    """A one-stream device timeline for ``--gpu-ms``: each forward takes ``forward_s`` and
    each sampling ``sample_s`` (+ ``mask_s`` when it masks rows), starting when enqueued or
    when the stream is free; reading a step's ids (`Scheduler._pending_ids`) sleeps until
    its sampling has completed, as ``event.synchronize()`` does on a GPU. Times are on the
    host clock minus the stub device work's wall time (`DeviceTimer`), which a GPU would run
    asynchronously."""

    def __init__(self, dev: DeviceTimer, forward_s: float, sample_s: float, mask_s: float):
        self.dev, self.forward_s, self.sample_s, self.mask_s = dev, forward_s, sample_s, mask_s
        self.free_at = 0.0
        self.ready = {}  # id(ids tensor) -> completion time of its sampling

    def now(self) -> float:
        return time.perf_counter() - self.dev.wall

    def enqueue(self, seconds: float, at: Optional[float] = None) -> float:
        """Enqueue ``seconds`` of work at ``at`` (default: now); its completion time."""
        self.free_at = max(self.now() if at is None else at, self.free_at) + seconds
        return self.free_at

    def wait_ids(self, ids) -> None:
        done = self.ready.pop(id(ids), None)
        left = 0.0 if done is None else done - self.now()
        if left > 0:
            time.sleep(left)


def timed_run(llm, prompts, params, dev: DeviceTimer) -> Dict:
    """One batch to completion with ``Engine.step``; the full-batch decode steps timed."""
    engine, sched = llm.engine, llm.engine.scheduler
    g = sched.grammar
    c0 = (g.stats.early_syncs, g.stats.background_fills)
    b0 = (g.bitmask.stats.fill_seconds, g.bitmask.stats.steps) if g.bitmask is not None else (0.0, 0)
    w0 = vars(g.worker.stats).copy() if g.worker is not None and hasattr(g.worker, "stats") else None
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    n = len(reqs)
    walls: List[float] = []
    cpus: List[float] = []
    while any(not r.finished for r in reqs):
        decode0 = sched.stats.num_decode_steps
        full = all(not r.finished for r in reqs) and len(sched.running) == n
        dw, dc = dev.wall, dev.cpu
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - t - (dev.wall - dw), time.thread_time() - c - (dev.cpu - dc)
        if full and sched.stats.num_decode_steps == decode0 + 1 and all(not r.finished for r in reqs):
            walls.append(wall)
            cpus.append(cpu)
    sched.flush()
    outs = [(r.text, r.finish_reason.value, list(r.output_ids)) for r in reqs]
    for r in reqs:
        sched.forget(r.rid)
    steady = slice(2, None) if len(walls) > 6 else slice(None)
    walls, cpus = walls[steady], cpus[steady]
    row = {"full_batch_steps": len(walls),
           "step_ms": 1e3 * statistics.median(walls) if walls else None,
           "sched_cpu_ms": 1e3 * statistics.median(cpus) if cpus else None,
           "early_syncs": g.stats.early_syncs - c0[0], "background_fills": g.stats.background_fills - c0[1]}
    if g.bitmask is not None:
        masked = max(g.bitmask.stats.steps - b0[1], 1)
        row["fill_ms_per_masked_step"] = 1e3 * (g.bitmask.stats.fill_seconds - b0[0]) / masked
        if w0 is not None:  # the mask worker's wall ms per masked step (absent before it had stats)
            w1 = vars(g.worker.stats)
            for k in ("accept_seconds", "queue_seconds"):
                row[k.replace("_seconds", "_ms_per_masked_step")] = 1e3 * (w1[k] - w0[k]) / masked
    cons = [o for o, p in zip(outs, params) if p.json_schema is not None]
    if cons:
        row["validity"] = validate(cons, SCHEMA)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-overlap", action="store_true", help="overlap scheduling off (on by default here)")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    ap.add_argument("--runs", nargs="+", default=["free", "json", "mixed"])
    ap.add_argument("--gpu-ms", type=float, default=0.0,
                    help="simulate a GPU stream whose forward takes this long (e.g. 2.0: Qwen3-0.6B, 64 rows, "
                         "H200); step_ms is then the pipeline's period (0: off, the host chain alone)")
    ap.add_argument("--sample-ms", type=float, default=0.06, help="with --gpu-ms: a step's sampling on the GPU")
    ap.add_argument("--mask-ms", type=float, default=0.06,
                    help="with --gpu-ms: a masked step's extra GPU time (mask upload + masking kernel)")
    ap.add_argument("--profile", action="store_true", help="cProfile of one extra json run (scheduler thread)")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)

    from attnserve import LLM, SamplingParams
    from attnserve.engine import step_sampling
    from attnserve.engine.constrained import bitmask

    torch.set_num_threads(1)
    n = args.requests
    with tempfile.TemporaryDirectory() as root:
        llm = LLM(model_dir(args.tokenizer, root), load_format="dummy", device="cpu", max_running_requests=n,
                  context_length=args.input_len + JSON_MAX_TOKENS + 16,
                  max_total_tokens=n * (args.input_len + JSON_MAX_TOKENS + 16),
                  chunked_prefill_size=n * args.input_len, disable_overlap_schedule=args.no_overlap)
    dev = DeviceTimer()
    sampler = CandidateSampler(n, len(llm.tokenizer), torch.Generator().manual_seed(1))
    logits = torch.empty(n, VOCAB)  # never read: the stub sampler below stands for the device work
    runner = llm.engine.model_runner
    gpu = VirtualGPU(dev, args.gpu_ms * 1e-3, args.sample_ms * 1e-3, args.mask_ms * 1e-3) if args.gpu_ms else None

    def forward(fb, *a, **k):
        if gpu is not None:
            gpu.enqueue(gpu.forward_s)
        return logits[: fb.batch_size] if fb.batch_size <= n else torch.empty(fb.batch_size, VOCAB)

    def argmax(x):
        masked, at = sampler.masked is not None, gpu.now() if gpu is not None else None
        ids = sampler.argmax(x)  # host work standing for the device's: enqueued at its start
        if gpu is not None:
            gpu.ready[id(ids)] = gpu.enqueue(gpu.sample_s + (gpu.mask_s if masked else 0.0), at)
        return ids

    runner.forward = dev.wrap(forward)
    step_sampling.argmax_last = dev.wrap(argmax)
    bitmask.TokenBitmask._mask = dev.wrap(sampler.record_mask)
    if gpu is not None:
        sched = llm.engine.scheduler
        real_pending_ids = sched._pending_ids

        def pending_ids(launched):
            if launched.ids is None:
                gpu.wait_ids(launched.next_ids_host)
            return real_pending_ids(launched)

        sched._pending_ids = pending_ids

    gen = torch.Generator().manual_seed(0)
    tok_vocab = len(llm.tokenizer)
    prompts = [torch.randint(10, tok_vocab, (args.input_len,), generator=gen).tolist() for _ in range(n)]
    free = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    cons = SamplingParams(max_new_tokens=JSON_MAX_TOKENS, temperature=0.0, json_schema=SCHEMA)
    kinds = {"free": [free] * n, "json": [cons] * n, "mixed": [cons, free] * (n // 2) + [free] * (n % 2)}
    timed_run(llm, prompts[:8], [cons] * 4 + [free] * 4, dev)  # warm-up: schema compiled, workers started
    result: Dict[str, Dict] = {}
    for name in args.runs:
        rows = [timed_run(llm, prompts, kinds[name], dev) for _ in range(args.repeats)]
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float))]
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        med["min_step_ms"] = min(r["step_ms"] for r in rows)  # the least disturbed run
        med["valid"] = [r["validity"]["valid"] for r in rows if "validity" in r]
        med["errors"] = [e for r in rows if "validity" in r for e in r["validity"]["errors"]][:3]
        med["repeats"] = rows
        result[name] = med
        print(f"{name:5s} step {med['step_ms']:.3f} ms (min {med['min_step_ms']:.3f}), "
              f"sched cpu {med['sched_cpu_ms']:.3f} ms, "
              + ", ".join(f"{k} {med[k]:.3f}" for k in keys if k not in ("step_ms", "sched_cpu_ms"))
              + (f", valid {med['valid']}/{n}" if med["valid"] else ""), flush=True)
    if "free" in result and "json" in result:
        result["json_over_free"] = result["json"]["step_ms"] / result["free"]["step_ms"]
        print(f"json/free step {result['json_over_free']:.3f}", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        timed_run(llm, prompts, kinds["json"], dev)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats("attnserve|xgrammar|torch", 40)
        print(text.getvalue())
    llm.shutdown()
    if args.out:
        data = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                data = json.load(f)
        import xgrammar  # noqa: F401
        from importlib.metadata import version

        data.update(benchmark="grammar_host_cpu", date=dt.date.today().isoformat(),
                    device=f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                           "1 torch thread)",
                    versions={"python": platform.python_version(), "torch": torch.__version__,
                              "xgrammar": version("xgrammar")})
        data.setdefault("rows", {})[args.label] = {
            "command": "PYTHONPATH=src:benchmarks python benchmarks/grammar_host_cpu.py " + " ".join(argv),
            "requests": n, "overlap": not args.no_overlap,
            "virtual_gpu_ms": {"forward": args.gpu_ms, "sample": args.sample_ms, "mask": args.mask_ms}
            if args.gpu_ms else None, "vocab": VOCAB, "tokenizer_vocab": tok_vocab, **result}
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
