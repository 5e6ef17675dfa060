"""Tensor parallelism on one multi-GPU host, in one run. Writes ``<out>/<device>-tp-<date>.json``.

``PYTHONPATH=src python benchmarks/tp_decode.py --tp 1 2 [--big-tp 2] [--skip-identity] [--tp-sample local broadcast]
[--allreduce-fusion on off] [--profile] [--repeats 3] [--output-len 128]
[--env-variants NAME=V[,NAME=V] ...] [--variant-rounds N]``

* Identity: Llama-3-8B shape, dummy weights, **float32** (bf16 rounding differs between an
  all-reduce of partial sums and one matmul, and random weights give near-tied logits),
  4 prompts x 24 greedy tokens; the tokens of every tp size must equal tp 1's.
* Decode step: Llama-3-8B shape, dummy bf16 weights, CUDA graphs (the all-reduces captured),
  overlap on; 1 and 64 requests x 512 prompt tokens -> 128 new; ``decode_ms_per_step`` =
  (wall - prefill-only wall) / decode steps, the engine's own per-step cost as a user sees it.
  ``--repeats N`` times both runs N times and takes each one's median (the same pull
  configuration gave 2.24 / 2.46 / 2.66 ms at tp 4 batch 1 in three single runs on four
  H100s, 2026-11-27); ``--output-len`` sets the new tokens. ``decode_ms_per_step_in_run``
  times the decode steps inside the full run itself (`run_with_decode_timing`), so the
  prefill-only run's noise stays out of it: on four H100s (2026-11-28) one configuration's
  derived step time ranged 3.57-4.70 ms at 64 requests while its full runs' walls moved 6%.
  Floor: one GPU's share of the weight bytes read at the copy bandwidth measured here.
* Large model: Llama-3-70B shape at ``--big-tp`` (70B in bf16 needs >= 2 H200s), 1 request.
* ``--step-broadcast shm gloo``: every tp > 1 decode run once per path of rank 0's step
  messages (``ATTNSERVE_STEP_BROADCAST``: the shared-memory queue or gloo); each row
  records its path, ``host_ms_per_step`` (rank 0's host time per decode step) and
  ``tp_send_ms_per_step`` (the part spent sending the step).
* ``--tp-sample local broadcast``: every tp > 1 decode run once per way the other ranks get
  the sampled ids (``ATTNSERVE_TP_SAMPLE``: every rank samples itself, or rank 0's ids by a
  device broadcast each step); each row records ``tp_sample`` and the steps of each kind.
* ``--allreduce-fusion on off``: every tp > 1 decode run once with the all-reduce + residual
  add + RMSNorm kernel (`distributed.fused_all_reduce`) and once with
  ``--disable-allreduce-fusion``; each row records ``allreduce_fusion`` (asked) and
  ``allreduce_fusion_on`` (the engine runs the fused kernel).
* ``--allreduce-fusion-mode pull push twoshot``: every fused run once per kernel
  (``ATTNSERVE_ALLREDUCE_FUSION_MODE``: the pull kernel, the push-mode "Lamport" kernel of
  `distributed.fused_all_reduce_push`, or the two-shot kernel of `distributed.fused_all_reduce_two_shot`
  from ``ATTNSERVE_TWO_SHOT_FUSED_MIN_KB`` up, pull below); each row records ``allreduce_fusion_mode``
  (the kernel the engine runs, ``none`` without fusion) and ``two_shot_min_bytes`` (twoshot
  mode). ``--tp`` with no sizes runs only ``--big-tp``.
* ``--env-variants``: every decode configuration once per variant, the variant's environment
  variables set in its fresh process (e.g. ``ATTNSERVE_GEMV_L2_PREFETCH_MB=0`` against ``=16``);
  rows record them as ``env``. ``--variant-rounds N`` runs the variants in turn N times (A B A B ...)
  and adds ``variant_summary`` (`variant_summary`: each variant's medians over the rounds): one
  process per variant left the A/Bs of 2026-11-28 within the run-to-run spread of the prefill.
* ``--profile``: per decode row, rank 0's kernels under ``torch.profiler`` (CUDA activity):
  a prefill-only run (its kernels are reported too, in total: ``profile.prefill_kernels``)
  and a run of ``--profile-steps`` more decode steps, the difference
  divided by the decode steps: per kernel name, launches and GPU microseconds per step
  (``profile.kernels``), as ``profile_step.py`` reports them for one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import copy_bandwidth_gbs  # noqa: E402

from attnserve.bench.results import device_slug, write_result  # noqa: E402


def _llm(model, tp, dtype, ctx, max_bs, **extra):
    from attnserve.engine.llm import LLM

    return LLM(model, load_format="dummy", device="cuda", dtype=dtype, tp_size=tp, context_length=ctx,
               max_running_requests=max_bs, cuda_graph_max_bs=max_bs, mem_fraction_static=0.85, **extra)


def _child(queue, fn, args, kwargs):
    try:
        queue.put(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # reported in the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))
        raise


def parse_env_variant(text: str) -> dict:
    """``"A=1,B=x"`` -> ``{"A": "1", "B": "x"}`` (``--env-variants``); an empty string: no change.

    Raises:
        ValueError: an item without ``=``.
    """
    env = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--env-variants item {item!r}: expected NAME=VALUE")
        env[name] = value
    return env


def variant_summary(rows) -> list:
    """Per (model, tp, requests, env) of ``rows`` (decode rows with ``env``): the medians over
    the rounds of ``prefill_s``, ``wall_s``, ``decode_ms_per_step_in_run`` and
    ``output_tokens_per_s``, with each round's values (``*_runs``), in first-seen order."""
    groups: dict = {}
    for row in rows:
        key = (row["model"], row["tp"], row["requests"], tuple(sorted(row.get("env", {}).items())))
        groups.setdefault(key, []).append(row)
    out = []
    for (model, tp, requests, env), rs in groups.items():
        s = {"model": model, "tp": tp, "requests": requests, "env": dict(env), "rounds": len(rs)}
        for k in ("prefill_s", "wall_s", "decode_ms_per_step_in_run", "output_tokens_per_s"):
            s[k + "_runs"] = [r[k] for r in rs]
            s[k] = statistics.median(s[k + "_runs"])
        out.append(s)
    return out


