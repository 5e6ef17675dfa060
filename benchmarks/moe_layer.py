"""Speed of the fused MoE layer (`fused_experts_triton`) against the device's own ceilings (issue 34).

``PYTHONPATH=src:benchmarks python benchmarks/moe_layer.py --output RESULT.json [--shapes ...]
[--batches 1 2 4 ... 256] [--prefill-tokens 8192] [--budget-s 100] [--quantization bf16 fp8 fp8-block fp8-w8a16 ...] [--sweep-w8a8]``

Shapes: `moe_tune.SHAPES` (Qwen3-30B-A3B, DeepSeek-V2-Lite, Mixtral-8x7B at tp 1 and 2),
bfloat16 dummy weights (N(0, 0.02)), uniform random top-k routing, softmax weights. The
launch configurations are whatever `fused_experts_triton` looks up (a tuned table in
``$ATTNSERVE_MOE_CONFIG_DIR`` or the package, else the default rule); the JSON records
which, per case.

* **Decode**, batches 1..256: µs per layer call (alignment, gate-up, down, top-k sum) from
  a CUDA graph of back-to-back calls cycling through 4 routings (different experts from
  call to call; each shape's weights exceed the 50 MB L2), median of 10 replays. The
  floor is the bytes of the *distinct* experts each routing selects (counted on the
  device with ``torch.unique``; ``3 H I`` weights an expert) over the device-to-device
  copy rate measured in this run (bytes read + written, `measure_device_rates`);
  ``share = floor / time`` (the issue's target: >= 0.70). The alignment alone is timed
  the same way (``align_us``).
* **Prefill**, ``--prefill-tokens`` (8192): ms per call (a CUDA graph of two calls, median
  of 7 replays: the device time, without the host's launch cost, which an eager layer
  stack hides behind the device's work), FLOPs ``2 T top_k (2 I H + I H)`` (the gate-up and down GEMMs),
  ``share`` of the bf16 8192^3 ``torch.matmul`` rate measured in this run (target >= 0.55).

``--quantization`` (default ``bf16``) lists the expert weight formats to time, each a row of
its own next to the others in one run (``weights`` in the JSON): ``bf16``; ``fp8`` -- e4m3
experts with per-channel scales, what ``--quantization fp8`` loads (W8A16: the kernel
widens the FP8 tiles, the activations stay bf16); ``fp8-block`` -- 128 x 128 block scales
(DeepSeek-V3's checkpoints). The same bf16 draw is quantised, so the routings and
activations are the same; the floor counts the FP8 bytes (1 per weight plus the scales).
``fp8`` / ``fp8-block`` run W8A8 (e4m3 activations, `moe.fp8_w8a8`) where the layer's rule
applies (mean slots per expert >= 16) and W8A16 elsewhere; ``fp8-w8a16`` / ``fp8-block-w8a16``
force W8A16 for comparison, ``fp8-fast-accum`` is ``fp8`` with the MMA's fast accumulation.
Each row records its ``path`` (``w8a8`` / ``w8a16``; ``*`` in the summary); ``--sweep-w8a8``
also times ``moe_tune.FP8_W8A8_CANDIDATES`` on each W8A8 row (``sweep``, best first).

Every case is also checked against `fused_experts_native` (float32 loop over experts):
``max_rel_err = max |ours - native| / max |native|`` (bf16 roundings: ~1e-2 at most).
No peer is timed (a PyTorch loop over experts is no peer); the ceilings are reported.
Writes the JSON after every shape (date, device, torch / triton / CUDA versions).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time

import torch

from moe_tune import DEV, DTYPE, SHAPES, graph_us, random_routing

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


WEIGHT_FORMATS = ("bf16", "fp8", "fp8-block", "fp8-w8a16", "fp8-block-w8a16", "fp8-fast-accum")
#: format -> keyword arguments of fused_experts_triton beyond the scales (the W8A8 choice)
_PATH_ARGS = {"fp8-w8a16": {"fp8_w8a8": False}, "fp8-block-w8a16": {"fp8_w8a8": False},
              "fp8-fast-accum": {"use_fast_accum": True}}


def _quantize_experts(w13: torch.Tensor, w2: torch.Tensor, fmt: str):
    """``(w13, w2, scale kwargs of fused_experts_triton, scale bytes per expert)`` in ``fmt``
    (per expert, gate and up blocked apart: the loader's layout, `fp8_moe`)."""
    if fmt == "bf16":
        return w13, w2, {}, 0
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_block, quantize_per_row

    block = (128, 128) if fmt.startswith("fp8-block") else None
    inter = w13.shape[1] // 2
    q13, q2 = torch.empty_like(w13, dtype=torch.float8_e4m3fn), torch.empty_like(w2, dtype=torch.float8_e4m3fn)
    s13, s2 = [], []
    for e in range(w13.shape[0]):
        if block is None:
            q13[e], a = quantize_per_row(w13[e])
            q2[e], b = quantize_per_row(w2[e])
        else:
            (qg, sg), (qu, su) = quantize_per_block(w13[e, :inter]), quantize_per_block(w13[e, inter:])
            q13[e], a = torch.cat([qg, qu]), torch.cat([sg, su])
            q2[e], b = quantize_per_block(w2[e])
        s13.append(a)
        s2.append(b)
    s13, s2 = torch.stack(s13).contiguous(), torch.stack(s2).contiguous()
    scale_bytes = (s13[0].numel() + s2[0].numel()) * 4
    return q13, q2, {"w13_scale": s13, "w2_scale": s2, "block_shape": block}, scale_bytes


def _rel_err(out: torch.Tensor, x, w13, w2, w, ids, **scales) -> float:
    """``max |out - native| / max |native|`` (`fused_experts_native`, which dequantises FP8
    experts); NaN if that path is unavailable."""
    try:
        from attnserve.models.layers.moe.native import fused_experts_native
    except Exception:  # the reference path belongs to another module; the timing does not need it
        return float("nan")
    ref = fused_experts_native(x, w13, w2, w, ids, **scales).float()
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def sweep_w8a8(t: int, fns, e: int, k: int, est_us: float) -> list:
    """µs per call of each ``moe_tune.FP8_W8A8_CANDIDATES`` entry (both GEMMs the same
    parameters) for the M tiles `moe_tune.block_m_choices` gives, best first. Each ``fns``
    entry is re-run with ``config=``; a candidate that fails to compile is skipped (inf)."""
    from moe_tune import FP8_W8A8_CANDIDATES, block_m_choices, gemm_cfg, measure

    from attnserve.models.layers.moe.tuned_configs import FusedMoEConfig

    out = []
    for bm in block_m_choices(t, k, e):
        for c in FP8_W8A8_CANDIDATES.get(bm, []):
            cfg = FusedMoEConfig(bm, gemm_cfg(c), gemm_cfg(c))
            calls = [(lambda f=f, cfg=cfg: f(config=cfg)) for f in fns]
            us = measure(calls)
            out.append(dict(config=cfg.to_dict(), us=round(us, 2) if us != float("inf") else None))
            print(f"    sweep T={t} {cfg.to_dict()}: {us:.1f} us", flush=True)
    return sorted(out, key=lambda r: r["us"] if r["us"] is not None else float("inf"))


def bench_shape(name: str, batches, prefill_tokens: int, rates: dict, deadline: float, seed: int = 1,
                weights: str = "bf16", sweep: bool = False) -> dict:
    from attnserve.models.layers.moe import align as align_mod
    from attnserve.models.layers.moe.align import moe_align_block_size
    from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton
    from attnserve.models.layers.moe.tuned_configs import get_fused_moe_config, load_tuned_configs

    sh = SHAPES[name]
    e, h, inter, k = sh["E"], sh["H"], sh["I"], sh["top_k"]
    dev = torch.device(DEV)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, device=DEV, generator=gen) * 0.02).to(DTYPE)
    w2 = (torch.randn(e, h, inter, device=DEV, generator=gen) * 0.02).to(DTYPE)
    w13, w2, scales, scale_bytes = _quantize_experts(w13, w2, weights)
    from attnserve.models.layers.moe.fp8_w8a8 import use_fp8_w8a8

    path_args = _PATH_ARGS.get(weights, {})
    ref_scales = dict(scales)
    scales = {**scales, **path_args}

    def path_of(t: int) -> str:
        if weights == "bf16":
            return "bf16"
        return "w8a8" if use_fp8_w8a8(t, k, e, dev, path_args.get("fp8_w8a8")) else "w8a16"

    def cfg_of(t: int):
        w8a8 = path_of(t) == "w8a8"
        return get_fused_moe_config(t, e, inter, h, k, DTYPE, dev, quant="fp8_w8a8" if w8a8 else None,
                                    block_shape=scales.get("block_shape") if w8a8 else None)

    expert_bytes = 3 * h * inter * w13.element_size() + scale_bytes
    tuned = load_tuned_configs(e, inter, h, DTYPE, torch.cuda.get_device_name()) is not None
    res = {"shape": name, "weights": weights, **sh, "expert_bytes": expert_bytes, "tuned_table": tuned, "decode": [], "prefill": None}
    for bs in batches:
        if time.time() > deadline:
            print(f"  {name}: budget spent at batch {bs}", flush=True)
            break
        routs = [random_routing(bs, e, k, gen) for _ in range(4)]
        xs = [torch.randn(bs, h, device=DEV, generator=gen).to(DTYPE) for _ in routs]
        fns = [(lambda x=x, w=w, ids=ids, config=None: fused_experts_triton(x, w13, w2, w, ids, config=config, **scales))
               for x, (w, ids) in zip(xs, routs)]
        cfg = cfg_of(bs)
        for f in fns:
            f()
        torch.cuda.synchronize()
        us = graph_us(fns, est_us=50.0, replays=10)
        aligns = [(lambda ids=ids: moe_align_block_size(ids, cfg.block_m, e)) for _, ids in routs]
        align_us = graph_us(aligns, est_us=5.0, replays=10)  # for one token the layer skips it
        align_form = "none" if bs == 1 else ("single" if bs * k <= align_mod.SMALL_ALIGN_MAX_SLOTS else "multi")
        distinct = [torch.unique(ids).numel() for _, ids in routs]
        floor_us = statistics.mean(distinct) * expert_bytes / rates["copy_bytes_per_s"] * 1e6
        err = max(_rel_err(f(), x, w13, w2, w, ids, **ref_scales) for f, x, (w, ids) in zip(fns, xs, routs))
        row = dict(batch=bs, path=path_of(bs), us=round(us, 2), align_us=round(align_us, 2), align_form=align_form,
                   distinct_experts=statistics.mean(distinct),
                   floor_us=round(floor_us, 2), share=round(floor_us / us, 3),
                   weight_tbps=round(statistics.mean(distinct) * expert_bytes / us / 1e6, 3),
                   max_rel_err=float(f"{err:.3g}"), config=cfg.to_dict())
        if sweep and row["path"] == "w8a8":
            row["sweep"] = sweep_w8a8(bs, fns, e, k, est_us=us)
        res["decode"].append(row)
        print(f"  {name} [{weights}] bs={bs:4d}: {us:8.1f} us (align {align_us:.1f}), {row['distinct_experts']:.1f} experts, "
              f"floor {floor_us:.1f} us, share {row['share']:.2f}, err {err:.1e}, BM {cfg.block_m}, {row['path']}", flush=True)
    if prefill_tokens and time.time() < deadline:
        t = prefill_tokens
        w, ids = random_routing(t, e, k, gen)
        x = torch.randn(t, h, device=DEV, generator=gen).to(DTYPE)
        cfg = cfg_of(t)
        fn = lambda config=None: fused_experts_triton(x, w13, w2, w, ids, config=config, **scales)  # noqa: E731
        out = fn()
        torch.cuda.synchronize()
        ms = graph_us([fn], est_us=1000.0, replays=7) / 1e3
        flops = 2.0 * t * k * 3 * inter * h
        tflops = flops / (ms * 1e-3) / 1e12
        err = _rel_err(out, x, w13, w2, w, ids, **ref_scales)
        res["prefill"] = dict(tokens=t, path=path_of(t), ms=round(ms, 4), tflops=round(tflops, 1),
                              share=round(tflops * 1e12 / rates["matmul_flops_per_s"], 3),
                              max_rel_err=float(f"{err:.3g}"), config=cfg.to_dict())
        if sweep and res["prefill"]["path"] == "w8a8":
            res["prefill"]["sweep"] = sweep_w8a8(t, [fn], e, k, est_us=ms * 1e3)
        print(f"  {name} [{weights}] prefill {t}: {ms:.3f} ms, {tflops:.0f} TFLOP/s, share {res['prefill']['share']:.2f}, "
              f"err {err:.1e}, BM {cfg.block_m}, {res['prefill']['path']}", flush=True)
    del w13, w2, scales
    torch.cuda.empty_cache()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--budget-s", type=float, default=1e9)
    p.add_argument("--seed", type=int, default=1, help="weights and routings")
    p.add_argument("--quantization", nargs="+", default=["bf16"], choices=list(WEIGHT_FORMATS),
                   help="expert weight formats, one row each: bf16; fp8 / fp8-block (per-channel / 128 x 128 "
                        "scales, W8A8 where fp8_w8a8.use_fp8_w8a8 applies, else W8A16); fp8-w8a16 / "
                        "fp8-block-w8a16 (W8A16 forced); fp8-fast-accum (fp8 with use_fast_accum)")
    p.add_argument("--sweep-w8a8", action="store_true",
                   help="time moe_tune.FP8_W8A8_CANDIDATES on every W8A8 row (recorded as 'sweep', best first)")
    args = p.parse_args()
    import triton

    from attnserve.bench.offline_random import measure_device_rates

    t0 = time.time()
    rates = measure_device_rates()
    print(f"copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written), bf16 matmul "
          f"{rates['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    out = {"date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda, "dtype": str(DTYPE)[6:],
           "ceilings": {"copy_tbps": round(rates["copy_bytes_per_s"] / 1e12, 3),
                        "matmul_bf16_tflops": round(rates["matmul_flops_per_s"] / 1e12, 1)},
           "targets": {"decode_share": 0.70, "prefill_share": 0.55}, "seed": args.seed, "shapes": []}
    deadline = t0 + args.budget_s
    for name in args.shapes:
        for fmt in args.quantization:
            out["shapes"].append(bench_shape(name, args.batches, args.prefill_tokens, rates, deadline, args.seed, fmt,
                                             args.sweep_w8a8))
            with open(args.output, "w") as f:
                json.dump(out, f, indent=1)
    print("\nshape [weights] (share of own floor; '*' = W8A8 path)" )
    print("shape [weights]                 " + " ".join(f"{b:>6d}" for b in args.batches) + "   prefill")
    for r in out["shapes"]:
        shares = {d["batch"]: f"{d['share']:5.2f}" + ("*" if d["path"] == "w8a8" else " ") for d in r["decode"]}
        pre = r["prefill"]
        pre_s = f"{pre['share']:.2f}{'*' if pre['path'] == 'w8a8' else ''} ({pre['ms']:.2f} ms)" if pre else "nan"
        print(f"{r['shape'] + ' [' + r['weights'] + ']':<32}" + " ".join(f"{shares.get(b, '  nan '):>6s}" for b in args.batches)
              + f"   {pre_s}")
    print("\nµs per call:")
    for r in out["shapes"]:
        us = {d["batch"]: d["us"] for d in r["decode"]}
        print(f"{r['shape'] + ' [' + r['weights'] + ']':<32}" + " ".join(f"{us.get(b, float('nan')):7.1f}" for b in args.batches))


if __name__ == "__main__":
    sys.exit(main())
