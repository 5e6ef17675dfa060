"""Host cost of one kernel launch (issue 33: small-model prefill is host-bound).

``PYTHONPATH=src python benchmarks/triton_launch_cost.py [--calls 5000] [--out DIR]``

Times, on the host only (``time.perf_counter`` around ``--calls`` launches of kernels whose GPU
work is a few microseconds, so the CUDA queue never fills), the µs per call of:

* ``fused_add_rmsnorm`` through attnserve's public wrapper (argument checks, output
  allocation, then ``kernel[grid](...)``);
* the same Triton kernel through ``JITFunction.__getitem__`` alone (Triton's binder, cache
  key and launch);
* the same compiled kernel through ``CompiledKernel[grid](*args)`` (Triton's launcher with
  no binding or cache lookup: what a pre-bound launcher would cost);
* ``torch.add(out=)`` and a 16 x 1024 x 1024 ``torch.mm`` (ATen's dispatch, for reference).

Writes ``<out>/<device>-triton-launch-cost-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time

import torch


def _host_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import triton

    from attnserve.bench.results import write_result
    from attnserve.models.layers import fused_kernels as fk
    from attnserve.models.layers.fused_kernels_triton import _fused_add_rmsnorm_kernel

    dev = torch.device("cuda")
    n = 1024
    x = torch.randn(8, n, device=dev, dtype=torch.bfloat16)
    res = torch.randn(8, n, device=dev, dtype=torch.bfloat16)
    w = torch.ones(n, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    block = 1024
    kw = dict(BLOCK=block, num_warps=fk._norm_warps(block), **fk._pdl_args(dev))
    targs = (x, x.stride(0), 0, res, res.stride(0), 0, 1, w, out, n, n, 1e-6, 0.0)
    grid = (x.shape[0],)
    rows = {}
    rows["wrapper_fused_add_rmsnorm"] = _host_us(lambda: fk.fused_add_rmsnorm(x, res, w, 1e-6), args.calls)
    rows["jit_getitem"] = _host_us(lambda: _fused_add_rmsnorm_kernel[grid](*targs, **kw), args.calls)
    try:
        ck = _fused_add_rmsnorm_kernel.warmup(*targs, grid=grid, **kw)
        runner = ck[grid]
        # the compiled launcher takes every parameter in signature order, constexprs included
        names = _fused_add_rmsnorm_kernel.arg_names
        full = list(targs) + [kw[nm] for nm in names[len(targs):]]
        runner(*full)
        torch.cuda.synchronize()
        rows["compiled_getitem"] = _host_us(lambda: runner(*full), args.calls)
    except Exception as exc:  # noqa: BLE001 - report the API mismatch instead of failing the run
        rows["compiled_getitem_error"] = f"{type(exc).__name__}: {exc}"[:300]
    a = torch.randn(16, 1024, device=dev, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    o = torch.empty(16, 1024, device=dev, dtype=torch.bfloat16)
    rows["torch_add_out"] = _host_us(lambda: torch.add(a, a, out=a), args.calls)
    rows["torch_mm_out"] = _host_us(lambda: torch.mm(a, b, out=o), args.calls)
    result = {"benchmark": "triton-launch-cost", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "calls": args.calls, "unit": "host us per call", "rows": rows}
    for k, v in rows.items():
        print(f"{k:28s} {v if isinstance(v, str) else f'{v:8.2f} us'}", flush=True)
    write_result(result, args.out, "triton-launch-cost", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
