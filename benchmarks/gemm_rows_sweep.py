"""bf16 decode GEMMs against their row count: does padding a batch's rows make cuBLAS faster?

``PYTHONPATH=src python benchmarks/gemm_rows_sweep.py [--out DIR] [--models ...]``

A decode step's linears see ``M`` = the captured graph's batch (`default_capture_batch_sizes`:
every 8 rows to 256, every 16 to 512). cuBLAS picks a kernel per shape, and at 64-512 rows
(the mixed workload's batches) its choice is neither monotonic nor tile-aligned: the FP8
``_scaled_mm`` ran 144 rows 1.2-1.6x slower than 256 (2026-11-27), which the engine now pads.
This sweep asks the same of the bf16 linears (``F.linear``, what the engine runs at these
batches on an H200): for each projection of the model's shapes and each captured ``M`` in
64..512, the µs of one call inside a CUDA graph (launch cost removed; the graph cycles
through copies of the weight, >= 256 MB in all, so the L2 never holds it), with torch's
default BLAS library and with ``cublaslt``. The analysis reports, per ``M``, the fastest time
at any captured ``M' >= M`` (padding ``M`` to ``M'`` rows) and what it would save per layer.
Writes ``<out>/<device>-gemm-rows-sweep-<date>.json``.
"""

from __future__ import annotations

import argparse
import time

import torch

from attnserve.bench.results import cuda_run_metadata, write_result
from common import bench_graph, measure_ceilings

#: projection -> (N, K) of ``y = x @ W^T``
SHAPES = {
    "llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}
ROWS = list(range(64, 257, 8)) + list(range(272, 513, 16))
ROTATE_BYTES = 256 << 20


def time_linear(n: int, k: int, rows, lib: str) -> list:
    """µs of ``F.linear(x [m, k], W [n, k])`` per ``m`` in ``rows`` (bf16), under BLAS library ``lib``
    (``default`` / ``cublaslt``), or, for ``swap`` / ``swap-copy``, the swapped product ``W @ x^T``
    (``[n, m]``: cuBLAS sees the weight rows as its M and the batch as its N, and picks other
    kernels) alone / followed by the copy back to a row-major ``[m, n]``."""
    swap = lib.startswith("swap")
    torch.backends.cuda.preferred_blas_library("default" if swap else lib)
    copies = max(1, -(-ROTATE_BYTES // (2 * n * k)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    xmax = torch.randn(max(rows), k, device="cuda", dtype=torch.bfloat16)
    out = []
    for m in rows:
        x = xmax[:m]
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        yt = torch.empty(n, m, device="cuda", dtype=torch.bfloat16)

        def call(w):
            if lib == "swap":
                return lambda: torch.mm(w, x.t(), out=yt)
            if lib == "swap-copy":
                return lambda: y.copy_(torch.mm(w, x.t(), out=yt).t())
            return lambda: torch.matmul(x, w.t(), out=y)

        out.append(bench_graph([call(w) for w in ws], min_calls=max(24, copies), replays=15))
    return out


def padding_gain(rows, us) -> list:
    """Per ``rows[i]``: ``(best µs at any rows[j] >= rows[i], that rows[j])``."""
    best = []
    for i in range(len(rows)):
        j = min(range(i, len(rows)), key=lambda t: us[t])
        best.append((us[j], rows[j]))
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--models", nargs="+", default=list(SHAPES))
    p.add_argument("--libs", nargs="+", default=["default", "cublaslt"],
                   help="default, cublaslt, swap (W @ x^T alone), swap-copy (and the copy back)")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    t0 = time.perf_counter()
    rates = measure_ceilings()
    print(rates, flush=True)
    rows_out = []
    for model in args.models:
        for lib in args.libs:
            per_layer = [0.0] * len(ROWS)
            per_layer_padded = [0.0] * len(ROWS)
            for proj, (n, k) in SHAPES[model].items():
                us = time_linear(n, k, ROWS, lib)
                best = padding_gain(ROWS, us)
                floor = [max(2 * n * k / rates["copy_tbps"] / 1e6, 2 * m * n * k / rates["matmul_bf16_tflops"] / 1e6)
                         for m in ROWS]
                rows_out.append({"model": model, "lib": lib, "proj": proj, "n": n, "k": k, "rows": ROWS, "us": us,
                                 "floor_us": floor, "best_padded_us": [b[0] for b in best],
                                 "best_padded_rows": [b[1] for b in best]})
                for i in range(len(ROWS)):
                    per_layer[i] += us[i]
                    per_layer_padded[i] += best[i][0]
                print(model, lib, proj, " ".join(f"{m}:{t:.1f}" for m, t in zip(ROWS, us)), flush=True)
            rows_out.append({"model": model, "lib": lib, "proj": "layer", "rows": ROWS, "us": per_layer,
                             "best_padded_us": per_layer_padded})
            print(model, lib, "layer", " ".join(f"{m}:{t:.0f}/{b:.0f}" for m, t, b in
                                                zip(ROWS, per_layer, per_layer_padded)), flush=True)
    torch.backends.cuda.preferred_blas_library("default")
    result = cuda_run_metadata("gemm-rows-sweep", t0)
    result.update(rates=rates, rows=rows_out)
    write_result(result, args.out, "gemm-rows-sweep" + args.tag)


if __name__ == "__main__":
    main()
