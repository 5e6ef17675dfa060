"""Where a decode step's wall time goes in the running engine: GPU busy vs idle, per engine step.

GPU command (one H100, default engine flags; the two shapes take about 2-3 minutes, most of it
the four passes of the workload per shape: warm-up, unprofiled prefill and full passes, profiled
pass; ``--no-baseline`` drops the two unprofiled ones)::

    PYTHONPATH=src python benchmarks/profile_engine_gaps.py --models llama-3-8b qwen3-0.6b \\
        --num-prompts 256 --random-input-len 1024 --random-output-len 1024 \\
        --random-range-ratio 0.098 --decode-window 400 60 --prefill-window 0 20 --out $OUT

Engine flags pass through as in ``bench.offline --dataset random`` (``--kv-cache-dtype fp8_e4m3``,
``--quantization fp8``, ``--max-running-requests``, ``--cuda-graph-max-bs``,
``--chunked-prefill-size``, ``--disable-radix-cache``, ``--disable-overlap-schedule``); without them
the engine's defaults apply. ``--keep-traces`` also writes the gzipped Chrome traces (Perfetto).

Per model shape: the engine is built as `attnserve.bench.offline_random.bench_random` builds it
(dummy weights), `run_random_workload` warms it up and times the workload unprofiled (the
baseline: wall, decode steps, host ms per step; ``--no-baseline``: warm-up only), then the same
timed workload runs again through ``LLM.generate`` with `EngineProbe` installed, which records
two windows of engine steps (counted from the start of that run) under ``torch.profiler``
(CPU + CUDA activity): a prefill-heavy one (``--prefill-window START N``, the first steps) and
one inside decode (``--decode-window START N``). `attnserve.bench.engine_gaps.analyse` turns
each trace into per-step wall / GPU busy / idle / launched kernel time / gaps, and a window
summary (idle share, idle by gap kind and by cause, largest gaps, device time per kernel class,
host time per phase). On CUDA the engine's decode graph is then replayed alone at the decode
window's mean batch and mean context (`attnserve.bench.offline.graph_step_ms`): the step's
kernels at that shape with no engine around them. The host wall of the unprofiled steps next
to each window (``--neighbours``, from ``time.perf_counter`` at each step start) and of every
unprofiled decode step of the profiled pass shows how much the profiler slowed the window.

Reading it: ``step wall - busy`` is the GPU idle time per step. ``in_graph`` idle is between
kernels of one graph replay (kernel boundaries); ``between_launches`` idle waits on the host,
named by the phase that launched the work ending the gap (``resumed_by``) and what the host was
in when the GPU ran dry. If busy ~ wall and busy > the isolated replay, the difference is the
kernels themselves (longer or ragged contexts), not the engine loop.

Writes ``<out>/<device>-profile-engine-gaps[-<tag>]-<date>.json``. On a CPU engine (tests)
the main thread's CPU ops stand in for the device timeline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import os
import shutil
import sys
import tempfile
import time

import torch

from attnserve.bench.engine_gaps import analyse, format_summary, load_trace
from attnserve.bench.engine_probe import EngineProbe, ProfileWindow
from attnserve.bench.offline_random import _prompts, run_random_workload
from attnserve.bench.results import write_result
from attnserve.bench.roofline import random_lengths
from attnserve.mem_cache.kv_quant import KV_CACHE_DTYPES


def _graph_replay(llm, summary: dict) -> dict:
    """The decode graph replayed alone at the mean batch and context of the window's decode
    steps (CUDA only)."""
    from attnserve.bench.offline import graph_step_ms

    runner = llm.engine.model_runner
    bs = max(1, round(summary["decode_mean_batch"]))
    ctx = max(1, round(summary["decode_mean_context_per_req"]) - 1)  # + the decode token = the KV length
    gr = runner.cuda_graph_runner
    if gr is None or not gr.graphs or bs > gr.max_bs:
        return {"batch": bs, "context": ctx, "graph_replay_ms": None, "note": "no captured graph for this batch"}
    if bs * (ctx + 1) > runner.token_to_kv_pool_allocator.available_size():
        return {"batch": bs, "context": ctx, "graph_replay_ms": None, "note": "the pool cannot hold the batch"}
    try:
        return {"batch": bs, "context": ctx, "graph_replay_ms": graph_step_ms(runner, bs, ctx)}
    except Exception as e:  # report, keep the other results
        return {"batch": bs, "context": ctx, "graph_replay_ms": None, "note": f"{type(e).__name__}: {e}"}


def unprofiled_steps(probe: EngineProbe, steps, mode=None) -> dict:
    """Mean host wall per step (``step_starts`` differences, ms) and mean batch of the engine
    steps ``steps`` that no window recorded (and of forward mode ``mode`` when given)."""
    recorded = {i for w in probe.windows for i in w.recorded}
    t = probe.step_starts
    walls, batches = [], []
    for i in steps:
        info = probe.infos.get(i)
        if 0 <= i < len(t) - 1 and i not in recorded and (mode is None or (info and info.mode == mode)):
            walls.append(t[i + 1] - t[i])
            batches.append(info.batch_size if info else 0)
    n = len(walls)
    return {"steps": n, "mean_wall_ms": 1e3 * sum(walls) / n if n else None,
            "mean_batch": sum(batches) / n if n else None}


def profile_model(model: str, args, flags: dict, trace_dir: str) -> dict:
    """One model shape: baseline, profiled run, window reports (module doc)."""
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.engine.scheduler import SchedulerStats

    device = args.device
    isl, osl = random_lengths(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.seed)
    llm = LLM(model, load_format=args.load_format, device=device, kv_cache_dtype=args.kv_cache_dtype, **flags)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        runner = llm.engine.model_runner
        sched = llm.engine.scheduler
        vocab = llm.engine.model_config.vocab_size
        t0 = time.perf_counter()
        if args.no_baseline:  # run_random_workload's warm-up alone
            llm.generate(_prompts(vocab, isl, args.seed + 1),
                         [SamplingParams(max_new_tokens=min(n, args.warmup_output_len), temperature=0.0,
                                         ignore_eos=True) for n in osl])
            baseline = None
        else:
            baseline = run_random_workload(llm, isl, osl, args.seed, args.warmup_output_len)
        baseline_s = time.perf_counter() - t0
        windows = [ProfileWindow("prefill", args.prefill_window[0], args.prefill_window[1], args.lead, args.tail),
                   ProfileWindow("decode", args.decode_window[0], args.decode_window[1], args.lead, args.tail)]
        prompts = _prompts(vocab, isl, args.seed)
        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in osl]
        probe = EngineProbe(llm.engine, windows, os.path.join(trace_dir, model)).install()
        try:
            sched.flush_prefix_cache()
            sched.stats = SchedulerStats()
            sync()
            t1 = time.perf_counter()
            probe.arm()
            outs = llm.generate(prompts, params)
            probe.finish()
            sync()
            profiled_wall = time.perf_counter() - t1
        finally:
            probe.uninstall()
        if sum(len(o.token_ids) for o in outs) != sum(osl):
            raise RuntimeError("the profiled run generated a different number of tokens (ignore_eos)")
        stats = sched.stats
        sched.flush_prefix_cache()
        limits = runner.serving_limits
        row = {
            "model": model, "kv_cache_dtype": str(runner.kv_cache_dtype).replace("torch.", ""), "flags": flags,
            "num_prompts": args.num_prompts, "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
            "seed": args.seed, "max_total_tokens": limits.max_total_tokens,
            "max_running_requests": limits.max_running_requests, "chunked_prefill_size": limits.chunked_prefill_size,
            "cuda_graph_max_bs": limits.cuda_graph_max_bs, "overlap": sched.overlap, "baseline": baseline,
            "baseline_phase_s": baseline_s, "profiled_wall_s": profiled_wall,
            "profiled_engine_steps": probe.step_index, "profiled_decode_steps": stats.num_decode_steps,
            "profiled_host_ms_per_step": stats.host_ms_per_decode_step, "windows": {},
            "unprofiled_decode_steps": unprofiled_steps(probe, range(probe.step_index), "decode"),
        }
        if baseline is not None:
            print(f"{model}: baseline wall {baseline['wall_s']:.2f} s (prefill pass "
                  f"{baseline['prefill_wall_s']:.2f} s),"
                  f" {baseline['decode_steps']} decode steps, batch {baseline['mean_decode_batch']:.1f}, host "
                  f"{baseline['host_ms_per_step']:.2f} ms/step; profiled run {profiled_wall:.2f} s, "
                  f"{probe.step_index} engine steps", flush=True)
        ud = row["unprofiled_decode_steps"]
        if ud["steps"]:
            print(f"{model}: profiled run, decode steps outside the windows: {ud['steps']}, "
                  f"{ud['mean_wall_ms']:.3f} ms/step, batch {ud['mean_batch']:.1f}", flush=True)
        for w in windows:
            entry = {"start": w.start, "num_steps": w.num_steps, "recorded_steps": len(w.recorded)}
            if w.trace_path is None or not any(w.start <= i < w.start + w.num_steps for i in w.recorded):
                entry["note"] = f"not reached: the run had {probe.step_index} engine steps"
                print(f"{model} [{w.name}]: {entry['note']}", flush=True)
                row["windows"][w.name] = entry
                continue
            rep = analyse(load_trace(w.trace_path), probe.infos, w.start, w.start + w.num_steps)
            entry.update(reported_steps=len(rep.steps), summary=rep.summary, steps=rep.steps)
            near = [*range(w.first_recorded - args.neighbours, w.first_recorded),
                    *range(w.last_recorded + 1, w.last_recorded + 1 + args.neighbours)]
            entry["unprofiled_neighbours"] = nb = unprofiled_steps(probe, near)
            print(format_summary(f"{model} [{w.name} steps {w.start}..{w.start + w.num_steps - 1}]", rep.summary),
                  flush=True)
            if nb["steps"]:
                print(f"   unprofiled neighbour steps ({nb['steps']}, batch {nb['mean_batch']:.1f}): host wall "
                      f"{nb['mean_wall_ms']:.3f} ms/step (window, profiled: {rep.summary['mean_wall_ms']:.3f})",
                      flush=True)
            if rep.summary["launch_attributed_share"] < 0.9:
                print(f"   warning: only {100 * rep.summary['launch_attributed_share']:.0f}% of the device activity "
                      "is linked to its launch call (no 'correlation' arg in the trace?): idle causes are partial",
                      flush=True)
            if device == "cuda" and rep.summary["decode_steps"]:
                entry["graph_replay"] = g = _graph_replay(llm, rep.summary)
                ms = g["graph_replay_ms"]
                print(f"   decode graph alone at batch {g['batch']} x context {g['context']}: "
                      f"{'n/a (' + g['note'] + ')' if ms is None else f'{ms:.3f} ms'}; in the engine (decode steps): "
                      f"wall {rep.summary['decode_mean_wall_ms']:.3f} ms, busy {rep.summary['decode_mean_busy_ms']:.3f}"
                      " ms", flush=True)
            if args.keep_traces:
                dst = os.path.join(args.out, f"trace-{model}-{w.name}.json.gz")
                os.makedirs(args.out, exist_ok=True)
                with open(w.trace_path, "rb") as src, gzip.open(dst, "wb") as out:
                    shutil.copyfileobj(src, out)
                entry["trace"] = dst
            row["windows"][w.name] = entry
        return row
    finally:
        llm.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "qwen3-0.6b"], help="dummy model shapes")
    ap.add_argument("--load-format", default="dummy", choices=["dummy", "auto"])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=1024)
    ap.add_argument("--random-range-ratio", type=float, default=0.098)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-output-len", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--decode-window", type=int, nargs=2, default=[400, 60], metavar=("START", "N"),
                    help="engine steps START..START+N-1 of the profiled run")
    ap.add_argument("--prefill-window", type=int, nargs=2, default=[0, 20], metavar=("START", "N"))
    ap.add_argument("--lead", type=int, default=5, help="profiler started this many steps before a window")
    ap.add_argument("--tail", type=int, default=2, help="and stopped this many steps after it")
    ap.add_argument("--neighbours", type=int, default=20,
                    help="unprofiled steps each side of a window whose wall is reported for comparison")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unprofiled timed run (warm-up only)")
    ap.add_argument("--keep-traces", action="store_true", help="write the gzipped Chrome traces under --out")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="suffix of the result file's kind")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    flags = {k: v for k, v in dict(quantization=args.quantization, max_running_requests=args.max_running_requests,
                                   cuda_graph_max_bs=args.cuda_graph_max_bs,
                                   chunked_prefill_size=args.chunked_prefill_size).items() if v is not None}
    if args.disable_radix_cache:
        flags["disable_radix_cache"] = True
    if args.disable_overlap_schedule:
        flags["disable_overlap_schedule"] = True
    t0 = time.perf_counter()
    result = {"benchmark": "profile_engine_gaps", "date": dt.date.today().isoformat(), "torch": torch.__version__,
              "args": vars(args), "argv": sys.argv[1:] if argv is None else list(argv), "rows": []}
    if args.device == "cuda":
        import triton
        import transformers

        result.update(device=torch.cuda.get_device_name(), triton=triton.__version__, cuda=torch.version.cuda,
                      transformers=transformers.__version__)
    else:
        import platform

        result.update(device="cpu", cpu=platform.processor() or platform.machine())
    with tempfile.TemporaryDirectory(prefix="engine-gaps-") as trace_dir:
        for m in args.models:
            result["rows"].append(profile_model(m, args, flags, trace_dir))
    result["total_s"] = time.perf_counter() - t0
    kind = "profile-engine-gaps" + (f"-{args.tag}" if args.tag else "")
    write_result(result, args.out, kind, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