def in_fresh_process(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a new process (spawn): torch counts symmetric-memory
    rendezvous per process, so a second tensor-parallel engine in one process meets fresh
    ranks and runs without the custom all-reduce (`symm_mem_rendezvous`); one engine per
    process keeps every row on the path a server gets."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(queue, fn, args, kwargs))
    p.start()
    status, value = queue.get()
    p.join()
    if status != "ok":
        raise RuntimeError(f"{fn.__name__} failed in its process: {value}")
    return value


def _identity_tokens(model, tp, prompts, sp):
    llm = _llm(model, tp, "float32", 512, 8)
    try:
        return [o.token_ids for o in llm.generate(prompts, sp)]
    finally:
        llm.engine.shutdown()


def identity(tps, model="llama-3-8b", n_tokens=24):
    from attnserve.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128000, (n,), generator=gen).tolist() for n in (7, 33, 120, 300)]
    sp = SamplingParams(max_new_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for tp in tps:
        out[tp] = in_fresh_process(_identity_tokens, model, tp, prompts, sp)
        print(f"identity tp {tp}: {out[tp][0][:8]} ...", flush=True)
    ref = out[tps[0]]
    return {"model": model, "dtype": "float32", "tokens": n_tokens,
            "identical_to_tp1": {str(tp): out[tp] == ref for tp in tps},
            "first_divergence": {str(tp): next((i for i, (a, b) in enumerate(zip(sum(out[tp], []), sum(ref, [])))
                                                if a != b), None) for tp in tps}}


def _kernel_times(prof) -> dict:
    """name -> [launches, GPU us] of the CUDA kernels in a finished ``torch.profiler`` run."""
    out: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name if len(ev.name) <= 90 else ev.name[:87] + "..."
            k = out.setdefault(name, [0, 0.0])
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return out


def kernel_profile(llm, prompts, steps: int, top: int = 25) -> dict:
    """Rank 0's kernels per decode step: (profile of ``steps + 1`` new tokens - profile of
    1 new token) / the decode steps between them. The other ranks run the same graphs."""
    from torch.profiler import ProfilerActivity, profile

    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.engine.scheduler import SchedulerStats

    runs = {}
    for name, new in (("prefill", 1), ("full", steps + 1)):
        llm.engine.scheduler.flush_prefix_cache()
        llm.engine.scheduler.stats = SchedulerStats()
        sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, sp)
            torch.cuda.synchronize()
        runs[name] = (_kernel_times(prof), llm.engine.scheduler.stats.num_decode_steps)
    (full, n_full), (pre, n_pre) = runs["full"], runs["prefill"]
    n = max(n_full - n_pre, 1)
    kernels = []
    for name, (count, us) in full.items():
        c0, us0 = pre.get(name, [0, 0.0])
        if count - c0 > 0:
            kernels.append({"name": name, "launches_per_step": (count - c0) / n, "us_per_step": (us - us0) / n})
    kernels.sort(key=lambda k: -k["us_per_step"])
    res = {"decode_steps": n, "busy_us_per_step": sum(k["us_per_step"] for k in kernels),
           "launches_per_step": sum(k["launches_per_step"] for k in kernels), "kernels": kernels}
    # the prefill-only run (prefill of every prompt + one sampled token): its kernels in total
    pre_kernels = sorted(({"name": name, "launches": c, "us": us} for name, (c, us) in pre.items()),
                         key=lambda k: -k["us"])
    res["prefill_busy_us"] = sum(k["us"] for k in pre_kernels)
    res["prefill_kernels"] = pre_kernels[:top]
    print(f"  prefill profile: {res['prefill_busy_us'] / 1e3:.1f} ms of kernels", flush=True)
    for k in pre_kernels[:12]:
        print(f"  {k['us'] / 1e3:8.2f} ms  x{k['launches']:5d}  {k['name']}", flush=True)
    print(f"  profile: {res['launches_per_step']:.0f} launches, {res['busy_us_per_step']:.1f} us of kernels "
          f"per step ({n} steps)", flush=True)
    for k in kernels[:top]:
        print(f"  {k['us_per_step']:8.1f} us  x{k['launches_per_step']:5.1f}  {k['name']}", flush=True)
    return res


