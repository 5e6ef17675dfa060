"""Decode-size bf16 GEMMs by weight layout: does cuBLAS stream a K-major weight faster?

``PYTHONPATH=src python benchmarks/gemm_weight_layout.py [--out FILE.json] [--ms 64,96,144,200,256]``

Question (issue 33): at the 64-256 rows of a mixed workload's decode steps cuBLAS reads the
Llama-3-8B projections at only 0.71-0.77 of the copy rate (``NOTES.md``, 2026-11-27), and a
larger workspace or cuBLASLt's heuristics did not help. The weights are stored ``[N, K]``
(``F.linear``: cuBLAS's transposed-B case). Each layout below is a different cuBLAS problem
with its own kernel choice:

* ``nk``: ``F.linear(x, W)``, W ``[N, K]`` (today);
* ``kn``: ``x @ Wt``, Wt ``[K, N]`` contiguous (the weight stored transposed);
* ``nk-swap``: ``(W @ x^T)^T`` made contiguous (the weight as the GEMM's M operand, plus the
  copy a consumer would need).

Per shape (one layer of Llama-3-8B and Qwen3-0.6B) and row count: µs per call in a CUDA graph
over rotating weight copies (>= 200 MB, so L2 holds none), the weight's GB/s and its share of
the device-to-device copy rate measured in the same run, and max |diff| against ``nk``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from common import bench_graph, copy_bandwidth_gbs
from fp8_bench import SHAPES as MODEL_SHAPES

#: the projections of one layer of each model timed here (`fp8_bench.SHAPES`)
SHAPES = {name: MODEL_SHAPES[name] for name in ("llama-3-8b", "qwen3-0.6b")}
ROTATE_BYTES = 200 * 2**20
LAYOUTS = ("nk", "kn", "nk-swap")


def _call(layout, x, w):
    if layout == "nk":
        return F.linear(x, w)
    if layout == "kn":
        return x @ w
    return (w @ x.t()).t().contiguous()


def rows(ms, copy_gbs):
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for model, shapes in SHAPES.items():
        for name, n, k in shapes:
            copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
                  for _ in range(copies)]
            wts = [w.t().contiguous() for w in ws]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                ref = F.linear(x, ws[0]).float()
                row = {"model": model, "proj": name, "n": n, "k": k, "m": m}
                for layout in LAYOUTS:
                    weights = wts if layout == "kn" else ws
                    us = bench_graph([lambda w=w, lay=layout: _call(lay, x, w) for w in weights])
                    gbs = n * k * 2 / us / 1e3
                    row[f"{layout}_us"] = round(us, 2)
                    row[f"{layout}_copy_share"] = round(gbs / copy_gbs, 3)
                    row[f"{layout}_max_diff"] = float((_call(layout, x, weights[0]).float() - ref).abs().max())
                out.append(row)
                print(json.dumps(row), flush=True)
            del ws, wts
            torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--ms", default="64,96,144,200,256")
    args = ap.parse_args()
    t0 = time.time()
    copy_gbs = copy_bandwidth_gbs()
    result = {"benchmark": "gemm-weight-layout", "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "copy_rate_gb_s": copy_gbs,
              "timing": "CUDA-graph replay over rotating weight copies (>= 200 MB), µs per call",
              "rows": rows([int(v) for v in args.ms.split(",")], copy_gbs)}
    result["total_s"] = time.time() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
