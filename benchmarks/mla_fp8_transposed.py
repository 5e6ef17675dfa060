"""The transposed fp8 MLA stage 1 against the fp8 seesaw kernel and the bf16 default, in one GPU run.

``PYTHONPATH=src python benchmarks/mla_fp8_transposed.py [--rounds 3] [--shapes ...] [--out DIR]``

DeepSeek dims 512 + 64, page 64, bf16 queries. Times stage 1 + merge under a CUDA graph
(`kernel_timings.graph_us`, us a call) for: the bf16 cache with the default config; the e4m3
cache through the fp8 seesaw kernel (a config preferring ``"seesaw"``) and through the
transposed kernel (`mla_decode_transposed`, a config with ``stage1="transposed"``) with 2 and
4 TMA stages, with the caller's split count (`kernel_timings.mla_inputs`) and twice it; the
transposed kernel with 2 stages also on an e5m2 cache. Rounds interleave the runs; the JSON
(`<device>-mla-fp8-transposed-<date>.json` under ``--out``) keeps every round, the medians
and each fp8 run's largest difference from the e4m3 seesaw output (relative to its largest
magnitude).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_timings import graph_us, mla_inputs, summarize_rounds  # noqa: E402

from attnserve.bench.results import cuda_run_metadata, write_result  # noqa: E402

SHAPES = {"mla16_decode_bs128_4k": (128, 4096, 16), "mla16_decode_bs32_16k": (32, 16384, 16),
          "mla128_decode_bs32_16k": (32, 16384, 128)}


def _configs():
    from attnserve.attention.triton_ops.mla_common import MLADecodeConfig

    seesaw = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma", stage1="seesaw")
    return {"seesaw": seesaw, **{f"transposed_s{n}": MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=n,
                                                                      stage1="transposed") for n in (2, 4)}}


def _runner(c, cfg, split_factor=1):
    from attnserve.attention.triton_ops.mla_decode import mla_decode_fwd, mla_stage1_kernel, mla_workspace_size

    splits = c["splits"] * split_factor
    ws = c["ws"]
    if split_factor != 1:
        bs, heads = c["q_nope"].shape[:2]
        ws = torch.empty(mla_workspace_size(int(c["lens"][0]), bs, splits, heads, 512), dtype=torch.uint8,
                         device="cuda")
    kw = {} if cfg is None else dict(kv_scale=1.0, config=cfg)

    def fn():
        mla_decode_fwd(c["q_nope"], c["q_pe"], c["kv"], c["table"], c["lens"], 64, c["o"], 192 ** -0.5, splits, splits,
                       workspace=ws, **kw)

    kind = "default" if cfg is None else str(mla_stage1_kernel(c["q_nope"], c["q_pe"], c["kv"], 64, cfg))
    return fn, f"{kind} splits {splits}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfgs = _configs()
    res = {**cuda_run_metadata("mla-fp8-transposed", t0), "us": {}, "rounds": {}, "stage1": {},
           "rel_diff_vs_seesaw": {}}
    for shape in args.shapes:
        bs, ctx, heads = SHAPES[shape]
        cases = {f: mla_inputs(bs, ctx, heads, 64, d) for f, d in
                 (("bf16", torch.bfloat16), ("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2))}
        runs = [("bf16_default", "bf16", None, 1), ("e4m3_seesaw", "e4m3", cfgs["seesaw"], 1),
                ("e4m3_transposed_s2", "e4m3", cfgs["transposed_s2"], 1),
                ("e4m3_transposed_s4", "e4m3", cfgs["transposed_s4"], 1),
                ("e4m3_transposed_s2_x2splits", "e4m3", cfgs["transposed_s2"], 2),
                ("e4m3_transposed_s4_x2splits", "e4m3", cfgs["transposed_s4"], 2),
                ("e5m2_seesaw", "e5m2", cfgs["seesaw"], 1),
                ("e5m2_transposed_s2", "e5m2", cfgs["transposed_s2"], 1)]
        times = {name: [] for name, *_ in runs}
        ref = {}
        for r in range(args.rounds):
            for name, fmt, cfg, sf in runs:
                c = cases[fmt]
                fn, kind = _runner(c, cfg, sf)
                res["stage1"][f"{shape}/{name}"] = kind
                if r == 0 and fmt != "bf16":
                    c["o"].fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    out = c["o"].float().clone()
                    if fmt not in ref:
                        ref[fmt] = out
                    d = ((out - ref[fmt]).abs().max() / ref[fmt].abs().max()).item()
                    res["rel_diff_vs_seesaw"][f"{shape}/{name}"] = d if torch.isfinite(out).all() else float("nan")
                times[name].append(graph_us(fn))
                print(shape, name, kind, f"round {r}: {times[name][-1]:.1f} us", flush=True)
        summarize_rounds(res, shape, times, "bf16_default")
        del cases
        torch.cuda.empty_cache()
    print("rel_diff_vs_seesaw", res["rel_diff_vs_seesaw"], flush=True)
    res["total_s"] = time.perf_counter() - t0
    write_result(res, args.out, "mla-fp8-transposed", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
