"""Decode cost of logprobs and logit controls on the GPU (issue 35).

``PYTHONPATH=src python benchmarks/sampling_extras_gpu.py [--model llama-3-8b] [--num-prompts 64]
[--input-len 512] [--output-len 256] [--repeats 2] [--modes ...] [--out DIR]``

One engine, dummy weights, default flags (CUDA graphs, overlap scheduling). Every mode runs
the same ``--num-prompts`` random prompts, greedy, ``ignore_eos``, fixed lengths:

* ``none``: no extras (the baseline);
* ``logprobs5``: ``logprobs`` with ``top_logprobs=5`` on every request (issue 35's target:
  decode step <= 1.05x ``none``);
* ``penalties``: frequency 0.5, presence 0.5, repetition 1.1 on every request;
* ``bias_min``: a 16-token ``logit_bias`` and ``min_tokens=8`` on every request;
* ``all``: the three above together.

Per mode: the wall time of ``generate`` and of a prefill-only pass of the same prompts
(``max_new_tokens=1``), both after flushing the prefix cache; decode ms per step =
(wall - prefill wall) / (output_len - 1); the scheduler's host ms and GPU-wait ms per decode
step. Modes run round-robin ``--repeats`` times and the fastest run of each is kept; ratios
are to ``none`` of the same run. Also device-only timings (CUDA events, 100 launches back to
back) at ``n = num_prompts``: `token_logprob_stats` (k=5), `LogitControls.apply` with every
rule on every row, and the captured decode graph's step (`graph_step_ms`).

Writes ``<out>/<device>-sampling-extras-<date>.json``.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from attnserve.bench.offline import graph_step_ms
from attnserve.bench.results import cuda_run_metadata, write_result
from attnserve.engine.sampling_params import SamplingParams

MODES = ("none", "logprobs5", "penalties", "bias_min", "all")


def mode_params(mode: str, max_new_tokens: int, vocab: int) -> SamplingParams:
    kw = dict(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    if mode in ("logprobs5", "all"):
        kw.update(logprobs=True, top_logprobs=5)
    if mode in ("penalties", "all"):
        kw.update(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1)
    if mode in ("bias_min", "all"):
        rnd = random.Random(1)
        kw.update(logit_bias={rnd.randrange(vocab): rnd.choice((-5.0, 5.0)) for _ in range(16)},
                  min_tokens=min(8, max_new_tokens))
    return SamplingParams(**kw)


def timed_generate_row(llm, prompts, sp) -> dict:
    from attnserve.bench.offline import timed_generate

    wall, st, outs = timed_generate(llm, prompts, sp)
    if sp.logprobs:
        assert all(len(o.output_token_logprobs) == sp.max_new_tokens for o in outs)
    return {"wall_s": wall, "decode_steps": st.num_decode_steps, "host_ms_per_decode_step": st.host_ms_per_decode_step,
            "wait_ms_per_step": 1e3 * st.wait_seconds / max(st.num_steps, 1), "decode_host_ms_total":
            1e3 * st.decode_host_seconds}


def device_timings(llm, n: int, iters: int = 100) -> dict:
    """GPU time of the extras' device work on ``[n, vocab]`` float32 logits."""
    from attnserve.engine.logprobs import token_logprob_stats
    from attnserve.engine.penalties import LogitControls
    from attnserve.engine.request import Req

    vocab = llm.engine.model_config.vocab_size
    logits = torch.randn(n, vocab, device="cuda") * 4
    ids = logits.argmax(-1)
    controls = LogitControls("cuda", llm.engine.scheduler.eos_token_ids, vocab)
    sp = mode_params("all", 64, vocab)
    reqs = [Req(rid=str(i), prompt_ids=list(range(100 + i, 612 + i)), sampling_params=sp, max_total_len=2048)
            for i in range(n)]
    for r in reqs:
        r.control_slot = -1
    step = controls.prepare(reqs)
    controls.record(ids, step)

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    t_prep0 = time.perf_counter()
    for _ in range(iters):
        controls.prepare(reqs)
    prepare_host_ms = 1e3 * (time.perf_counter() - t_prep0) / iters
    return {"n": n, "vocab": vocab,
            "logprob_stats_k5_ms": timed(lambda: token_logprob_stats(logits, ids, 5)),
            "logprob_stats_k20_ms": timed(lambda: token_logprob_stats(logits, ids, 20)),
            "controls_apply_all_rules_ms": timed(lambda: controls.apply(logits, step, inplace=False)),
            "controls_record_ms": timed(lambda: controls.record(ids, step)),
            "controls_prepare_host_ms": prepare_host_ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sampling_extras_gpu needs a CUDA GPU")
    from attnserve.engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", device="cuda")
    vocab = llm.engine.model_config.vocab_size
    rnd = random.Random(0)
    prompts = [[rnd.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    modes = list(args.modes) if "none" in args.modes else ["none", *args.modes]
    for m in modes:  # warm-up: slot tensors, pinned buffers, the modes' kernels
        llm.generate(prompts[:8], mode_params(m, 8, vocab))
    runs = {m: [] for m in modes}
    for rep in range(args.repeats):
        for m in modes:
            full = timed_generate_row(llm, prompts, mode_params(m, args.output_len, vocab))
            pre = timed_generate_row(llm, prompts, mode_params(m, 1, vocab))
            decode_ms = 1e3 * (full["wall_s"] - pre["wall_s"]) / (args.output_len - 1)
            runs[m].append({**full, "prefill_wall_s": pre["wall_s"], "decode_ms_per_step": decode_ms})
            print(f"rep {rep} {m:10s} wall {full['wall_s']:.3f} s prefill {pre['wall_s']:.3f} s decode "
                  f"{decode_ms:.3f} ms/step host {full['host_ms_per_decode_step']:.3f} ms/step "
                  f"out tok/s {args.num_prompts * args.output_len / full['wall_s']:.0f}", flush=True)
    best = {m: min(rs, key=lambda r: r["decode_ms_per_step"]) for m, rs in runs.items()}
    base = best["none"]
    rows = []
    for m in modes:
        b = best[m]
        rows.append({"mode": m, **b, "decode_step_ratio": b["decode_ms_per_step"] / base["decode_ms_per_step"],
                     "wall_ratio": b["wall_s"] / base["wall_s"],
                     "output_tokens_per_s": args.num_prompts * args.output_len / b["wall_s"],
                     "all_runs_decode_ms": [r["decode_ms_per_step"] for r in runs[m]]})
        print(f"{m:10s} decode {b['decode_ms_per_step']:.3f} ms/step = {rows[-1]['decode_step_ratio']:.3f}x none; "
              f"wall {rows[-1]['wall_ratio']:.3f}x", flush=True)
    runner = llm.engine.model_runner
    llm.engine.scheduler.flush_prefix_cache()  # graph_step_ms fills the pool itself
    dev = device_timings(llm, args.num_prompts)
    dev["graph_step_ms"] = graph_step_ms(runner, args.num_prompts, args.input_len + args.output_len // 2)
    print(f"device: {dev}", flush=True)
    target = next((r["decode_step_ratio"] for r in rows if r["mode"] == "logprobs5"), None)
    result = {**cuda_run_metadata("sampling-extras", t0), "model": args.model, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
              "overlap": llm.engine.scheduler.overlap,
              "cuda_graph_max_bs": runner.serving_limits.cuda_graph_max_bs, "rows": rows, "device_only": dev,
              "logprobs5_target_ratio": 1.05, "logprobs5_ratio": target,
              "logprobs5_meets_target": None if target is None else target <= 1.05}
    write_result(result, args.out, "sampling-extras")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
