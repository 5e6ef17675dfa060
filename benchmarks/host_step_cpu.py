"""Host time per decode step at a large batch, measured on the CPU (issue 33, item 4).

``PYTHONPATH=src python benchmarks/host_step_cpu.py [--num-prompts 512] [--input-len 16]
[--output-len 64] [--repeats 3] [--overlap] [--profile] [--label before] [--out FILE]``

Builds ``llama-tiny`` (dummy weights, CPU), sends ``--num-prompts`` requests of the same
lengths at once (greedy, ``ignore_eos``) so that every decode step runs the whole batch,
and times `Scheduler.step`. On the CPU the forward runs synchronously inside the step, so
the model's forward (`ModelRunner.forward`) and the greedy argmax are timed apart and
subtracted: what is left is the host bookkeeping a GPU step pays on the scheduler thread
(batch selection, input layout, slot allocation, ``req_to_token`` writes, sampling set-up,
appending tokens, stop checks, freeing), which is what this benchmark is for.

Reported per decode step (median over ``--repeats`` runs, one warm-up run first; ``min_*``:
the least disturbed run):
``host_ms_per_decode_step`` (the scheduler's own counter, forward included on the CPU),
``forward_ms_per_decode_step``, ``bookkeeping_ms_per_decode_step`` (the difference) and
``bookkeeping_us_per_request`` (divided by the mean decode batch), and the same two from the
scheduler thread's CPU time (``time.thread_time``: ``bookkeeping_cpu_ms_per_decode_step``,
``bookkeeping_cpu_us_per_request``), which other processes on a shared machine disturb far
less than wall time (one torch thread, so the forward's CPU time is the thread's own). ``--forward stub`` (the
default) replaces the forward by fixed logits, so the K/V pool is never written and only the
bookkeeping is timed (the least noisy figure on a shared machine); ``--forward real`` runs
the model and subtracts its time. ``--profile`` writes
cProfile's top functions of one extra run to stdout. ``--out`` appends the row under
``--label`` to a JSON file (created when missing).
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
import time


def _run_once(llm, prompts, params, timers) -> dict:
    from attnserve.engine.scheduler import SchedulerStats

    sched = llm.engine.scheduler
    sched.flush_prefix_cache()
    sched.stats = SchedulerStats()
    for k in timers:
        timers[k] = 0.0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s = sched.stats
    tokens = sum(len(o.token_ids) for o in outs)
    steps = max(s.num_decode_steps, 1)
    host_ms = s.host_ms_per_decode_step
    fwd_ms = 1e3 * timers["decode_forward"] / steps
    cpu_ms = 1e3 * (timers["decode_step_cpu"] - timers["decode_forward_cpu"]) / steps
    batch = (tokens - len(outs)) / steps  # the first token of each request comes from its prefill
    return {"wall_s": wall, "decode_steps": s.num_decode_steps, "mean_decode_batch": batch,
            "host_ms_per_decode_step": host_ms, "forward_ms_per_decode_step": fwd_ms,
            "bookkeeping_ms_per_decode_step": host_ms - fwd_ms,
            "bookkeeping_us_per_request": 1e3 * (host_ms - fwd_ms) / max(batch, 1e-9),
            "bookkeeping_cpu_ms_per_decode_step": cpu_ms,
            "bookkeeping_cpu_us_per_request": 1e3 * cpu_ms / max(batch, 1e-9),
            "output_tokens": tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-running-requests", type=int, default=None, help="default: --num-prompts")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool tokens (default: every request's prompt + output, so none waits)")
    ap.add_argument("--forward", choices=("stub", "real"), default="stub",
                    help="stub: the forward returns fixed logits (only the host bookkeeping is left); "
                         "real: the tiny model runs and its time is subtracted")
    ap.add_argument("--overlap", action="store_true", help="overlap scheduling (off by default on the CPU)")
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from attnserve import LLM, SamplingParams
    from attnserve.engine import step_sampling

    torch.set_num_threads(1)
    n = args.num_prompts
    llm = LLM(args.model, load_format="dummy", device="cpu", max_running_requests=args.max_running_requests or n,
              max_total_tokens=args.max_total_tokens or n * (args.input_len + args.output_len + 8),
              chunked_prefill_size=n * args.input_len,
              disable_overlap_schedule=not args.overlap, disable_radix_cache=args.disable_radix_cache)
    runner = llm.engine.model_runner
    timers = {"forward": 0.0, "decode_forward": 0.0, "decode_forward_cpu": 0.0, "decode_step_cpu": 0.0}
    real_forward = runner.forward
    real_argmax = step_sampling.argmax_last

    vocab = llm.engine.model_config.vocab_size
    fixed = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))

    def stub_forward(fb, *a, **k):  # fixed logits: the K/V pool and the model are left alone
        return fixed[: fb.batch_size] if fb.batch_size <= n else torch.zeros(fb.batch_size, vocab)

    inner = real_forward if args.forward == "real" else stub_forward

    def timed_forward(fb, *a, **k):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return inner(fb, *a, **k)
        finally:
            dt_ = time.perf_counter() - t
            timers["forward"] += dt_
            if fb.forward_mode.is_decode():
                timers["decode_forward"] += dt_
                timers["decode_forward_cpu"] += time.thread_time() - c

    def timed_argmax(logits):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return real_argmax(logits)
        finally:
            if logits.shape[0] > 1:  # decode steps and prefill both; counted with the forward
                timers["decode_forward"] += time.perf_counter() - t
                timers["decode_forward_cpu"] += time.thread_time() - c

    sched = llm.engine.scheduler
    real_step = sched.step

    def timed_step():  # CPU time of the scheduler thread: robust to other processes on the machine
        before, c = sched.stats.num_decode_steps, time.thread_time()
        try:
            return real_step()
        finally:
            if sched.stats.num_decode_steps > before:
                timers["decode_step_cpu"] += time.thread_time() - c

    sched.step = timed_step

    runner.forward = timed_forward
    step_sampling.argmax_last = timed_argmax
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(n)]
    params = [SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True) for _ in range(n)]
    _run_once(llm, prompts, params, timers)  # warm-up
    rows = [_run_once(llm, prompts, params, timers) for _ in range(args.repeats)]
    keys = [k for k in rows[0] if k != "decode_steps"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    med["decode_steps"] = rows[0]["decode_steps"]
    for k in ("bookkeeping_ms_per_decode_step", "bookkeeping_cpu_ms_per_decode_step", "bookkeeping_cpu_us_per_request"):
        med["min_" + k] = min(r[k] for r in rows)  # the least disturbed run
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in med.items()}), flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        _run_once(llm, prompts, params, timers)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        print(text.getvalue())
    if args.out:
        data = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                data = json.load(f)
        data.setdefault("benchmark", "host_step_cpu")
        data["date"] = dt.date.today().isoformat()
        data["device"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 torch thread)"
        data["versions"] = {"python": platform.python_version(), "torch": torch.__version__}
        data["command"] = "PYTHONPATH=src python benchmarks/host_step_cpu.py " + " ".join(argv or [])
        data.setdefault("rows", {})[args.label] = {"forward": args.forward, "overlap": args.overlap,
                                                    "max_running_requests": args.max_running_requests,
                                                    "max_total_tokens": args.max_total_tokens, "num_prompts": n,
                                                    "input_len": args.input_len, "output_len": args.output_len,
                                                    "repeats": [{k: r[k] for k in rows[0]} for r in rows], **med}
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