def run_with_decode_timing(llm, prompts, params):
    """Generate ``prompts`` to completion, stepping the engine here: ``(wall_s, decode_s,
    decode_steps)`` where ``decode_s`` runs from the first moment every request holds a token
    (the prefill done) to the end, and ``decode_steps`` counts the scheduler's decode steps in
    that span. Unlike the difference of a full run and a separate prefill-only run, the two
    ends come from one run, so run-to-run noise of the prefill does not enter (2026-11-28: at
    tp 4 that noise moved the derived step time by up to 0.7 ms). The last launched step may
    still be on the GPU at the first end (overlap): a one-step edge."""
    engine = llm.engine
    for ids in prompts:
        engine.check_prompt(ids, params)
    t0 = time.perf_counter()
    reqs = [engine.add_request(ids, params) for ids in prompts]
    t_first, steps_first = None, 0
    while any(not r.finished for r in reqs):
        engine.step()
        if t_first is None and all(r.output_ids for r in reqs):
            t_first, steps_first = time.perf_counter(), engine.scheduler.stats.num_decode_steps
    engine.scheduler.flush()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    for r in reqs:
        engine.scheduler.forget(r.rid)
    t_first = t_end if t_first is None else t_first
    return t_end - t0, t_end - t_first, engine.scheduler.stats.num_decode_steps - steps_first


