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

Mixed lengths and a capped pool (issue 38's 1,024-prompt workload): ``--random-range-ratio R``
draws input lengths uniform in ``[R * input_len, input_len]`` and output lengths in
``[R * output_len, output_len]`` (`attnserve.bench.roofline.random_lengths`, ``--seed``), and
``--max-total-tokens`` caps the KV pool so that requests wait and are admitted as others
finish. The row then also gives ``decode_steps_waiting`` (decode steps that began with requests
waiting) and the thread CPU ms of a step by phase (``step_cpu_ms_waiting`` /
``step_cpu_ms_no_waiting``, stub forward included, with the mean batch of each), and
``decode_steps_over_graph_bs``: decode steps whose batch exceeds ``--graph-max-bs``, which
run eagerly (every kernel launched from Python) on a GPU whose graphs stop there. Example,
the Llama-3-8B H200 limits of that workload (pool 898,369 tokens, 1,024 running requests,
16,384-token chunks, graphs up to 512):
``--num-prompts 1024 --input-len 1024 --output-len 1024 --random-range-ratio 0.098
--max-total-tokens 898369 --max-running-requests 1024 --chunked-prefill-size 16384
--graph-max-bs 512 --repeats 1``.
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


def _run_once(llm, prompts, params, timers, step_log, graph_max_bs=0) -> dict:
    from attnserve.engine.scheduler import SchedulerStats

    sched = llm.engine.scheduler
    sched.flush_prefix_cache()
    sched.stats = SchedulerStats()
    sched.new_token_ratio = sched.policy.init_ratio  # each run admits as the first did
    for k in timers:
        timers[k] = 0.0
    step_log.clear()
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
            "output_tokens": tokens, **_phases(step_log, graph_max_bs)}


def _phases(step_log, graph_max_bs: int) -> dict:
    """Decode steps split by whether requests were waiting when they began (``step_log``:
    ``(waiting, running, cpu_s)`` per decode step)."""
    out = {"decode_steps_waiting": sum(1 for w, _, _ in step_log if w)}
    for name, sel in (("waiting", [x for x in step_log if x[0]]), ("no_waiting", [x for x in step_log if not x[0]])):
        out[f"step_cpu_ms_{name}"] = 1e3 * sum(c for _, _, c in sel) / max(len(sel), 1)
        out[f"mean_running_{name}"] = sum(r for _, r, _ in sel) / max(len(sel), 1)
    if graph_max_bs:
        out["decode_steps_over_graph_bs"] = sum(1 for _, r, _ in step_log if r > graph_max_bs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--random-range-ratio", type=float, default=None,
                    help="lengths uniform in [R*len, len] (seeded; default: every request --input-len/--output-len)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="default: every prompt in one chunk")
    ap.add_argument("--graph-max-bs", type=int, default=0,
                    help="count the decode steps whose batch exceeds this (eager on a GPU with graphs up to it)")
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
    if args.random_range_ratio is None:
        in_lens, out_lens = [args.input_len] * n, [args.output_len] * n
    else:
        from attnserve.bench.roofline import random_lengths

        in_lens, out_lens = random_lengths(n, args.input_len, args.output_len, args.random_range_ratio, args.seed)
    llm = LLM(args.model, load_format="dummy", device="cpu", max_running_requests=args.max_running_requests or n,
              max_total_tokens=args.max_total_tokens or sum(in_lens) + sum(out_lens) + 8 * n,
              chunked_prefill_size=args.chunked_prefill_size or sum(in_lens),
              **({} if args.random_range_ratio is None
                 else {"context_length": max(map(sum, zip(in_lens, out_lens))) + 8}),
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

    step_log = []

    def timed_step():  # CPU time of the scheduler thread: robust to other processes on the machine
        before, c = sched.stats.num_decode_steps, time.thread_time()
        waiting, running = bool(sched.waiting), len(sched.running)
        try:
            return real_step()
        finally:
            if sched.stats.num_decode_steps > before:
                cpu = time.thread_time() - c
                timers["decode_step_cpu"] += cpu
                step_log.append((waiting, running, cpu))

    sched.step = timed_step

    runner.forward = timed_forward
    step_sampling.argmax_last = timed_argmax
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in in_lens]
    params = [SamplingParams(max_new_tokens=k, temperature=0.0, ignore_eos=True) for k in out_lens]
    run = lambda: _run_once(llm, prompts, params, timers, step_log, args.graph_max_bs)  # noqa: E731
    run()  # warm-up
    rows = [run() for _ in range(args.repeats)]
    keys = [k for k in rows[0] if k != "decode_steps"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    med["decode_steps"] = rows[0]["decode_steps"]
    for k in ("bookkeeping_ms_per_decode_step", "bookkeeping_cpu_ms_per_decode_step", "bookkeeping_cpu_us_per_request",
              "step_cpu_ms_waiting", "step_cpu_ms_no_waiting"):
        med["min_" + k] = min(r[k] for r in rows)  # the least disturbed run
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in med.items()}), flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run()
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
                                                    "random_range_ratio": args.random_range_ratio, "seed": args.seed,
                                                    "chunked_prefill_size": args.chunked_prefill_size,
                                                    "repeats": [{k: r[k] for k in rows[0]} for r in rows], **med}
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
