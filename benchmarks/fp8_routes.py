"""FP8 projection routes of a decode step, each timed behind the kernel that writes its input (issue 37).

``PYTHONPATH=src python benchmarks/fp8_routes.py [--ms 40,64] [--shapes qkv,o,gate_up,down]
[--out FILE.json]``

At 33..64 rows the Llama-3-8B FP8 step runs at ~0.64 of its floor (bf16: ~0.79; one H200,
benchmarks/NOTES.md, 2026-11-28): ``qkv`` and ``o`` stream their weights at ~0.4-0.5 of
the copy rate. The FP8 mid GEMM has a PDL form (`attnserve.pdl`: its first weight tiles
loaded while the kernel before it runs), opt-in per tile. This script times,
per projection and batch ``M``, every route `Fp8LinearMethod` could take, as a decode step
runs it:

* each CUDA-graph step runs the **producer** of the projection's input, then the route, over
  rotating weight copies (>= 200 MB: no weight found in the L2); route µs = (producer +
  route) - (producer alone), both timed the same way (as ``benchmarks/midgemm.py``);
* producers: ``qkv`` and ``gate_up`` read the fused add-RMSNorm + per-token e4m3 quantiser
  (`fused_add_rmsnorm_quant_fp8`, what the layer's norms run); ``o`` and ``down`` read a
  16-bit ``[M, K]`` written by the bf16 add-RMSNorm kernel (`RMSNorm`, PDL as the model
  launches it), standing in for decode stage 2 (``o``) and the gated mid GEMM (``down``);
* routes (the mid GEMM's ``/pdl`` tiles launch with PDL wherever `attnserve.pdl.pdl_enabled`):
  - ``rowwise``: ``_scaled_mm`` with row-wise scales (`scaled_mm_rowwise`);
  - ``folded``: ``gate_up``: tensor-wise ``_scaled_mm`` with unit scales + the SiLU-and-mul
    quantiser applying the scales; ``o`` / ``down``: `quantize_activation` + the tensor-wise
    GEMM into float32 (the lazy product a quantising norm then scales, `fused_inputs`);
  - ``mid8:<tile>``: (``o`` / ``down``: `quantize_activation` +) the W8A8 mid GEMM;
    ``gate_up`` also quantises its output per token for ``down`` (`Fp8LinearMethod`);
  - ``mid16:<tile>`` (``o`` / ``down``): the W8A16 mid GEMM on the 16-bit rows, no quantiser;
  - tiles ``<block_n>x<block_k>/<warps>w<stages>s/sk<split>[/tma][/pdl[pf<steps>]]``.

Every route's output is checked against the float64 product of its own dequantised
operands (relative Frobenius error <= `MAX_REL_ERR`; a lost ``K`` tile gives ~0.2); a
mismatch or a compile error is recorded, never ranked. Prints per shape and ``M`` the routes
by time (µs, TB/s of weight bytes, fraction of the copy rate measured in the same run) and
writes all rows to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Callable, Dict, List

import torch

from common import bench_graph, copy_bandwidth_gbs

#: projection -> (weight rows, K, gated, producer kind)
SHAPES = {"qkv": (6144, 4096, False, "fp8"), "o": (4096, 4096, False, "bf16"),
          "gate_up": (28672, 4096, True, "fp8"), "down": (4096, 14336, False, "bf16")}
#: mid GEMM base tiles per projection (block_n, block_k, warps, stages, split_k, use_tma); each is
#: also run with PDL and with PDL + L2 hints of ``stages`` further steps. First: the H200 default
#: (qkv, gate_up) or the wide sweep's best (o, down; 2026-11-28), then other split counts
BASE_TILES = {
    "qkv": [(64, 128, 4, 6, 2, True), (64, 128, 4, 4, 1, False), (64, 128, 4, 4, 4, False)],
    "o": [(64, 128, 4, 4, 2, False), (64, 128, 4, 4, 4, False), (64, 256, 4, 3, 2, False)],
    "gate_up": [(64, 128, 4, 4, 1, False), (64, 128, 4, 3, 2, False)],
    "down": [(64, 256, 4, 3, 3, False), (64, 256, 4, 3, 2, False), (64, 128, 4, 6, 4, True),
             (64, 256, 4, 3, 4, False)],
}
W8A16_TILES = [(64, 128, 4, 4, 2, False), (64, 128, 4, 4, 4, False)]
ROTATE_BYTES = 200 * 2**20
MAX_REL_ERR = 0.02
#: the gated routes return their output quantised per token (e4m3: ~0.027 relative Frobenius error alone)
MAX_REL_ERR_QUANTISED = 0.06
MIN_CALLS = 48


def _graph_us(fns: List[Callable[[], object]]) -> float:
    return bench_graph(fns, min_calls=MIN_CALLS, replays=9)


def _label(prefix: str, cfg) -> str:
    tail = "/pdl" + (f"pf{cfg.prefetch}" if cfg.prefetch else "") if cfg.pdl else ""
    return (f"{prefix}:{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}w{cfg.num_stages}s/sk{cfg.split_k}"
            f"{'/tma' if cfg.use_tma else ''}{tail}")


def _tiles(rows: List[tuple]):
    from attnserve.models.layers.mid_gemm import MidGemmConfig

    for bn, bk, w, st, sk, tma in rows:
        base = MidGemmConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=st, split_k=sk, use_tma=tma)
        yield base
        twin = dataclasses.replace(base, pdl=True, num_stages=max(2, st - 1) if st >= 6 else st)
        yield twin
        yield dataclasses.replace(twin, prefetch=twin.num_stages)


class _Producer:
    """The kernel writing the projection's input: an add-RMSNorm over ``[m, k]`` bf16,
    quantising (``fp8``: returns ``(q, s)``) or not (``bf16``: returns the rows)."""

    def __init__(self, kind: str, m: int, k: int, gen: torch.Generator):
        from attnserve.models.layers.norm import RMSNorm

        self.kind = kind
        self.norm = RMSNorm(k, eps=1e-5, dtype=torch.bfloat16).to("cuda")
        self.delta = torch.randn(m, k, device="cuda", generator=gen).mul_(1e-3).to(torch.bfloat16)
        self.residual = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)

    def __call__(self):
        if self.kind == "fp8":
            from attnserve.models.layers.quantization.fp8_kernels import fused_add_rmsnorm_quant_fp8

            return fused_add_rmsnorm_quant_fp8(self.delta, self.residual, self.norm.weight, 1e-5)
        return self.norm(self.delta, self.residual)[0]


def _routes(proj: str, gated: bool, producer_kind: str, workspace) -> Dict[str, Callable]:
    """label -> ``fn(x, w, ws)`` of the route (``x``: the producer's output)."""
    from attnserve.models.layers.quantization.fp8_kernels import quantize_activation, silu_and_mul_quant_fp8
    from attnserve.models.layers.quantization.fp8_linear import (FOLDED_DOWN_RAW_DTYPE, fp8_fast_accum,
                                                                  scaled_mm_rowwise)
    from attnserve.models.layers.quantization.fp8_mid_gemm import fp8_mid_linear

    unit = torch.ones((), dtype=torch.float32, device="cuda")
    bf16 = torch.bfloat16

    def as_fp8(x):
        return x if producer_kind == "fp8" else quantize_activation(x)

    def unscaled(q, w, dtype):
        return torch._scaled_mm(q, w.t(), scale_a=unit, scale_b=unit, out_dtype=dtype, use_fast_accum=fp8_fast_accum())

    out: Dict[str, Callable] = {}
    act = "silu" if gated else None
    if gated:
        def folded(x, w, ws):
            q, s = x
            return silu_and_mul_quant_fp8(unscaled(q, w, bf16), bf16, row_scale=s, col_scale=ws)
        out["folded"] = folded
    else:
        out["rowwise"] = lambda x, w, ws: scaled_mm_rowwise(*as_fp8(x), w, ws, bf16)
        if producer_kind == "bf16":
            out["folded"] = lambda x, w, ws: unscaled(quantize_activation(x)[0], w, FOLDED_DOWN_RAW_DTYPE)
    for cfg in _tiles(BASE_TILES[proj]):
        def mid8(x, w, ws, c=cfg):
            q, s = as_fp8(x)
            y = fp8_mid_linear(q, w, ws, None, act, x_scale=s, out_dtype=bf16, config=c, workspace=workspace)
            return quantize_activation(y) if gated else y
        out[_label("mid8", cfg)] = mid8
    if producer_kind == "bf16":
        for cfg in _tiles(W8A16_TILES):
            out[_label("mid16", cfg)] = (lambda x, w, ws, c=cfg:
                                         fp8_mid_linear(x, w, ws, config=c, workspace=workspace))
    return out


def _reference(proj: str, x, w, ws, gated: bool, label: str) -> torch.Tensor:
    """float64 product of the route's dequantised operands (before a gate, the gated routes
    are compared after dequantising their quantised output)."""
    from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
    from attnserve.models.layers.quantization.fp8_utils import dequantize

    if isinstance(x, tuple):
        a = dequantize(*x)
    elif label.startswith("mid16"):
        a = x
    else:
        a = dequantize(*quantize_activation(x))
    y = a.double() @ dequantize(w, ws).double().t()
    if gated:
        g, u = y.chunk(2, dim=1)
        y = torch.nn.functional.silu(g) * u
    return y


def _as_output(y, x, ws, label: str) -> torch.Tensor:
    """A route's result as the float64 ``[M, N]`` it stands for (scales applied, dequantised)."""
    from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
    from attnserve.models.layers.quantization.fp8_utils import dequantize

    if isinstance(y, tuple):
        return dequantize(*y).double()
    if label == "folded":  # o / down: the unscaled float32 product
        s = x[1] if isinstance(x, tuple) else quantize_activation(x)[1]
        return y.double() * s.double().reshape(-1, 1) * ws.double().reshape(1, -1)
    return y.double()


def run_shape(proj: str, m: int, copy_bps: float, gen: torch.Generator) -> dict:
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_row
    from attnserve.models.layers.split_k_workspace import SplitKWorkspace

    n, k, gated, producer_kind = SHAPES[proj]
    nbytes = n * k
    copies = max(2, math.ceil(ROTATE_BYTES / nbytes))
    weights = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(k ** -0.5)
        wq, ws = quantize_per_row(w)
        weights.append((wq, ws.reshape(-1).contiguous()))
        del w
    producer = _Producer(producer_kind, m, k, gen)
    workspace = SplitKWorkspace()
    x0 = producer()
    x0 = tuple(t.clone() for t in x0) if isinstance(x0, tuple) else x0.clone()
    prod_us = _graph_us([producer] * copies)
    floor_us = nbytes / copy_bps * 1e6
    row = {"proj": proj, "N": n, "K": k, "gated": gated, "M": m, "weight_bytes": nbytes, "weight_copies": copies,
           "producer": producer_kind, "producer_us": prod_us, "floor_us": floor_us, "routes": {}}
    for label, fn in _routes(proj, gated, producer_kind, workspace).items():
        entry: dict = {}
        t0 = time.perf_counter()
        try:
            wq, ws = weights[0]
            got = _as_output(fn(x0, wq, ws), x0, ws, label)
            ref = _reference(proj, x0, wq, ws, gated, label)
            entry["rel_err"] = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
            if entry["rel_err"] <= (MAX_REL_ERR_QUANTISED if gated else MAX_REL_ERR):
                pair = _graph_us([lambda w=w, p=producer: fn(p(), *w) for w in weights])
                us = pair - prod_us
                entry.update(us=us, pair_us=pair, tb_s=nbytes / us / 1e6, copy_fraction=floor_us / us)
        except Exception as e:  # a route that fails to compile or run is reported, not fatal
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        entry["seconds"] = time.perf_counter() - t0
        row["routes"][label] = entry
    del weights, producer, workspace
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="40,64", help="batch rows, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="projections, comma-separated")
    ap.add_argument("--out", default=None, help="JSON file for every row")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_routes: needs a CUDA GPU", file=sys.stderr)
        return 2
    from attnserve.pdl import pdl_enabled

    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bps = copy_bandwidth_gbs() * 1e9
    import datetime as dt

    import triton

    result = {"benchmark": "fp8-routes", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "copy_bytes_per_s": copy_bps,
              "pdl_enabled": pdl_enabled(torch.device("cuda")),
              "timing": f"CUDA graph of >= {MIN_CALLS} steps (producer, then the route) over rotating weights; "
                        "route µs = step µs - producer-alone µs", "rows": []}
    print(f"copy rate {copy_bps / 1e12:.2f} TB/s")
    for m in (int(v) for v in args.ms.split(",")):
        for proj in args.shapes.split(","):
            row = run_shape(proj, m, copy_bps, gen)
            result["rows"].append(row)
            timed = sorted(((e["us"], lab) for lab, e in row["routes"].items() if "us" in e))
            bad = [lab for lab, e in row["routes"].items() if "us" not in e]
            print(f"{proj} M={m} producer {row['producer_us']:.1f} µs, floor {row['floor_us']:.1f} µs"
                  + (f"; not timed: {', '.join(bad)}" if bad else ""))
            for us, lab in timed[:8]:
                e = row["routes"][lab]
                print(f"  {lab:<44}{us:7.2f} µs {e['tb_s']:5.2f} TB/s {e['copy_fraction']:.2f}")
            for lab in ("rowwise", "folded"):
                if lab in row["routes"] and "us" in row["routes"][lab] and (row["routes"][lab]["us"], lab) not in timed[:8]:
                    print(f"  {lab:<44}{row['routes'][lab]['us']:7.2f} µs")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
