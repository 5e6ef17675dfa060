"""Where a mixed workload's prefill time goes on a small model (issue 33: the Qwen3-0.6B
shape's prefill share of the roofline was 0.32 on the H100).

``PYTHONPATH=src python benchmarks/profile_prefill.py [--model qwen3-0.6b] [--num-prompts 256]
[--random-input-len 1024] [--random-range-ratio 0.098] [--chunked-prefill-size 8192] [--quantization fp8]
[--host-stacks N] [--out DIR]``

Builds the engine with default flags (dummy weights, CUDA), prefills the random dataset's
prompts once (``max_new_tokens=1``) to warm up, then again under ``torch.profiler`` (CPU and
CUDA activity). Reports the wall time, the sum of GPU kernel time (``busy_s``; wall minus
busy is time the GPU waited on the host), the kernels with the most GPU time and, with
``--host-stacks N``, the N host ops with the most self CPU time by input shapes and Python
call site (`host_call_sites`), as JSON
``<out>/<device>-profile-prefill-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections import defaultdict

import torch

from attnserve.bench.offline_random import _prompts
from attnserve.bench.results import write_result
from attnserve.bench.roofline import random_lengths


def idle_gaps(events, top: int = 20, min_us: float = 5.0) -> dict:
    """Where the GPU waited: the CUDA kernel events' intervals (µs, the profiler's device
    timeline) merged; ``span_s`` from the first kernel's start to the last one's end,
    ``idle_s`` the time inside it no kernel ran, ``longest`` the ``top`` gaps of at least
    ``min_us`` (``us``, ``at_ms`` after the first kernel, the kernels on either side)."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA)
    if not ks:
        return {"span_s": 0.0, "idle_s": 0.0, "longest": []}
    t0, end, prev = ks[0][0], ks[0][1], ks[0][2]
    idle, found = 0.0, []
    for start, stop, name in ks[1:]:
        if start > end:
            idle += start - end
            if start - end >= min_us:
                found.append({"us": start - end, "at_ms": (end - t0) / 1e3, "after": prev, "before": name})
        if stop >= end:
            end, prev = stop, name
    found.sort(key=lambda g: -g["us"])
    return {"span_s": (end - t0) / 1e6, "idle_s": idle / 1e6, "longest": found[:top]}


def host_call_sites(prof, top: int, frames: int = 5) -> list:
    """The ``top`` (host op, input shapes, call site) groups with the most self CPU time; a
    call site is the innermost ``frames`` Python frames outside torch that enclose the op
    (the profiler must have run with ``with_stack`` and ``record_shapes``: Python frames
    are then events of their own, parents of the ops they call)."""
    groups = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or ".py(" in e.name or not e.name.startswith(("aten::", "cuda")):
            continue
        chain, q = [], e.cpu_parent
        while q is not None and len(chain) < frames:
            if ".py(" in q.name and "torch/" not in q.name:
                chain.append(q.name[-90:])
            q = q.cpu_parent
        g = groups[(e.name[:80], str(e.input_shapes)[:160], tuple(chain))]
        g[0] += 1
        g[1] += e.self_cpu_time_total / 1e6
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": n, "shapes": sh, "stack": list(st), "calls": c, "self_cpu_s": t} for (n, sh, st), (c, t) in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-range-ratio", type=float, default=0.098)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"], help="weight quantization (issue 37)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host-stacks", type=int, default=0, metavar="N",
                    help="also record Python stacks and report the N host ops with the most self CPU time "
                         "by call site (5 frames), with their input shapes")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    flags = {} if args.chunked_prefill_size is None else {"chunked_prefill_size": args.chunked_prefill_size}
    if args.quantization:
        flags["quantization"] = args.quantization
    llm = LLM(args.model, load_format="dummy", device="cuda", **flags)
    isl, _ = random_lengths(args.num_prompts, args.random_input_len, 1, args.random_range_ratio, 0)
    vocab = llm.engine.model_runner.model_config.vocab_size
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(vocab, isl, 1), sp)  # warm-up: other prompts, same lengths
    prompts = _prompts(vocab, isl, 0)
    llm.engine.scheduler.flush_prefix_cache()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=args.host_stacks > 0,
                                record_shapes=args.host_stacks > 0) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    llm.engine.scheduler.flush_prefix_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, sp)
    torch.cuda.synchronize()
    wall_unprofiled = time.perf_counter() - t0
    per_kernel = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = per_kernel[ev.name[:120]]
            k[0] += 1
            k[1] += ev.device_time_total / 1e6 if hasattr(ev, "device_time_total") else ev.cuda_time_total / 1e6
    busy = sum(v[1] for v in per_kernel.values())
    gaps = idle_gaps(prof.events())
    # host side: the ops and runtime calls with the most self CPU time (launch work included)
    host_ops = sorted(((e.key[:120], e.count, e.self_cpu_time_total / 1e6) for e in prof.key_averages()),
                      key=lambda r: -r[2])[: args.top]
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[: args.top]
    host_sites = host_call_sites(prof, args.host_stacks) if args.host_stacks > 0 else []
    result = {"benchmark": "profile-prefill", "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "model": args.model, "quantization": args.quantization, "num_prompts": args.num_prompts,
              "input_tokens": sum(isl), "chunked_prefill_size": llm.engine.server_args.chunked_prefill_size,
              "wall_s_profiled": wall, "wall_s": wall_unprofiled, "busy_s": busy,
              "kernels": [{"name": n, "launches": c, "gpu_s": s} for n, (c, s) in top], "gaps": gaps,
              "host_ops": [{"name": n, "calls": c, "self_cpu_s": s} for n, c, s in host_ops],
              "host_call_sites": host_sites}
    print(f"{args.model}: {sum(isl)} prompt tokens, wall {wall_unprofiled:.3f} s (profiled {wall:.3f}), "
          f"GPU busy {busy:.3f} s", flush=True)
    for n, (c, s) in top:
        print(f"  {s * 1e3:9.2f} ms  x{c:6d}  {n}", flush=True)
    print(f"GPU span {gaps['span_s'] * 1e3:.2f} ms, idle inside it {gaps['idle_s'] * 1e3:.2f} ms; longest gaps:", flush=True)
    for g in gaps["longest"][:10]:
        print(f"  {g['us']:9.1f} us at {g['at_ms']:8.2f} ms  after {g['after']}  before {g['before']}", flush=True)
    print("host ops by self CPU time:", flush=True)
    for n, c, s in host_ops:
        print(f"  {s * 1e3:9.2f} ms  x{c:6d}  {n}", flush=True)
    if host_sites:
        print("host ops by call site:", flush=True)
        for h in host_sites:
            print(f"  {h['self_cpu_s'] * 1e3:9.2f} ms  x{h['calls']:5d}  {h['name']}  {h['shapes']}", flush=True)
            for f in h["stack"]:
                print(f"        {f}", flush=True)
    write_result(result, args.out, "profile-prefill", "cuda")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
