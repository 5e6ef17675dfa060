"""Launch configurations of the extend kernel over an fp8 prefix, against the bf16 default.

``PYTHONPATH=src python benchmarks/fp8_extend_sweep.py [--rounds 2] [--out DIR]``

Cases `kernel_timings.extend_prefix` (``--shapes``; default 4 requests, 512 new bf16 tokens
over an 8K cached prefix; Hq 32 / Hkv 8 / D 128). Each ``ExtendConfig`` among the first
``--only`` of ``CONFIGS`` is timed with an e4m3 prefix (the first ``--e5m2`` also with e5m2,
the first ``--bf16`` with a bf16 prefix), rounds interleaved; the bf16 prefix with the
default config is the base. Writes ``<out>/<device>-fp8-extend-sweep-<date>.json``.
Session 14's runs: benchmarks/NOTES.md ("extend over an fp8 prefix").
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_timings import extend_prefix, summarize_rounds  # noqa: E402

from attnserve.bench.results import cuda_run_metadata, write_result  # noqa: E402

# (block_m, block_n, num_warps, num_stages[, block_n_prefix]); the first is the default for
# D <= 128 since session 14, the second the one before it
CONFIGS = [(128, 64, 8, 3, 128), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 1),
           (64, 128, 8, 2), (64, 128, 4, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 3), (64, 64, 4, 3),
           (128, 64, 4, 3), (64, 128, 4, 2)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--e5m2", type=int, default=2, help="how many of the first configs also run with e5m2")
    ap.add_argument("--bf16", type=int, default=0, help="how many of the first configs also run with a bf16 prefix")
    ap.add_argument("--only", type=int, default=len(CONFIGS), help="the first N configs only")
    ap.add_argument("--shapes", nargs="*", default=["4,8192,512"],
                    help="bs,prefix,new[,plain] (prefix 0: a plain causal prefill; plain > 0: one more request "
                         "of that many new tokens and no prefix, a mixed batch)")
    ap.add_argument("--fp8-plain", action="store_true",
                    help="also time the fp8 pools on plain prefills (prefix 0): the new tokens' K/V are bf16, but "
                         "the kernel is compiled for the fp8 buffers it does not read")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from attnserve.attention.triton_ops.extend_attention import ExtendConfig

    t0 = time.perf_counter()
    res = {"us": {}, "rounds": {}, "configs": CONFIGS}
    runs = [("bf16_default", torch.bfloat16, None)]
    runs += [(f"bf16_{'_'.join(map(str, c))}", torch.bfloat16, ExtendConfig(*c)) for c in CONFIGS[: args.bf16]]
    runs += [(f"e4m3_{'_'.join(map(str, c))}", torch.float8_e4m3fn, ExtendConfig(*c)) for c in CONFIGS[: args.only]]
    runs += [(f"e5m2_{'_'.join(map(str, c))}", torch.float8_e5m2, ExtendConfig(*c)) for c in CONFIGS[: args.e5m2]]
    if args.fp8_plain:  # the default config, as the engine launches it
        runs.append(("e4m3_default", torch.float8_e4m3fn, None))
    for shape in args.shapes:
        bs, prefix, new, plain = (list(map(int, shape.split(","))) + [0])[:4]
        key = f"gqa_extend_bs{bs}_prefix{prefix}_new{new}" + (f"_plus_plain{plain}" if plain else "")
        times = {name: [] for name, dt_, _ in runs if prefix or args.fp8_plain or dt_ == torch.bfloat16}
        for r in range(args.rounds):
            for name, dt_, cfg in runs:
                if name not in times:  # no prefix: the KV format is not read (unless --fp8-plain)
                    continue
                try:
                    times[name].append(extend_prefix(bs, prefix, new, kv_dtype=dt_, config=cfg, plain_new=plain)["us"])
                except Exception as e:  # a config that does not fit (shared memory): recorded, not fatal
                    res.setdefault("errors", {})[f"{key}/{name}"] = repr(e)[:200]
                    times[name].append(float("nan"))
                print(key, name, f"round {r}: {times[name][-1]:.1f} us", flush=True)
                torch.cuda.empty_cache()
        summarize_rounds(res, key, times, "bf16_default")
    res.update(cuda_run_metadata("fp8-extend-sweep", t0))
    write_result(res, args.out, "fp8-extend-sweep", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