def decode_steps(model, tp, requests, input_len=512, output_len=128, step_broadcast=None, tp_sample=None,
                 allreduce_fusion=None, fusion_mode=None, profile_steps=0, repeats=1, env=None, **extra):
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.engine.scheduler import SchedulerStats
    from attnserve.engine.tp.step_channel import STEP_BROADCAST_ENV
    from attnserve.distributed.fused_all_reduce_push import FUSION_MODE_ENV
    from attnserve.engine.tp.step_sync import TP_SAMPLE_ENV

    os.environ.update(env or {})  # this process only (in_fresh_process); ranks inherit it
    if step_broadcast:
        os.environ[STEP_BROADCAST_ENV] = step_broadcast
    if tp_sample:
        os.environ[TP_SAMPLE_ENV] = tp_sample
    if fusion_mode:  # read once by every rank's custom all-reduce at start-up (inherited)
        os.environ[FUSION_MODE_ENV] = fusion_mode
    if allreduce_fusion is not None:
        extra["disable_allreduce_fusion"] = allreduce_fusion == "off"
    llm = _llm(model, tp, "bfloat16", input_len + output_len + 16, max(requests), **extra)
    rt = llm.engine.tp_runtime
    path = "none" if rt is None else ("shm" if rt.tp.step_queue is not None else "gloo")
    sender = llm.engine.scheduler.tp_sender
    sample_mode = "none" if sender is None else ("local" if sender.sample_local else "broadcast")
    custom_on = rt is not None and rt.tp.custom_all_reduce is not None
    fusion_on = custom_on and rt.tp.custom_all_reduce.fusion is not None
    kernel = rt.tp.custom_all_reduce.fusion.mode if fusion_on else "none"
    two_shot_min = rt.tp.custom_all_reduce.fusion.two_shot.min_bytes if kernel == "twoshot" else None
    cal = rt.tp.custom_all_reduce.calibration if custom_on else None
    calibration = None if cal is None else dataclasses.asdict(cal)
    two_shot_max = rt.tp.custom_all_reduce.config.two_shot_max_bytes if custom_on else None
    rows = []
    try:
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model_runner.model.parameters())
        gen = torch.Generator().manual_seed(0)
        for n in requests:
            prompts = [torch.randint(1, 128000, (input_len,), generator=gen).tolist() for _ in range(n)]
            sp = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
            sp1 = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
            llm.generate(prompts, sp)  # warm-up
            runs = {"prefill": [], "full": []}
            in_run = []  # ms per decode step of each full run, timed inside it
            for _ in range(max(repeats, 1)):  # prefill-only and full runs alternate; medians below
                for name, params in (("prefill", sp1), ("full", sp)):
                    llm.engine.scheduler.flush_prefix_cache()
                    llm.engine.scheduler.stats = SchedulerStats()
                    counts0 = (0, 0) if sender is None else (sender.local_steps, sender.ids_broadcasts)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if name == "full":
                        _, dec_s, dec_steps = run_with_decode_timing(llm, prompts, params)
                        in_run.append(1e3 * dec_s / max(dec_steps, 1))
                    else:
                        llm.generate(prompts, params)
                    torch.cuda.synchronize()
                    runs[name].append((time.perf_counter() - t0, llm.engine.scheduler.stats))
            # the median run of each (the full run's stats and counts are its last run's)
            times = {name: sorted(r, key=lambda t: t[0])[len(r) // 2] for name, r in runs.items()}
            counts = (0, 0) if sender is None else (sender.local_steps - counts0[0],
                                                    sender.ids_broadcasts - counts0[1])
            wall, stats = times["full"]
            steps = max(stats.num_decode_steps, 1)
            row = {"model": model, "tp": tp, "requests": n, "step_broadcast": path, "tp_sample": sample_mode,
                   "custom_all_reduce_on": custom_on, "allreduce_fusion": allreduce_fusion or "none",
                   "allreduce_fusion_on": fusion_on, "allreduce_fusion_mode": kernel,
                   "two_shot_min_bytes": two_shot_min, "two_shot_max_bytes": two_shot_max,
                   "allreduce_calibration": calibration,
                   "local_sample_steps": counts[0], "ids_broadcast_steps": counts[1], "input_len": input_len,
                   "output_len": output_len,
                   "repeats": max(repeats, 1), "wall_runs_s": [t for t, _ in runs["full"]],
                   "prefill_runs_s": [t for t, _ in runs["prefill"]],
                   "wall_s": wall, "prefill_s": times["prefill"][0], "decode_steps": stats.num_decode_steps,
                   "decode_ms_per_step": 1e3 * (wall - times["prefill"][0]) / steps,
                   "decode_ms_per_step_in_run": sorted(in_run)[len(in_run) // 2],
                   "decode_ms_per_step_in_run_all": in_run,
                   "output_tokens_per_s": n * output_len / wall, "host_ms_per_step": stats.host_ms_per_decode_step,
                   "tp_send_ms_per_step": stats.tp_send_ms_per_step,
                   "weight_bytes_per_gpu": weight_bytes}
            rows.append(row)
            print(f"{model} tp {tp} ({path}, {sample_mode} sampling, fusion {kernel if fusion_on else 'off'}) n {n} "
                  f"env {env or '-'}: "
                  f"{row['decode_ms_per_step']:.2f} ms/step ({row['decode_ms_per_step_in_run']:.2f} in-run), "
                  f"{row['output_tokens_per_s']:.0f} tok/s, prefill {row['prefill_s']:.4f} s, host {row['host_ms_per_step']:.2f} ms "
                  f"(step broadcast {row['tp_send_ms_per_step']:.2f})", flush=True)
            if profile_steps:
                row["profile"] = kernel_profile(llm, prompts, profile_steps)
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2], help="Llama-3-8B tp sizes (none: only --big-tp)")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--big-tp", type=int, default=0, help="tp size of the Llama-3-70B run (0: skip)")
    ap.add_argument("--skip-identity", action="store_true")
    ap.add_argument("--step-broadcast", nargs="+", default=["auto"], choices=["auto", "shm", "gloo"],
                    help="paths of the step messages to run each tp > 1 with")
    ap.add_argument("--tp-sample", nargs="+", default=["local"], choices=["local", "broadcast"],
                    help="how the other ranks get each step's sampled ids (ATTNSERVE_TP_SAMPLE), per tp > 1 run")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--disable-custom-all-reduce", action="store_true", help="NCCL for every all-reduce")
    ap.add_argument("--allreduce-fusion", nargs="+", default=["on"], choices=["on", "off"],
                    help="run each tp > 1 decode with the fused all-reduce + add + RMSNorm (on) and/or without (off)")
    ap.add_argument("--allreduce-fusion-mode", nargs="+", default=["pull"], choices=["pull", "push", "twoshot"],
                    help="kernel(s) of each fused run (ATTNSERVE_ALLREDUCE_FUSION_MODE): pull, push and/or twoshot")
    ap.add_argument("--profile", action="store_true",
                    help="per decode row, rank 0's per-kernel GPU time per step (torch.profiler)")
    ap.add_argument("--profile-steps", type=int, default=20, help="decode steps profiled (--profile)")
    ap.add_argument("--env-variants", nargs="+", default=[], metavar="NAME=V[,NAME=V]",
                    help="run every decode configuration once per variant, with these environment "
                         "variables set in its process (rows record them as 'env')")
    ap.add_argument("--variant-rounds", type=int, default=1,
                    help="with --env-variants: run the variants in turn this many times (fresh processes: "
                         "A B A B ...), so a drift of the GPU's clock over the run falls on every variant; "
                         "'variant_summary' gives each variant's medians over the rounds")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed prefill-only / full runs per row; the row reports each one's median run")
    ap.add_argument("--output-len", type=int, default=128, help="decode tokens per request (input: 512)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    copy = copy_bandwidth_gbs()
    res = {"copy_gbs": copy, "gpus": torch.cuda.device_count()}
    res.update(benchmark="tp", date=dt.date.today().isoformat(), device=device_slug("cuda"),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())), decode=[],
               custom_all_reduce=not args.disable_custom_all_reduce)
    if not args.skip_identity and args.tp:
        res["identity"] = identity(args.tp)
        write_result(res, args.out, "tp", "cuda")  # partial results survive a cut-off run

    def modes(fu):  # the kernels of a fused run
        return args.allreduce_fusion_mode if fu == "on" else [None]

    runs = [("llama-3-8b", tp, args.requests, sb, ts, fu, fm)
            for tp in args.tp for sb in (args.step_broadcast if tp > 1 else [None])
            for ts in (args.tp_sample if tp > 1 else [None])
            for fu in (args.allreduce_fusion if tp > 1 else [None]) for fm in modes(fu)]
    if args.big_tp:
        runs += [("llama-3-70b", args.big_tp, [1], sb, ts, fu, fm) for sb in args.step_broadcast
                 for ts in args.tp_sample for fu in args.allreduce_fusion for fm in modes(fu)]
    variants = [parse_env_variant(v) for v in args.env_variants] or [{}]
    for model, tp, requests, sb, ts, fu, fm in runs:
        for rnd in range(max(1, args.variant_rounds)):
            for env in variants:
                rows = in_fresh_process(decode_steps, model, tp, requests, step_broadcast=sb, tp_sample=ts,
                                        allreduce_fusion=fu, fusion_mode=fm,
                                        profile_steps=args.profile_steps if args.profile else 0,
                                        repeats=args.repeats, output_len=args.output_len, env=env,
                                        disable_custom_all_reduce=args.disable_custom_all_reduce)
                for row in rows:
                    row["env"], row["variant_round"] = env, rnd
                    row["weights_floor_ms"] = row["weight_bytes_per_gpu"] / (copy * 1e9) * 1e3
                res["decode"] += rows
                write_result(res, args.out, "tp", "cuda")
    if args.variant_rounds > 1:
        res["variant_summary"] = variant_summary(res["decode"])
        for s in res["variant_summary"]:
            print(f"summary {s['model']} tp {s['tp']} n {s['requests']} env {s['env']}: over {s['rounds']} rounds "
                  f"prefill {s['prefill_s']:.4f} s, wall {s['wall_s']:.4f} s, "
                  f"{s['decode_ms_per_step_in_run']:.3f} ms/step in-run", flush=True)
    res["total_s"] = time.perf_counter() - t0
    write_result(res, args.out, "tp", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
