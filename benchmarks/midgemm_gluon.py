"""Gluon warp-specialized split-K / stream-K mid GEMM (`mid_gemm_gluon`) vs cuBLAS on decode shapes, bf16.

``PYTHONPATH=src python benchmarks/midgemm_gluon.py --out DIR [--ms ...] [--shapes qkv o ...] [--budget-s 200]``

Shapes: Llama-3-8B qkv 6144x4096, o 4096x4096, down 4096x14336; Qwen3-0.6B qkv 4096x1024,
o 1024x2048, down 1024x3072 (``y = x @ W^T``, W ``[N, K]``), at M in ``--ms`` (default 32
64 96 128 144 192 256). Per (shape, M): cuBLAS (``F.linear``), a device-to-device copy of
the weight's bytes (floor = weight bytes / that copy rate, bytes read + written counted as
the roofline does) and each candidate of `CANDIDATES` that fits (a candidate whose ring
does not fit shared memory at that M runs with fewer stages, named ``-s<stages>``; one whose
accumulators exceed `mid_gemm_gluon.REGISTER_PLAN` is skipped). Each candidate is first checked
against cuBLAS (``rel_err`` = max |ours - cuBLAS| / max |cuBLAS|, over 2e-2 it is not
timed), then timed as `benchmarks/midgemm.py` times its kernels: CUDA graph of >= 24 steps,
each the model's producer (fused add + RMSNorm, PDL as the model launches it) then the
GEMM, over weight copies spanning >= 256 MiB (L2 never holds the weight); GEMM µs = step µs
- producer-alone µs; median of 10 replays. Prints the best data-parallel, split-K and
stream-K candidate per (shape, M) and writes
``midgemm_gluon-<device>.json`` (date, device, torch, triton, rows) into ``--out`` after
every shape. ``--gated`` adds the fused gate_up projections (Llama-3-8B 28672 x 4096, Qwen3-0.6B
6144 x 1024; `gluon_mid_linear_gated` with SiLU against cuBLAS + `silu_and_mul`), after the
plain shapes (``--shapes gate_up --gated`` for those alone). About 3-4 minutes on an H100
without ``--gated`` (mostly Gluon compiles: each of the 6 kernels x M-piece pair once; less
after tests/gpu/test_mid_gemm_gluon_gpu.py, which compiles the same kernels);
``--budget-s`` stops sweeping candidates after that many seconds (later rows: cuBLAS only).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import time
from typing import List, Optional

import torch
import torch.nn.functional as F

#: (model, projection, N, K)
SHAPES = [("llama-3-8b", "qkv", 6144, 4096), ("llama-3-8b", "o", 4096, 4096), ("llama-3-8b", "down", 4096, 14336),
          ("qwen3-0.6b", "qkv", 4096, 1024), ("qwen3-0.6b", "o", 1024, 2048), ("qwen3-0.6b", "down", 1024, 3072)]
M_VALUES = [32, 64, 96, 128, 144, 192, 256]
#: ``--gated``: the fused gate_up projections (N = 2I weight rows), vs cuBLAS + `silu_and_mul`
GATED_SHAPES = [("llama-3-8b", "gate_up", 28672, 4096), ("qwen3-0.6b", "gate_up", 6144, 1024)]
ERR_LIMIT = 2e-2


def _candidates():
    """``[(name, config)]``. ``-sk``: stream-K over every SM (``grid`` 0); ``-kS``: split-K
    by ``S`` (``split_k``: ``S * n_tiles`` CTAs, run only where they fit the SMs at once and
    ``S`` <= the K steps); ``-k1``: data-parallel (no workspace traffic); ``-pdl``: with
    programmatic dependent launch. Kernels: 2 x 64 rows (``n128c2``) at 6 and 4 stages, 1 x 64
    rows (``n64c1``) at 6 and 4 stages (plain and PDL at 6)."""
    from attnserve.models.layers.mid_gemm_gluon import GluonMidGemmConfig as C

    out = []
    for base, (bn, st, nc) in (("n128c2s6", (128, 6, 2)), ("n64c1s6", (64, 6, 1))):
        out.append((f"{base}-sk", C(bn, 64, st, nc)))
        out.append((f"{base}-sk-pdl", C(bn, 64, st, nc, pdl=True)))
        out += [(f"{base}-k{s}", C(bn, 64, st, nc, split_k=s)) for s in (1, 2, 3, 4, 6, 8)]
        out += [(f"{base}-k{s}-pdl", C(bn, 64, st, nc, pdl=True, split_k=s)) for s in (2, 4, 8)]
    for base, (bn, st, nc) in (("n128c2s4", (128, 4, 2)), ("n64c1s4", (64, 4, 1))):
        out.append((f"{base}-sk", C(bn, 64, st, nc)))
        out += [(f"{base}-k{s}", C(bn, 64, st, nc, split_k=s)) for s in (2, 4, 8)]
    return out


def _gated_candidates():
    """``--gated`` candidates (``block_n`` counts gate rows; up rows as many again)."""
    from attnserve.models.layers.mid_gemm_gluon import GluonMidGemmConfig as C

    return [
        ("g-n128k64s6c2-sk", C(128, 64, 6, 2)),
        ("g-n128k64s6c2-k1", C(128, 64, 6, 2, split_k=1)),
        ("g-n128k64s6c2-sk-pdl", C(128, 64, 6, 2, pdl=True)),
        ("g-n64k64s6c1-sk", C(64, 64, 6, 1)),
        ("g-n64k64s6c1-k1", C(64, 64, 6, 1, split_k=1)),
    ]


#: the distinct kernels (grid, split and PDL are not compile-time choices of a config; the
#: offline script compiles each with and without PDL)
CANDIDATES = [(n, c) for n, c in _candidates() if c.grid == 0 and c.split_k == 0 and not c.pdl]
GATED_CANDIDATES = [(n, c) for n, c in _gated_candidates() if c.grid == 0 and c.split_k == 0 and not c.pdl]


def run_case(model, proj, n, k, m, sweep, gen, workspace, gated=False) -> dict:
    from midgemm import Producer, _copies, _copy_us, _gemm_us, _graph_us, _rel_err

    from attnserve.models.layers.fused_kernels import silu_and_mul
    from attnserve.models.layers.mid_gemm_gluon import fit_stages, gluon_mid_linear, gluon_mid_linear_gated

    def peer(xin, w):
        y = F.linear(xin, w)
        return silu_and_mul(y) if gated else y

    def ours(xin, w, cfg):
        if gated:
            return gluon_mid_linear_gated(xin, w, "silu", config=cfg, workspace=workspace)
        return gluon_mid_linear(xin, w, config=cfg, workspace=workspace)

    ws = _copies(n, k, gen)
    producer = Producer(m, k, gen)
    x = producer().clone()
    nbytes = n * k * 2
    ref = peer(x, ws[0])
    producer_us = _graph_us([producer] * len(ws))
    cublas_us, _ = _gemm_us(producer, [lambda xin, w=w: peer(xin, w) for w in ws], producer_us)
    copy_us = _copy_us(nbytes)
    floor_us = nbytes / (2 * nbytes / copy_us)  # weight bytes at the copy rate (read + written)
    row = {"model": model, "proj": proj, "N": n, "K": k, "M": m, "gated": gated, "weight_bytes": nbytes,
           "copy_us": copy_us,
           "copy_tbps": 2 * nbytes / copy_us / 1e6, "floor_us": floor_us, "producer_us": producer_us,
           "cublas_us": cublas_us, "cublas_share": floor_us / cublas_us, "swept": sweep, "candidates": []}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, cfg in ((_gated_candidates() if gated else _candidates()) if sweep else ()):
        if cfg.split_k > 1:
            tiles = -(-(n // 2 if gated else n) // cfg.block_n)
            if cfg.split_k * tiles > sms or cfg.split_k > -(-k // cfg.block_k):
                continue  # more CTAs than SMs: the stream-K form covers that
        fit = fit_stages(cfg, m, gated)
        if fit is None:
            continue
        if fit.num_stages != cfg.num_stages:
            name = f"{name}-s{fit.num_stages}"
        entry = {"name": name, "config": dataclasses.asdict(fit)}
        try:
            out = ours(x, ws[0], fit)
            torch.cuda.synchronize()
            entry["rel_err"] = _rel_err(out, ref)
            if entry["rel_err"] <= ERR_LIMIT:
                fns = [lambda xin, w=w, cfg=fit: ours(xin, w, cfg) for w in ws]
                us, _ = _gemm_us(producer, fns, producer_us)
                entry.update(us=us, share=floor_us / us, speedup=cublas_us / us)
        except Exception as e:  # reported, not fatal
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["candidates"].append(entry)
    timed = [c for c in row["candidates"] if "us" in c]
    if timed:
        best = min(timed, key=lambda c: c["us"])
        row.update(best=best["name"], best_us=best["us"], best_share=best["share"], best_speedup=best["speedup"])
    del ws, x, ref, producer
    torch.cuda.empty_cache()
    return row


def _form(name: str) -> str:
    """``dp`` / ``splitk`` / ``streamk`` of a candidate name (``-k1`` / ``-kS`` / ``-sk``)."""
    parts = name.split("-")
    if "sk" in parts:
        return "streamk"
    return "dp" if "k1" in parts else "splitk"


def print_table(result: dict, gated: bool = False) -> None:
    """Per (shape, M): floor, cuBLAS, the best of each form (µs and name) and the best overall."""
    print(f"\n{result['device']}: GEMM µs (CUDA graph, producer subtracted); floor = weight bytes at the copy rate")
    forms = ("dp", "splitk", "streamk")
    print(f"{'shape':<12}{'M':>4}{'floor':>7}{'cublas':>8}" + "".join(f"{f:>30}" for f in forms) + "  best (x cuBLAS)")
    for r in result["rows"]:
        if r["gated"] != gated:
            continue
        cells = ""
        for f in forms:
            timed = [c for c in r["candidates"] if "us" in c and _form(c["name"]) == f]
            b = min(timed, key=lambda c: c["us"]) if timed else None
            cells += f"{b['us']:>7.1f} {b['name'][:22]:<22}" if b else f"{'-':>30}"
        best = f"{r['best']} ({r['best_speedup']:.2f}x)" if "best" in r else "-"
        shape = r["model"][:5] + " " + r["proj"]
        print(f"{shape:<12}{r['M']:>4}{r['floor_us']:>7.1f}{r['cublas_us']:>8.1f}{cells}  {best}")
    errs = [(r["proj"], r["M"], c["name"], c.get("error") or f"rel_err {c['rel_err']:.1e}")
            for r in result["rows"] if r["gated"] == gated for c in r["candidates"] if "us" not in c]
    for e in errs[:20]:
        print("  failed:", *e)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--ms", type=int, nargs="+", default=M_VALUES)
    ap.add_argument("--shapes", nargs="+", default=None, help="projection names (qkv o down), both models")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--gated", action="store_true", help="also the fused gate_up shapes (after the plain ones)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/midgemm_gluon.py needs a CUDA GPU")
        return 2
    import triton

    from attnserve.models.layers.mid_gemm_gluon import GluonMidGemmWorkspace
    from attnserve.pdl import pdl_enabled

    t0 = time.perf_counter()
    dev = torch.cuda.get_device_name()
    result = {"benchmark": "midgemm_gluon", "date": dt.datetime.now().isoformat(timespec="seconds"), "device": dev,
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
              "pdl_enabled": pdl_enabled(torch.device("cuda")), "rows": []}
    print(f"{dev}, torch {torch.__version__}, triton {triton.__version__}, PDL "
          f"{'on' if result['pdl_enabled'] else 'OFF (-pdl candidates run plainly)'}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    workspace = GluonMidGemmWorkspace()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"midgemm_gluon-{dev.replace(' ', '_')}.json")
    cases = [(mo, p, n, k, False) for mo, p, n, k in SHAPES]
    cases += [(mo, p, n, k, True) for mo, p, n, k in GATED_SHAPES] if args.gated else []
    for model, proj, n, k, gated in cases:
        if args.shapes and proj not in args.shapes:
            continue
        for m in args.ms:
            sweep = time.perf_counter() - t0 < args.budget_s
            r = run_case(model, proj, n, k, m, sweep, gen, workspace, gated)
            result["rows"].append(r)
            print(f"{model:<11}{proj:<5}M={m:<4} floor {r['floor_us']:6.1f} cublas {r['cublas_us']:6.1f} "
                  f"best {r.get('best_us', float('nan')):6.1f} {r.get('best', '-')} [{time.perf_counter() - t0:.0f} s]",
                  flush=True)
        result["total_seconds"] = time.perf_counter() - t0
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print_table(result)
    if args.gated:
        print_table(result, gated=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
