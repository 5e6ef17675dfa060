"""Which kernels make up one decode step: a CUDA-graph replay under the PyTorch profiler.

``PYTHONPATH=src python benchmarks/profile_step.py [--models smollm2-135m llama-3-8b] [--batch 1]
[--context 512] [--out DIR]``

For each model shape (dummy weights, bf16) it sets up a decode batch as `bench.decode`
does, times the replay with CUDA events, then profiles ``--steps`` replays with
``torch.profiler`` (CUDA activity) and reports per kernel name: launches per step and GPU
microseconds per step. ``busy_us`` (sum of kernel times) against ``step_us`` (event time)
tells how much of a step is kernel work and how much is gaps between kernels.
Writes ``<out>/<device>-profile-step-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections import defaultdict

import torch

from attnserve.bench.offline import fill_decode_kv
from attnserve.bench.results import write_result
from common import make_runner, time_ms


def _short(name: str) -> str:
    return name if len(name) <= 90 else name[:87] + "..."


def profile_model(model: str, bs: int, ctx: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    runner = make_runner(model, bs, ctx, graphs=True)
    _, _, _, fb = fill_decode_kv(runner, bs, ctx)
    gr = runner.cuda_graph_runner
    with torch.inference_mode():
        step_ms = time_ms(lambda: gr.replay(fb), iters=50)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                gr.replay(fb)
            torch.cuda.synchronize()
    per_name = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = per_name[_short(ev.name)]
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    kernels = sorted(
        ({"name": n, "launches_per_step": c / steps, "us_per_step": t / steps} for n, (c, t) in per_name.items()),
        key=lambda r: -r["us_per_step"],
    )
    busy = sum(k["us_per_step"] for k in kernels)
    launches = sum(k["launches_per_step"] for k in kernels)
    out = {"model": model, "batch": bs, "context": ctx, "step_us": step_ms * 1e3, "busy_us": busy,
           "launches_per_step": launches, "layers": runner.model_config.num_hidden_layers, "kernels": kernels}
    print(f"{model} bs={bs} ctx={ctx}: step {step_ms * 1e3:.1f} us, kernels busy {busy:.1f} us, "
          f"{launches:.0f} launches/step", flush=True)
    for k in kernels[:25]:
        print(f"  {k['us_per_step']:8.1f} us  x{k['launches_per_step']:5.0f}  {k['name']}", flush=True)
    del runner, gr
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3-8b"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA GPU")
    import triton

    rows = [profile_model(m, args.batch, args.context, args.steps) for m in args.models]
    result = {"benchmark": "profile_step", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "rows": rows}
    write_result(result, args.out, "profile-step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
