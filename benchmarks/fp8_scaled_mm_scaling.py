"""`torch._scaled_mm` with row-wise scales against tensor-wise scales, and bf16 cuBLAS, on the
Llama-3-8B linears (issue 37: FP8 prefill of 8,192 tokens reaches 1.44-1.46x bf16 against a 1.5x
target, its GEMMs at ~1,380 TFLOP/s with row-wise scales; benchmarks/NOTES.md).

Question: does the row-wise-scaled kernel (a per-token activation scale ``[M, 1]`` and a
per-output-channel weight scale ``[1, N]``, what ``--quantization fp8`` runs in prefill) lose
rate against the tensor-wise one (two scalars)? If it does, the channel and token scales could
be applied by the kernels that read the GEMM's output instead (the fused add-RMSNorm,
SiLU-and-mul and RoPE kernels).

Rows: for each linear and each M, µs and TFLOP/s of bf16 ``torch.mm``, ``_scaled_mm`` row-wise
(as called, and as the engine calls it: `fp8_linear.scaled_mm_rowwise`, rows padded) and
tensor-wise (bf16 output), and with ``--split S`` each as ``S`` GEMMs over column blocks;
``*_fastacc``: ``use_fast_accum=True``; ``graph_*`` (fast accumulation, timed in a CUDA graph
that cycles through the weight copies, `common.bench_graph`):
the engine's padded row-wise GEMM and the unpadded one, the folded ``down_proj`` form (tensor-wise GEMM with unit
scales in float32 or bf16, then `fp8_kernels.scale_rows_cols`) and its GEMM alone. Caveat: the timing is eager, so a row made of several
launches is host-bound at small M (``fp8_rowwise_engine`` below 256 rows: its pad copies make
it 65-120 µs where its GEMM alone is ``fp8_rowwise`` at the padded M). Weights rotate over enough copies that small-M rows read DRAM,
not L2. Timing: CUDA events around ``iters`` back-to-back calls, median of ``reps``.

``--accuracy``: each form's error against the float64 product of the same e4m3 operands
(`accuracy_rows`), fast accumulation off and on, beside the FP8 quantisation's own error.

Usage: ``PYTHONPATH=src python benchmarks/fp8_scaled_mm_scaling.py --out $OUT [--ms 64,144,2048,8192] [--accuracy]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch

from common import bench_graph
from fp8_bench import SHAPES

#: Llama-3-8B linears at tp 1: name -> (N, K) (`fp8_bench.SHAPES`)
LINEARS = {name: (n, k) for name, n, k in SHAPES["llama-3-8b"]}
L2_BYTES = 50 << 20


def _time_us(fn, n_copies: int, iters: int = 20, reps: int = 5) -> float:
    for i in range(3):
        fn(i % n_copies)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i % n_copies)
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(out)


def rows_for(name: str, m: int, split: int = 1) -> dict:
    from attnserve.models.layers.quantization.fp8_linear import scaled_mm_rowwise

    n, k = LINEARS[name]
    dev = "cuda"
    f8 = torch.float8_e4m3fn
    copies = max(1, min(8, -(-3 * L2_BYTES // (n * k))))  # bf16 weights >= 3x L2 in rotation
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    w8 = [w.to(f8) for w in w16]  # [N, K] row-major; _scaled_mm wants B column-major: pass w8.t()
    x16 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    x8 = x16.to(f8)
    sa_row = torch.rand(m, 1, device=dev, dtype=torch.float32) + 0.5
    sb_row = torch.rand(1, n, device=dev, dtype=torch.float32) + 0.5
    sa_t = torch.tensor(1.3, device=dev)
    sb_t = torch.tensor(0.7, device=dev)
    flops = 2.0 * m * n * k
    res = {"linear": name, "m": m, "n": n, "k": k, "weight_copies": copies, "split": split}
    cases = {
        "bf16_mm": lambda i: torch.mm(x16, w16[i].t()),
        "fp8_rowwise": lambda i: torch._scaled_mm(x8, w8[i].t(), scale_a=sa_row, scale_b=sb_row,
                                                  out_dtype=torch.bfloat16),
        # Hopper's fast accumulation (no periodic promotion of the tensor cores' partial sums)
        "fp8_rowwise_fastacc": lambda i: torch._scaled_mm(x8, w8[i].t(), scale_a=sa_row, scale_b=sb_row,
                                                          out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8_tensorwise_fastacc": lambda i: torch._scaled_mm(x8, w8[i].t(), scale_a=sa_t, scale_b=sb_t,
                                                             out_dtype=torch.bfloat16, use_fast_accum=True),
        # the engine's form: rows padded to 128 between 64 and 256 (`scaled_mm_padded_rows`)
        "fp8_rowwise_engine": lambda i: scaled_mm_rowwise(x8, sa_row, w8[i], sb_row.view(-1), torch.bfloat16),
        "fp8_tensorwise": lambda i: torch._scaled_mm(x8, w8[i].t(), scale_a=sa_t, scale_b=sb_t,
                                                     out_dtype=torch.bfloat16),
    }
    # in CUDA graphs: the row-wise GEMM as the engine pads it, and the folded form of `down_proj`
    # (`Fp8LinearMethod._folded_down`): a tensor-wise GEMM with unit scales (float32 or bf16 out),
    # then `scale_rows_cols` applies the token and channel scales
    from attnserve.models.layers.quantization.fp8_kernels import scale_rows_cols

    one = torch.tensor(1.0, device=dev)
    sb_vec = sb_row.view(-1).contiguous()
    graphed = {
        "graph_rowwise_engine": lambda i: scaled_mm_rowwise(x8, sa_row, w8[i], sb_vec, torch.bfloat16),
        "graph_rowwise": lambda i: torch._scaled_mm(x8, w8[i].t(), scale_a=sa_row, scale_b=sb_row,
                                                    out_dtype=torch.bfloat16, use_fast_accum=True),
        "graph_folded_f32": lambda i: scale_rows_cols(
            torch._scaled_mm(x8, w8[i].t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True),
            sa_row, sb_vec, torch.bfloat16),
        "graph_folded_bf16": lambda i: scale_rows_cols(
            torch._scaled_mm(x8, w8[i].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True),
            sa_row, sb_vec, torch.bfloat16),
        "graph_tensorwise_f32": lambda i: torch._scaled_mm(x8, w8[i].t(), scale_a=one, scale_b=one,
                                                           out_dtype=torch.float32, use_fast_accum=True),
    }
    if split > 1 and n % split == 0:  # the same product as `split` GEMMs over column blocks (gate | up halves)
        nb = n // split
        blocks = [[w[j * nb:(j + 1) * nb] for j in range(split)] for w in w8]  # row blocks of [N, K]: contiguous
        sb_blocks = [sb_row[:, j * nb:(j + 1) * nb].contiguous() for j in range(split)]

        def rowwise_split(i):
            return [torch._scaled_mm(x8, b.t(), scale_a=sa_row, scale_b=sbj, out_dtype=torch.bfloat16)
                    for b, sbj in zip(blocks[i], sb_blocks)]

        def tensorwise_split(i):
            return [torch._scaled_mm(x8, b.t(), scale_a=sa_t, scale_b=sb_t, out_dtype=torch.bfloat16)
                    for b in blocks[i]]

        cases[f"fp8_rowwise_split{split}"] = rowwise_split
        cases[f"fp8_tensorwise_split{split}"] = tensorwise_split
    for label, fn in cases.items():
        try:
            us = _time_us(fn, copies)
            res[f"{label}_us"] = round(us, 2)
            res[f"{label}_tflops"] = round(flops / us / 1e6, 1)
        except Exception as exc:  # an unsupported scaling mode on this build: say so in the row
            res[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    for label, fn in graphed.items():
        try:
            res[f"{label}_us"] = round(bench_graph([functools.partial(fn, i) for i in range(copies)],
                                                   min_calls=20, replays=5), 2)
        except Exception as exc:
            res[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    # the two fp8 forms must agree once the scales are folded out (same products, same order class)
    ref = torch._scaled_mm(x8, w8[0].t(), scale_a=torch.tensor(1.0, device=dev), scale_b=torch.tensor(1.0, device=dev),
                           out_dtype=torch.float32)
    rw = torch._scaled_mm(x8, w8[0].t(), scale_a=sa_row, scale_b=sb_row, out_dtype=torch.float32)
    res["rowwise_vs_folded_max_rel"] = float(((rw - ref * sa_row * sb_row).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return res


def accuracy_rows(m: int = 256) -> list:
    """Error of ``_scaled_mm`` (row-wise and tensor-wise scales, fast accumulation off and on)
    against the float64 product of the same dequantised e4m3 operands, on each linear: max and
    RMS error over max and RMS |ref|. For scale, ``quant_rms_rel``: the FP8 quantisation's own
    error (float64 product of the unquantised bf16 operands against ``ref``)."""
    from attnserve.models.layers.quantization.fp8_utils import dequantize, quantize_per_row

    rows = []
    g = torch.Generator(device="cuda").manual_seed(m)
    one = torch.tensor(1.0, device="cuda")
    for name, (n, k) in LINEARS.items():
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        xq, xs = quantize_per_row(x)
        wq, ws = quantize_per_row(w)
        xs, ws = xs.reshape(m, 1).float(), ws.reshape(-1).float()
        ref = dequantize(xq, xs).double() @ dequantize(wq, ws).double().t()
        exact = x.double() @ w.double().t()
        row = {"linear": name, "m": m, "n": n, "k": k,
               "quant_rms_rel": float((exact - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())}
        for fast in (False, True):
            tag = "fastacc" if fast else "exact_accum"
            yr = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.float32,
                                  use_fast_accum=fast).double()
            yt = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                  use_fast_accum=fast).double() * xs.double() * ws.double().view(1, -1)
            for form, y in (("rowwise", yr), ("tensorwise", yt)):
                err = y - ref
                row[f"{form}_{tag}_max_rel"] = float(err.abs().max() / ref.abs().max())
                row[f"{form}_{tag}_rms_rel"] = float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        rows.append(row)
        print(" ".join(f"{k_}={v:.3g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="17,32,48,72,96,120,136,144,160,200,232,256,320,512,1024,4096,8192")
    ap.add_argument("--linears", default=",".join(LINEARS))
    ap.add_argument("--accuracy", action="store_true",
                    help="also the error of each form (fast accumulation off / on) against float64, 256 rows")
    ap.add_argument("--split", type=int, default=1,
                    help="also time each GEMM as this many GEMMs over column blocks (e.g. 2: gate | up)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")] if args.ms else []
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d")}
    rows = []
    for m in ms:
        for name in args.linears.split(","):
            r = rows_for(name, m, args.split)
            rows.append(r)
            print(" ".join(f"{k}={v}" for k, v in r.items() if not k.endswith("_error") and k not in ("n", "k")),
                  *(f"{k}={v}" for k, v in r.items() if k.endswith("_error")), flush=True)
    accuracy = accuracy_rows() if args.accuracy else []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_scaled_mm_scaling.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "accuracy": accuracy}, f, indent=1)


if __name__ == "__main__":
    main()
