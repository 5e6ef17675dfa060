"""Causal plain prefill: the Gluon FA3-style kernel (`prefill_gluon`) against the Triton extend kernel.

``PYTHONPATH=src python benchmarks/prefill_gluon_bench.py [--rounds 3] [--cases 1x8190,...] [--out DIR]``

Cases ``<bs>x<len>`` are plain prefills; ``<bs>x<prefix>+<len>`` (e.g. ``1x4096+4096``,
``4x2048+2048``, ``1x8192+8192``: `PREFIX_CASES`) give each request a cached prefix of
``prefix`` tokens at page-size-1 slots in shuffled order of a bf16 pool (the Gluon prefix
specialization against the Triton kernel with ``has_prefix=True``); their FLOPs count the
prefix, ``4 * Hq * D * (len * prefix + len^2 / 2)`` a request (`prefill_gluon.attention_flops`).

Llama-3-8B's attention shape (Hq 32, Hkv 8, D 128, bf16), plain causal prefills (no cached
prefix) of ``CASES``: 1 x 8,190, 4 x 2,048, 16 x 512 and 2 x 4,096 tokens, for the Gluon
configurations of ``VARIANTS`` (``--variants``; the first is the default). Per case, first
the check: each Gluon configuration's output against the Triton kernel's default (`extend_attention_fwd`
as the triton backend calls it, ``ATTNSERVE_EXTEND_GLUON`` unset) on the same seeded inputs:
``rel_err`` = ||gluon - triton|| / ||triton||, ``max_abs_diff``, NaN count; a Gluon output
with ``rel_err`` > 1e-2 (or NaN) is recorded and not timed. Then both are timed in
``--rounds`` interleaved rounds of CUDA-graph replays (5 launches a graph, 15 replays;
`kernel_timings.graph_us`), median µs per launch.

FLOPs: ``4 * Hq * D * L^2 / 2`` a request (`prefill_gluon.causal_flops`; 1 x 8,190: 0.549
TFLOP); ``pct_matmul``: the rate over the bf16 8192^3 ``torch.matmul`` rate of the same run.

A first Gluon launch that does not finish within ``--hang-s`` seconds (a barrier deadlock)
ends the process with a traceback instead of holding the GPU. Writes
``<out>/<device>-prefill-gluon-<date>.json`` (date, device, torch / triton / CUDA versions,
every round). About a minute on an H100 plus the compiles (three Gluon, two Triton
configurations: ~1-2 minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import math
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_timings import graph_us  # noqa: E402

from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd  # noqa: E402
from attnserve.attention.triton_ops.prefill_gluon import (  # noqa: E402
    DEFAULT_CONFIG,
    GluonPrefillConfig,
    attention_flops,
    gluon_prefill_fwd,
)
from attnserve.bench.results import cuda_run_metadata, write_result  # noqa: E402

HQ, HKV, D = 32, 8, 128
CASES = {"1x8190": (8190, 1), "4x2048": (2048, 4), "16x512": (512, 16), "2x4096": (4096, 2)}
PREFIX_CASES = ("1x4096+4096", "4x2048+2048", "1x8192+8192")
# Gluon configurations timed: the default (key tiles of 128, a 2-deep K/V ring: FA3's choice for
# D 128), a 3-deep ring (224 KB of shared memory), 64-key tiles with a 3-deep ring
VARIANTS = {"gluon": DEFAULT_CONFIG, "gluon-s3": GluonPrefillConfig(stages=3),
            "gluon-n64s3": GluonPrefillConfig(block_n=64, stages=3)}


def parse_case(name: str) -> tuple:
    """``(bs, prefix, len)`` of a case name ``<bs>x<len>`` or ``<bs>x<prefix>+<len>``."""
    if name in CASES:
        return CASES[name][1], 0, CASES[name][0]
    bs, rest = name.split("x")
    prefix, n = rest.split("+") if "+" in rest else (0, rest)
    return int(bs), int(prefix), int(n)


def build_case(n: int, bs: int, seed: int = 0, prefix: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = n * bs
    mk = lambda rows, h: torch.randn(rows, h, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = mk(t, HQ), mk(t, HKV), mk(t, HKV)
    qo = torch.arange(bs + 1, device="cuda", dtype=torch.int32) * n
    c = dict(q=q, k=k, v=v, qo=qo, starts=qo[:-1].clone(), lens=torch.full((bs,), n, device="cuda",
             dtype=torch.int32), zeros=torch.zeros(bs + 1, device="cuda", dtype=torch.int32),
             buf=torch.zeros(1, HKV, D, device="cuda", dtype=torch.bfloat16), n=n, bs=bs, prefix=prefix,
             o=torch.empty_like(q))
    if prefix:  # page-size-1 slots of a pool with 64 spare slots, shuffled
        slots = bs * prefix + 64
        c.update(k_buf=mk(slots, HKV), v_buf=mk(slots, HKV),
                 kv=torch.arange(bs + 1, device="cuda", dtype=torch.int32) * prefix,
                 idx=torch.randperm(slots, device="cuda", generator=g)[:bs * prefix].to(torch.int32))
    return c


def run_triton(c: dict) -> None:
    if c["prefix"]:
        extend_attention_fwd(c["q"], c["k"], c["v"], c["o"], c["k_buf"], c["v_buf"], c["qo"], c["kv"], c["idx"],
                             None, True, None, c["n"], D ** -0.5, has_prefix=True)
        return
    extend_attention_fwd(c["q"], c["k"], c["v"], c["o"], c["buf"], c["buf"], c["qo"], c["zeros"], c["zeros"][:1],
                         None, True, None, c["n"], D ** -0.5, has_prefix=False)


def run_gluon(c: dict, cfg: GluonPrefillConfig = DEFAULT_CONFIG) -> None:
    if c["prefix"]:
        gluon_prefill_fwd(c["q"], c["k"], c["v"], c["o"], None, None, c["n"], D ** -0.5, qo_indptr=c["qo"],
                          config=cfg, k_buffer=c["k_buf"], v_buffer=c["v_buf"], kv_indptr=c["kv"],
                          kv_indices=c["idx"])
        return
    gluon_prefill_fwd(c["q"], c["k"], c["v"], c["o"], c["starts"], c["lens"], c["n"], D ** -0.5, config=cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated '<bs>x<len>' or '<bs>x<prefix>+<len>' cases (default {list(CASES)}; "
                         f"with a prefix e.g. {list(PREFIX_CASES)})")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {list(VARIANTS)}")
    ap.add_argument("--hang-s", type=float, default=120.0, help="abort if the first Gluon launch takes longer")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    import os

    os.environ["ATTNSERVE_EXTEND_GLUON"] = "0"  # the Triton side must be the Triton kernel
    os.environ.pop("ATTNSERVE_EXTEND_GLUON_PREFIX", None)
    t0 = time.perf_counter()
    from attnserve.bench.offline_random import measure_device_rates

    mm = measure_device_rates()["matmul_flops_per_s"]
    print(f"{torch.cuda.get_device_name()}: bf16 8192^3 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    variants = [x for x in args.variants.split(",") if x]
    res = {"matmul_bf16_tflops": mm / 1e12, "shape": dict(hq=HQ, hkv=HKV, d=D, dtype="bfloat16"), "cases": {}}
    for name in [x for x in args.cases.split(",") if x]:
        bs, prefix, n = parse_case(name)
        c = build_case(n, bs, prefix=prefix)
        run_triton(c)
        torch.cuda.synchronize()
        o_tr = c["o"].clone()
        rows = {"triton": {}}
        runs = {"triton": run_triton}
        for var in variants:
            row = rows[var] = {"config": dataclasses.asdict(VARIANTS[var])}
            fn = functools.partial(run_gluon, cfg=VARIANTS[var])
            c["o"].fill_(float("nan"))
            try:
                faulthandler.dump_traceback_later(args.hang_s, exit=True)
                fn(c)
                torch.cuda.synchronize()
            except Exception as e:  # compile or launch error: recorded, the others still timed
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            finally:
                faulthandler.cancel_dump_traceback_later()
            if "error" not in row:
                d = c["o"].float() - o_tr.float()
                nans = int(torch.isnan(c["o"]).sum())
                rel = (d.norm() / o_tr.float().norm()).item()
                row.update(rel_err=rel, max_abs_diff=d.abs().max().item(), nan_count=nans)
                if nans or not rel <= 1e-2:
                    row["error"] = f"output differs from Triton's (rel err {rel:.3g}, {nans} NaN): not timed"
                else:
                    runs[var] = fn
            if "error" in row:
                print(f"{name} {var}: {row['error']}", flush=True)
            else:
                print(f"{name} {var} check: rel_err {row['rel_err']:.2e} max_abs_diff {row['max_abs_diff']:.2e}",
                      flush=True)
        times = {k: [] for k in runs}
        for _ in range(args.rounds):
            for k, fn in runs.items():
                times[k].append(graph_us(lambda: fn(c), calls=5))
        flops = attention_flops([n] * bs, [prefix] * bs, HQ, D)
        for k, ts in times.items():
            us = statistics.median(ts)
            rows[k].update(us=us, rounds_us=ts, tflops=flops / (us * 1e-6) / 1e12, pct_matmul=100 * flops / (us * 1e-6) / mm)
        for k, r in rows.items():
            if "us" in r and k != "triton":
                r["speedup_vs_triton"] = rows["triton"]["us"] / r["us"]
        res["cases"][name] = dict(n=n, bs=bs, prefix=prefix, flops=flops, rows=rows)
        line = " | ".join(f"{k} {r['us']:.1f} us {r['tflops']:.0f} TFLOP/s" for k, r in rows.items() if "us" in r)
        print(f"{name}: {line} ({time.perf_counter() - t0:.0f} s)", flush=True)
        del c
        torch.cuda.empty_cache()
    res.update(cuda_run_metadata("prefill-gluon", t0))
    print(f"{'case':12s} " + " ".join(f"{k + ' us':>16s} {'TF/s':>5s}" for k in ["triton", *variants]))
    for name, cs in res["cases"].items():
        cells = []
        for k in ["triton", *variants]:
            r = cs["rows"][k]
            cells.append(f"{r.get('us', math.nan):16.1f} {r.get('tflops', math.nan):5.0f}")
        print(f"{name:12s} " + " ".join(cells), flush=True)
    write_result(res, args.out, "prefill-gluon", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
