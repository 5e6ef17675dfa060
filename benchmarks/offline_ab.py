"""The fixed-length rows of ``bench.offline --dataset random`` from one engine, for A/B runs.

``PYTHONPATH=src python benchmarks/offline_ab.py [--model llama-3-8b] [--rows 1 64]
[--input-len 512] [--output-len 256] [--skip-server-warmup] [--tag NAME] [--out DIR]``

Per row (``n`` requests of exactly ``--input-len`` prompt and ``--output-len`` output
tokens, range ratio 1, seed 0) this runs what `attnserve.bench.offline_random.bench_random`
runs -- `run_random_workload` (warm-up with other prompts, prefill-only pass, timed pass)
and the floor of `attnserve.bench.roofline` from the copy and matmul rates measured at
the start -- but every row shares one engine with the default limits, so an A/B pair
(environment switches such as ``ATTNSERVE_PDL`` / ``ATTNSERVE_SKINNY_RULE``, one process
each) pays two engine start-ups instead of one per row. ``--skip-server-warmup`` skips the
start-up compile pass (`attnserve.engine.warmup`; the timed pass is warm either way).
Also records the captured decode graph's step time at each ``n`` (mean context).
Writes ``<out>/<device>-offline-ab[-<tag>]-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os

import torch

from attnserve.bench.offline import graph_step_ms
from attnserve.bench.offline_random import measure_device_rates, run_random_workload
from attnserve.bench.results import write_result
from attnserve.bench.roofline import RooflineModel, random_lengths, workload_roofline


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-server-warmup", action="store_true")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("offline_ab needs a CUDA GPU")
    from attnserve.engine.llm import LLM

    env = {k: os.environ.get(k) for k in ("ATTNSERVE_PDL", "ATTNSERVE_SKINNY_RULE")}
    rates = measure_device_rates()
    print(f"env {env}; ceilings: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {rates['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    flags = {"skip_server_warmup": True} if args.skip_server_warmup else {}
    llm = LLM(args.model, load_format="dummy", device="cuda", **flags)
    runner = llm.engine.model_runner
    rm = RooflineModel.from_runner(runner)
    rows = []
    for n in args.rows:
        isl, osl = random_lengths(n, args.input_len, args.output_len, 1.0, args.seed)
        res = run_random_workload(llm, isl, osl, args.seed)
        floor = workload_roofline(rm, isl, osl, rates["copy_bytes_per_s"], rates["matmul_flops_per_s"])
        step_ms = graph_step_ms(runner, n, args.input_len + args.output_len // 2)
        row = {"model": args.model, "num_prompts": n, "random_input_len": args.input_len,
               "random_output_len": args.output_len, "random_range_ratio": 1.0, "seed": args.seed, **res,
               "output_tokens_per_s": res["output_tokens"] / res["wall_s"], "roofline_s": floor.roofline_s,
               "roofline_prefill_s": floor.prefill_s, "roofline_decode_s": floor.decode_s,
               "roofline_share": floor.roofline_s / res["wall_s"],
               "prefill_share": floor.prefill_s / res["prefill_wall_s"],
               "decode_share": floor.decode_s / max(res["wall_s"] - res["prefill_wall_s"], 1e-9),
               "graph_step_ms_mean_ctx": step_ms}
        rows.append(row)
        print(f"{args.model} n={n:3d} {row['output_tokens_per_s']:8.0f} out tok/s wall {res['wall_s']:.3f} s "
              f"floor {floor.roofline_s:.3f} s share {row['roofline_share']:.3f} (prefill {row['prefill_share']:.2f},"
              f" decode {row['decode_share']:.2f}) graph step {step_ms:.3f} ms host {res['host_ms_per_step']:.2f} ms",
              flush=True)
    limits = runner.serving_limits
    import triton

    result = {"benchmark": "offline-ab", "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "env": env, "engine_flags": flags,
              "max_running_requests": limits.max_running_requests, "cuda_graph_max_bs": limits.cuda_graph_max_bs,
              "chunked_prefill_size": limits.chunked_prefill_size, **rates, "rows": rows}
    write_result(result, args.out, "offline-ab" + (f"-{args.tag}" if args.tag else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
