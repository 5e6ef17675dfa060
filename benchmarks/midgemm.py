"""Mid-size decode GEMM (16 < M <= 256) vs cuBLAS, candidate sweep and tuned table.

``PYTHONPATH=src python benchmarks/midgemm.py [--out DIR] [--table-out DIR] [--models ...] [--ms ...] [--budget-s 170]``

For the decode projections of Llama-3-8B (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x
4096 gated, down 4096 x 14336) and Qwen3-0.6B (qkv 4096 x 1024, o 1024 x 2048, gate_up
6144 x 1024 gated, down 1024 x 3072), or one rank's shards of Llama-3-8B at tp 2 / tp 4
(``--models llama-3-8b-tp2 llama-3-8b-tp4``), bfloat16, at M in ``--ms`` (default 32 64 96 128 144
192 256):

* ``cublas``: ``F.linear(x, W)`` (gated: + the act-and-mul kernel, `silu_and_mul`);
* ``copy``: a device-to-device copy of a buffer of the weight's size (``copy_tbps`` counts
  bytes read + written, as the roofline's copy rate does);
* each candidate of `candidates` (`CANDIDATES_LINEAR` / `CANDIDATES_GATED`, plus for each
  ``split_k == 1`` one a ``-pdl`` twin, launched with programmatic dependent launch, and
  for those in `PREFETCH_TWINS` a ``-pdl-pf<P>`` twin that also prefetches ``P`` K steps
  into L2 before its wait; `mid_linear` / `mid_linear_gated`) that fits (shared memory <=
  `SMEM_LIMIT`, float32 accumulator values per thread <= `ACC_LIMIT`; a PDL twin that does
  not fit at some M, its peeled step taking a stage more, runs there with one loop stage
  less, named ``...-s<stages>``), checked against
  cuBLAS first (``rel_err`` = max |ours - cuBLAS| / max |cuBLAS|; over `ERR_LIMIT` it is
  excluded).

Timing, as a decode step runs a projection: every graph step is a *producer* that writes
the GEMM's input, then the GEMM. The producer is the model's own: `RMSNorm` with a
residual (the fused add + RMSNorm kernel, launched as the decoder layers launch it, with
PDL where `attnserve.pdl.pdl_enabled`), on ``[M, K]``. A GEMM µs is (producer + GEMM) -
(producer alone), both timed the same way, for cuBLAS and every candidate alike; so a PDL
kernel overlaps its producer as in the model, and never a copy of itself (back-to-back
calls of one GEMM would let it). Each timing: a CUDA graph of >= 24 steps over weight
copies spanning >= `ROTATE_BYTES` (so L2 never holds the weight; the activations stay hot
as in a decode step), median of 10 replays.

Per row: GEMM µs, TB/s of weight bytes, ``floor_us`` = max(weight bytes / copy rate of the
same bytes, 2 M N K / bf16 matmul rate measured in this run), ``share`` = floor / µs; the
best candidate per (shape, M) and its speedup over cuBLAS; ``producer_us`` and each
``pair_us`` as measured.

Defaults trimmed for time (issue 33): the candidates that were never within 2 % of the best
in the 2026-11-27 H100 sweep (h100-80gb-hbm3-midgemm-2026-11-27.json) are gone: linear
n128k64w8s4, n256k64w8s3, tma-n128k64w8s4, tma-n128k128w8s3; gated tma-n64k64w8s4,
tma-n128k64w8s3, tma-n64k128w8s3-sk2, tma-n128k64w8s4-sk2.

``--table-out DIR``: writes the tuned table `mid_gemm.table_file_name` there: per (N, K,
gated, M) the best candidate where cuBLAS takes >= `mid_gemm.MIN_GAIN` x as long, else
``"cublas"`` (a ``-pdl`` winner is written with ``"pdl": true``). Copy it to ``src/attnserve/models/layers/mid_gemm_configs/`` to ship it (or
point ``ATTNSERVE_MID_GEMM_CONFIG_DIR`` at DIR). The result JSON is rewritten after every
shape, so a run cut short keeps its rows. ``--budget-s``: after that many seconds the
remaining cases time cuBLAS and the copy only (marked ``swept: false``). A full run of both
models at the default M values is expected to take about 2 minutes on an H100, within 240 s
(the 2026-11-27 sweep of 20 configs took 75 s; this one has 26, a few one-stage-shorter PDL
twins, and times every case with its producer); ``--budget-s`` caps the sweeping part.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

#: model -> [(projection, N, K, gated)]; N x K is the weight (gated: [gate | up] rows)
MODELS = {
    "llama-3-8b": [("gate_up", 28672, 4096, True), ("down", 4096, 14336, False), ("qkv", 6144, 4096, False),
                   ("o", 4096, 4096, False)],
    "qwen3-0.6b": [("gate_up", 6144, 1024, True), ("down", 1024, 3072, False), ("qkv", 4096, 1024, False),
                   ("o", 1024, 2048, False)],
    # one rank's shards of Llama-3-8B under tensor parallelism (column-parallel N / tp, row-parallel K / tp)
    "llama-3-8b-tp2": [("gate_up", 14336, 4096, True), ("down", 4096, 7168, False), ("qkv", 3072, 4096, False),
                       ("o", 4096, 2048, False)],
    "llama-3-8b-tp4": [("gate_up", 7168, 4096, True), ("down", 4096, 3584, False), ("qkv", 1536, 4096, False),
                       ("o", 4096, 1024, False)],
}
DEFAULT_MS = [32, 64, 96, 128, 144, 192, 256]
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 << 20
MIN_CALLS = 24
REPLAYS = 10
ERR_LIMIT = 2e-2  # bf16: a correct kernel differs from cuBLAS by ~4e-3 of max |y|; a wrong one by O(1)
SMEM_LIMIT = 220 << 10  # H100/H200: 227 KB of dynamic shared memory per block, less Triton's barriers
ACC_LIMIT = 160  # float32 accumulator values per thread (cuBLAS's 256x144 tile on 8 warps holds 144)

#: name -> (block_n, block_k, num_warps, num_stages, split_k, use_tma); block_n = weight rows a program
#: multiplies (one 64-row wgmma per warpgroup), the activations are the narrow operand (M pieces)
CANDIDATES_LINEAR = {
    "n64k64w4s4": (64, 64, 4, 4, 1, False),
    "n64k128w4s3": (64, 128, 4, 3, 1, False),
    "tma-n64k64w4s4": (64, 64, 4, 4, 1, True),
    "n64k128w4s3-sk2": (64, 128, 4, 3, 2, False),
    "tma-n128k64w8s4-sk2": (128, 64, 8, 4, 2, True),
    "tma-n64k64w4s5-sk4": (64, 64, 4, 5, 4, True),
    "n128k128w8s3-sk4": (128, 128, 8, 3, 4, False),
}
#: the same for the gated form (block_n = gate rows; a program reads as many up rows too)
CANDIDATES_GATED = {
    "n64k64w8s4": (64, 64, 8, 4, 1, False),
    "n128k64w8s4": (128, 64, 8, 4, 1, False),
    "tma-n64k64w4s4": (64, 64, 4, 4, 1, True),
    "tma-n64k128w8s3": (64, 128, 8, 3, 1, True),
    "tma-n128k64w16s3": (128, 64, 16, 3, 1, True),
}
#: (gated, name) of the split_k == 1 candidates that also get a ``-pdl-pf<P>`` twin (P = its
#: num_stages: the steps the pipelined loop's prologue loads right after the wait)
PREFETCH_TWINS = {(False, "n64k64w4s4"), (False, "n64k128w4s3"), (False, "tma-n64k64w4s4"),
                  (True, "n64k64w8s4"), (True, "tma-n64k64w4s4"), (True, "tma-n64k128w8s3")}


def candidates(gated: bool) -> dict:
    """name -> `MidGemmConfig`: the table's candidates, then for each ``split_k == 1`` one a
    ``-pdl`` twin and, where `PREFETCH_TWINS` names it, a ``-pdl-pf<P>`` twin."""
    from attnserve.models.layers.mid_gemm import MidGemmConfig

    out = {}
    for name, cand in (CANDIDATES_GATED if gated else CANDIDATES_LINEAR).items():
        cfg = MidGemmConfig(*cand)
        out[name] = cfg
        if cfg.split_k == 1:
            out[f"{name}-pdl"] = dataclasses.replace(cfg, pdl=True)
            if (gated, name) in PREFETCH_TWINS:
                out[f"{name}-pdl-pf{cfg.num_stages}"] = dataclasses.replace(cfg, pdl=True, prefetch=cfg.num_stages)
    return out


def _graph_us(fns) -> float:
    from common import bench_graph

    return bench_graph(fns, min_calls=MIN_CALLS, replays=REPLAYS)


def _copies(n: int, k: int, gen: torch.Generator) -> List[torch.Tensor]:
    nbytes = n * k * 2
    copies = max(2, math.ceil(ROTATE_BYTES / nbytes))
    w = torch.randn(copies, n, k, device="cuda", generator=gen, dtype=torch.float32).mul_(1 / math.sqrt(k)).to(DTYPE)
    return list(w.unbind(0))


def _copy_us(nbytes: int) -> float:
    """µs of a device-to-device copy of ``nbytes`` bytes (rotated over >= ROTATE_BYTES of sources)."""
    copies = max(2, math.ceil(ROTATE_BYTES / nbytes))
    src = torch.empty(copies, nbytes // 2, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty(nbytes // 2, dtype=DTYPE, device="cuda")
    us = _graph_us([lambda s=s: dst.copy_(s) for s in src.unbind(0)])
    del src, dst
    return us


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _fits(cfg, m: int, gated: bool) -> bool:
    return cfg.smem_bytes(m, gated) <= SMEM_LIMIT and cfg.acc_per_thread(m, gated) <= ACC_LIMIT


class Producer:
    """The kernel that writes a projection's input in a decode step: the decoder layer's
    add + RMSNorm (`RMSNorm.forward` with a residual; the fused kernel, PDL as the model
    launches it) over ``[m, k]`` bf16. ``__call__`` returns the normalised ``[m, k]``."""

    def __init__(self, m: int, k: int, gen: torch.Generator):
        from attnserve.models.layers.norm import RMSNorm

        self.norm = RMSNorm(k, eps=1e-5, dtype=DTYPE).to("cuda")
        self.delta = torch.randn(m, k, device="cuda", generator=gen).mul_(1e-3).to(DTYPE)
        self.residual = torch.randn(m, k, device="cuda", generator=gen).to(DTYPE)

    def __call__(self) -> torch.Tensor:
        return self.norm(self.delta, self.residual)[0]


def _gemm_us(producer: Producer, fns, producer_us: float) -> tuple:
    """``(GEMM µs, producer + GEMM µs)``: each graph step runs the producer, then ``fn(x)``
    on its output (``fns`` cycle over the weight copies)."""
    pair = _graph_us([lambda f=f: f(producer()) for f in fns])
    return pair - producer_us, pair


def run_case(model: str, proj: str, n: int, k: int, gated: bool, m: int, sweep: bool, rates: dict,
             gen: torch.Generator) -> dict:
    from attnserve.models.layers.fused_kernels import silu_and_mul
    from attnserve.models.layers.mid_gemm import mid_linear, mid_linear_gated

    ws = _copies(n, k, gen)
    producer = Producer(m, k, gen)
    x = producer().clone()  # the reference input (the residual moves on at every call)
    nbytes = n * k * 2

    def peer(w, xin):
        y = F.linear(xin, w)
        return silu_and_mul(y) if gated else y

    def ours(w, cfg, xin):
        return mid_linear_gated(xin, w, "silu", config=cfg) if gated else mid_linear(xin, w, config=cfg)

    ref = peer(ws[0], x)
    producer_us = _graph_us([producer] * len(ws))
    cublas_us, cublas_pair_us = _gemm_us(producer, [lambda xin, w=w: peer(w, xin) for w in ws], producer_us)
    copy_us = _copy_us(nbytes)
    copy_bps = 2 * nbytes / (copy_us * 1e-6)
    floor_us = max(nbytes / copy_bps, 2.0 * m * n * k / rates["matmul_flops_per_s"]) * 1e6
    row = {"model": model, "proj": proj, "N": n, "K": k, "gated": gated, "M": m, "weight_bytes": nbytes,
           "weight_copies": len(ws), "copy_us": copy_us, "copy_tbps": copy_bps / 1e12, "floor_us": floor_us,
           "producer_us": producer_us, "producer_fused": bool(producer.norm.use_fused),
           "cublas_us": cublas_us, "cublas_pair_us": cublas_pair_us, "cublas_tbps": nbytes / cublas_us / 1e6,
           "cublas_share": floor_us / cublas_us, "swept": sweep, "candidates": []}
    for name, cfg in (candidates(gated).items() if sweep else ()):
        if cfg.pdl and not _fits(cfg, m, gated) and cfg.num_stages > 2:
            # the peeled first step takes a stage of shared memory: give it the loop's one
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
            name = f"{name}-s{cfg.num_stages}"
        if not _fits(cfg, m, gated):
            continue
        entry = {"name": name, "config": cfg.to_dict()}
        try:
            out = ours(ws[0], cfg, x)
            torch.cuda.synchronize()
            entry["rel_err"] = _rel_err(out, ref)
            if entry["rel_err"] <= ERR_LIMIT:
                us, pair = _gemm_us(producer, [lambda xin, w=w: ours(w, cfg, xin) for w in ws], producer_us)
                entry.update(us=us, pair_us=pair, tbps=nbytes / us / 1e6, share=floor_us / us,
                             speedup=cublas_us / us)
        except Exception as e:  # a config that fails to compile or run is reported, not fatal
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row["candidates"].append(entry)
    timed = [c for c in row["candidates"] if "us" in c]
    if timed:
        best = min(timed, key=lambda c: c["us"])
        row.update(best=best["name"], best_config=best["config"], best_us=best["us"], best_tbps=best["tbps"],
                   best_share=best["share"], best_speedup=best["speedup"])
        plain = [c for c in timed if not c["config"]["pdl"]]
        if plain:  # what PDL adds: the best PDL form against the best plain one
            bp = min(plain, key=lambda c: c["us"])
            row.update(best_plain=bp["name"], best_plain_us=bp["us"])
    del ws, x, ref, producer
    torch.cuda.empty_cache()
    return row


def build_table(rows: List[dict], device_name: str) -> dict:
    """The tuned table (`mid_gemm` schema) from the swept rows: per shape and M the best
    candidate where cuBLAS takes >= MIN_GAIN x as long, else ``"cublas"``."""
    from attnserve.models.layers.mid_gemm import MIN_GAIN, table_key

    entries: Dict[str, Dict[str, object]] = {}
    for r in rows:
        if not r["swept"]:
            continue
        key = table_key(r["N"], r["K"], r["gated"])
        if r.get("best_speedup", 0.0) >= MIN_GAIN:
            entries.setdefault(key, {})[str(r["M"])] = dict(r["best_config"], us=round(r["best_us"], 2),
                                                            cublas_us=round(r["cublas_us"], 2))
        else:
            entries.setdefault(key, {})[str(r["M"])] = "cublas"
    return {"meta": {"device": device_name, "dtype": "bfloat16", "date": dt.date.today().isoformat(),
                     "min_gain": MIN_GAIN, "source": "benchmarks/midgemm.py"}, "entries": entries}


def print_table(result: dict) -> None:
    print(f"\n{result['device']}: copy {result['copy_tbps']:.2f} TB/s, bf16 matmul {result['matmul_tflops']:.0f} "
          "TFLOP/s; GEMM µs = (producer + GEMM) - producer (CUDA graph), TB/s of weight bytes, share = floor / "
          "time; prod: the add + RMSNorm producer alone; plain: the best candidate without PDL")
    hdr = (f"{'model':<11}{'proj':<8}{'N':>6}{'K':>6}{'M':>4}{'prod':>6}{'floor':>8}{'cublas':>8}{'TB/s':>6}"
           f"{'share':>6}{'plain':>8}{'best':>8}{'TB/s':>6}{'share':>6}{'x':>6}  best candidate")
    print(hdr)
    print("-" * len(hdr))
    for r in result["rows"]:
        b = r.get("best_us")
        print(f"{r['model']:<11}{r['proj']:<8}{r['N']:>6}{r['K']:>6}{r['M']:>4}{r['producer_us']:>6.1f}"
              f"{r['floor_us']:>8.1f}"
              f"{r['cublas_us']:>8.1f}{r['cublas_tbps']:>6.2f}{r['cublas_share']:>6.2f}"
              + f"{r.get('best_plain_us', float('nan')):>8.1f}"
              + (f"{b:>8.1f}{r['best_tbps']:>6.2f}{r['best_share']:>6.2f}{r['best_speedup']:>6.2f}  {r['best']}"
                 if b else f"{'-':>8}{'-':>6}{'-':>6}{'-':>6}  " + ("(not swept)" if not r["swept"] else "(none ran)")))
    errs = [(r["proj"], r["M"], c["name"], c.get("error") or f"rel_err {c['rel_err']:.1e}")
            for r in result["rows"] for c in r["candidates"] if "us" not in c]
    if errs:
        print(f"\n{len(errs)} candidate runs failed or were wrong (first 12):")
        for e in errs[:12]:
            print("  ", *e)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="directory of the result JSON")
    ap.add_argument("--table-out", default=None, help="directory to write the tuned table into")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--projs", nargs="+", default=None, help="only these projections (gate_up down qkv o)")
    ap.add_argument("--ms", type=int, nargs="+", default=DEFAULT_MS, help="activation rows M (17..256)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop sweeping candidates after this many seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/midgemm.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    if any(not 16 < m <= 256 for m in args.ms):
        ap.error(f"M values must be in 17..256: {args.ms}")
    import triton

    from attnserve.bench.offline_random import measure_device_rates
    from attnserve.bench.results import write_result
    from attnserve.pdl import pdl_enabled

    t0 = time.perf_counter()
    rates = measure_device_rates()
    dev = torch.cuda.get_device_name()
    result = {"benchmark": "midgemm", "date": dt.date.today().isoformat(), "device": dev, "torch": torch.__version__,
              "triton": triton.__version__, "cuda": torch.version.cuda, "dtype": "bfloat16",
              "copy_tbps": rates["copy_bytes_per_s"] / 1e12, "matmul_tflops": rates["matmul_flops_per_s"] / 1e12,
              "timing": f"CUDA graph of >= {MIN_CALLS} steps (producer = fused add + RMSNorm, then the GEMM) over "
                        f"weight copies spanning >= {ROTATE_BYTES >> 20} MiB; median of {REPLAYS} replays; GEMM µs = "
                        "step µs - producer-alone µs", "pdl_enabled": pdl_enabled(torch.device("cuda")),
              "rows": []}
    print(f"copy {result['copy_tbps']:.2f} TB/s, matmul {result['matmul_tflops']:.0f} TFLOP/s, "
          f"PDL {'on' if result['pdl_enabled'] else 'OFF (the -pdl candidates run plainly)'}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model in args.models:
        for proj, n, k, gated in MODELS[model]:
            if args.projs and proj not in args.projs:
                continue
            for m in args.ms:
                sweep = time.perf_counter() - t0 < args.budget_s
                r = run_case(model, proj, n, k, gated, m, sweep, rates, gen)
                result["rows"].append(r)
                print(f"{model:<11}{proj:<8}M={m:<4} prod {r['producer_us']:5.1f}  floor {r['floor_us']:7.1f}  "
                      f"cublas {r['cublas_us']:7.1f}  plain {r.get('best_plain_us', float('nan')):7.1f}  "
                      f"best {r.get('best_us', float('nan')):7.1f} {r.get('best', '-')}  "
                      f"[{time.perf_counter() - t0:.0f} s]", flush=True)
            result["total_seconds"] = time.perf_counter() - t0
            write_result(result, args.out, "midgemm")
    print_table(result)
    if args.table_out:
        os.makedirs(args.table_out, exist_ok=True)
        from attnserve.models.layers.mid_gemm import table_file_name

        path = os.path.join(args.table_out, table_file_name(dev, DTYPE))
        with open(path, "w") as f:
            json.dump(build_table(result["rows"], dev), f, indent=2)
        print(f"wrote table {path}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
