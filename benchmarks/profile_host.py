"""Where the host's time goes per engine step once the batch is large (issue 33, item 4).

``PYTHONPATH=src python benchmarks/profile_host.py [--model qwen3-0.6b] [--num-prompts 256]
[--random-input-len 1024] [--random-output-len 1024] [--random-range-ratio 0.098] [--out DIR]``

Builds the engine with default flags (dummy weights, CUDA), runs SGLang's random workload
once to warm up, then runs it again under ``cProfile`` and writes the functions with the
most own time and the most cumulative time (``<out>/profile_host.txt``) and a JSON with the
wall time, the scheduler's host ms per decode step and the share of wall time in a few
buckets (scheduling, sampling, detokenization, radix cache, waiting on the GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import os
import pstats
import time

import torch

from attnserve.bench.offline_random import _prompts
from attnserve.bench.results import write_result
from attnserve.bench.roofline import random_lengths

#: substrings of "file:function" that put a function's own time in a bucket
BUCKETS = {
    "wait_gpu": ("synchronize", "cudaEventSynchronize", "method 'item'", "method 'tolist'", "method 'cpu'"),
    "detokenize": ("detokenizer", "decode", "tokenizers"),
    "radix_cache": ("radix_cache", "prefix_cache"),
    "sampling": ("sampler",),
    "step_inputs": ("step_inputs", "forward_batch"),
    "scheduler": ("scheduler", "schedule_batch", "schedule_policy", "request.py"),
    "model_runner": ("model_runner", "cuda_graph_runner"),
}


def bucket_times(stats: pstats.Stats) -> dict:
    """Own time per bucket (first matching bucket wins), seconds."""
    out = {k: 0.0 for k in BUCKETS}
    out["other"] = 0.0
    for (file, _line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        key = f"{file}:{func}"
        for name, subs in BUCKETS.items():
            if any(s in key for s in subs):
                out[name] += tt
                break
        else:
            out["other"] += tt
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=1024)
    ap.add_argument("--random-range-ratio", type=float, default=0.098)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)

    from attnserve import LLM, SamplingParams
    from attnserve.engine.scheduler import SchedulerStats

    llm = LLM(args.model, load_format="dummy", device="cuda")
    isl, osl = random_lengths(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, 0)
    vocab = llm.engine.model_config.vocab_size
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in osl]
    llm.generate(_prompts(vocab, isl, 1), params)  # warm-up, other prompts
    llm.engine.scheduler.flush_prefix_cache()
    llm.engine.scheduler.stats = SchedulerStats()
    prompts = _prompts(vocab, isl, 0)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_host.txt"), "w") as f:
        f.write(text.getvalue())
    s = llm.engine.scheduler.stats
    buckets = bucket_times(stats)
    import triton

    result = {"benchmark": "profile_host", "date": dt.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "model": args.model,
              "num_prompts": args.num_prompts, "wall_s_profiled": wall, "decode_steps": s.num_decode_steps,
              "host_ms_per_decode_step": s.host_ms_per_decode_step,
              "limits": vars(llm.engine.model_runner.serving_limits) if hasattr(
                  llm.engine.model_runner.serving_limits, "__dict__") else str(llm.engine.model_runner.serving_limits),
              "own_seconds_by_bucket": buckets}
    print({k: round(v, 3) for k, v in buckets.items()}, f"wall {wall:.2f} s", flush=True)
    write_result(result, args.out, "profile-host", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
