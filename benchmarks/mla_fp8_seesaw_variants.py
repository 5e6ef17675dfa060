"""The fp8 seesaw MLA stage 1 against the bf16 default, in one GPU run, with A/B variants.

``PYTHONPATH=src python benchmarks/mla_fp8_seesaw_variants.py [--rounds 3] [--e5m2 default] [--out DIR]``

Shapes of `benchmarks/fp8_kv.py` (DeepSeek dims 512 + 64, page 64): 128 heads bs 32 x 16K
and 16 heads bs 128 x 4K. Times stage 1 + merge under a CUDA graph (`kernel_timings.graph_us`)
for the bf16 cache with the default config and for each variant of the fp8 seesaw kernel
(forced by a config that prefers ``"seesaw"``, so the 16-head case runs it whatever the
dispatcher's default for that shape). A variant sets module attributes of
`mla_decode_seesaw` before its launches (``VARIANTS``; ``default`` sets none), so a change
under test can be kept reachable behind a module-level switch for one run. Rounds interleave
the runs; the JSON keeps every round and the median. Each variant's output must equal the
first variant's bit for bit (conversion variants only change its order).

Session 12 (2026-11-25) compared the conversion of one chunk at a time (4 barriers a chunk),
1 / 2 / 4 chunks per barrier, one TMA box per 4-chunk group, and a no-conversion ablation
with this script; those variants' code is gone, their rows stay in
``results/h100-80gb-hbm3-mla-fp8-seesaw-*-2026-11-25.json`` (benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_timings import graph_us, mla_inputs, summarize_rounds  # noqa: E402

from attnserve.bench.results import cuda_run_metadata, write_result  # noqa: E402

VARIANTS = {  # name: module attributes of mla_decode_seesaw to set (restored after the run)
    "default": {},
}
SHAPES = {"mla128_decode_bs32_16k": (32, 16384, 128), "mla16_decode_bs128_4k": (128, 4096, 16)}


def _case(bs, ctx, heads, kv_dtype, page=64):
    return dict(mla_inputs(bs, ctx, heads, page, kv_dtype), page=page)


def _runner(c, fp8: bool):
    from attnserve.attention.triton_ops.mla_common import MLADecodeConfig
    from attnserve.attention.triton_ops.mla_decode import mla_decode_fwd, mla_stage1_kernel

    cfg = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma", stage1="seesaw") \
        if fp8 else None
    kw = dict(kv_scale=1.0, config=cfg) if fp8 else {}

    def fn():
        mla_decode_fwd(c["q_nope"], c["q_pe"], c["kv"], c["table"], c["lens"], c["page"], c["o"], 192 ** -0.5,
                       c["splits"], c["splits"], workspace=c["ws"], **kw)

    return fn, str(mla_stage1_kernel(c["q_nope"], c["q_pe"], c["kv"], c["page"], cfg))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=["default"])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--e5m2", nargs="*", default=[], help="variants also timed with an e5m2 cache")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--date", default=dt.date.today().isoformat())
    ap.add_argument("--label", default="variants", help="file name part: <device>-mla-fp8-seesaw-<label>-<date>.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    from attnserve.attention.triton_ops import mla_decode_seesaw as ms

    saved = {k: getattr(ms, k) for v in VARIANTS.values() for k in v}

    res = {**cuda_run_metadata("mla-fp8-seesaw-variants", t0), "date": args.date,
           "us": {}, "rounds": {}, "stage1": {}, "max_abs_diff_vs_first": {},
           "variants": {k: {a: repr(x) for a, x in VARIANTS[k].items()} for k in args.variants}}
    for shape in args.shapes:
        bs, ctx, heads = SHAPES[shape]
        cases = {"bf16": _case(bs, ctx, heads, torch.bfloat16), "e4m3": _case(bs, ctx, heads, torch.float8_e4m3fn)}
        if args.e5m2:
            cases["e5m2"] = _case(bs, ctx, heads, torch.float8_e5m2)
        runs = [("bf16", "bf16", None)] + [(f"e4m3_{v}", "e4m3", v) for v in args.variants] + \
            [(f"e5m2_{v}", "e5m2", v) for v in args.e5m2]
        times = {name: [] for name, _, _ in runs}
        ref = {}
        for r in range(args.rounds):
            for name, fmt, v in runs:
                if v is not None:
                    for k, val in {**saved, **VARIANTS[v]}.items():
                        setattr(ms, k, val)
                c = cases[fmt]
                fn, kind = _runner(c, fmt != "bf16")
                res["stage1"][f"{shape}/{name}"] = kind
                if r == 0:
                    fn()
                    torch.cuda.synchronize()
                    out = c["o"].float().clone()
                    if fmt in ref:
                        res["max_abs_diff_vs_first"][f"{shape}/{name}"] = (out - ref[fmt]).abs().max().item()
                    else:
                        ref[fmt] = out
                        res["max_abs_diff_vs_first"][f"{shape}/{name}"] = 0.0
                    if not torch.isfinite(out).all():
                        res["max_abs_diff_vs_first"][f"{shape}/{name}"] = float("nan")
                times[name].append(graph_us(fn))
                print(shape, name, kind, f"round {r}: {times[name][-1]:.1f} us", flush=True)
        summarize_rounds(res, shape, times, "bf16")
        del cases
        torch.cuda.empty_cache()
    for k, val in saved.items():
        setattr(ms, k, val)
    print("max_abs_diff_vs_first", res["max_abs_diff_vs_first"], flush=True)
    res["total_s"] = time.perf_counter() - t0
    write_result(res, args.out, f"mla-fp8-seesaw-{args.label}", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
