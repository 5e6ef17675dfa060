"""Which kernels make up one decode step: a CUDA-graph replay under the PyTorch profiler.

``PYTHONPATH=src python benchmarks/profile_step.py [--models smollm2-135m llama-3-8b] [--batch 1] [--kv-cache-dtype fp8_e4m3]
[--context 512] [--variants v1 v2+pdl ...] [--tune-from GEMV_JSON] [--out DIR]``

For each model shape (dummy weights, bf16) it sets up a decode batch as `bench.decode`
does, times the replay with CUDA events, then profiles ``--steps`` replays with
``torch.profiler`` (CUDA activity) and reports per kernel name: launches per step and GPU
microseconds per step. ``busy_us`` (sum of kernel times) against ``step_us`` (event time)
tells how much of a step is kernel work and how much is gaps between kernels (with
programmatic dependent launch, kernels overlap, so ``busy_us`` can exceed ``step_us``).

``--variants`` (A/B in one process): the graphs are re-captured under each variant's
environment (see `VARIANTS`: ``ATTNSERVE_PDL``, ``ATTNSERVE_SKINNY_RULE``,
``ATTNSERVE_DECODE_SMALL_BATCH`` (``attn-small-off`` / ``-on``), read at every
launch), each variant timed and profiled on the same runner and KV cache; ``--batch`` may
list several batch sizes (one graph each). ``tuned`` uses, for each skinny GEMM shape at
M = 1, the fastest PDL candidate of a ``gemv.py --candidates`` JSON (``--tune-from``);
``+lmhead`` runs the LM head through `skinny_linear` too at <= 16 rows (what the model
code does not do). ``--repeat-first`` times the first variant again at the end (drift).
Writes ``<out>/<device>-profile-step-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from collections import defaultdict
from typing import Dict, List, Optional

import torch

from attnserve.bench.offline import fill_decode_kv
from attnserve.bench.results import write_result
from common import time_ms

#: variant -> (environment, use the --tune-from table, LM head through skinny_linear)
VARIANTS = {
    "default": ({}, False, False),
    "v1": ({"ATTNSERVE_PDL": "0", "ATTNSERVE_SKINNY_RULE": "v1"}, False, False),
    "v1+pdl": ({"ATTNSERVE_PDL": "1", "ATTNSERVE_SKINNY_RULE": "v1"}, False, False),
    "v2": ({"ATTNSERVE_PDL": "0", "ATTNSERVE_SKINNY_RULE": "v2"}, False, False),
    "v2+pdl": ({"ATTNSERVE_PDL": "1", "ATTNSERVE_SKINNY_RULE": "v2"}, False, False),
    "tuned": ({"ATTNSERVE_PDL": "1", "ATTNSERVE_SKINNY_RULE": "v2"}, True, False),
    "tuned+lmhead": ({"ATTNSERVE_PDL": "1", "ATTNSERVE_SKINNY_RULE": "v2"}, True, True),
    "v2+pdl+lmhead": ({"ATTNSERVE_PDL": "1", "ATTNSERVE_SKINNY_RULE": "v2"}, False, True),
    # decode attention before / with the small-batch rule (`decode_tuning.small_batch_rule_enabled`)
    "attn-small-off": ({"ATTNSERVE_PDL": "1", "ATTNSERVE_DECODE_SMALL_BATCH": "0"}, False, False),
    "attn-small-on": ({"ATTNSERVE_PDL": "1", "ATTNSERVE_DECODE_SMALL_BATCH": "1"}, False, False),
}


def _short(name: str) -> str:
    return name if len(name) <= 90 else name[:87] + "..."


def make_runner(model: str, max_bs: int, max_ctx: int, capture_bs: List[int], kv_cache_dtype: str = "auto",
                quantization: Optional[str] = None):
    """A `ModelRunner` of the dummy bf16 shape ``model`` on CUDA with graphs for ``capture_bs``,
    a KV cache of ``kv_cache_dtype`` (``auto``: bf16; ``fp8_e4m3`` / ``fp8_e5m2``) and linears
    quantised as ``--quantization`` (None: bf16; ``fp8``)."""
    from attnserve.engine.model_runner import ModelRunner
    from attnserve.model_loader.loader import load_model
    from attnserve.server_args import ServerArgs

    args = ServerArgs(model=model, load_format="dummy", dtype="bfloat16", device="cuda",
                      max_running_requests=max_bs, max_total_tokens=max_bs * (max_ctx + 16),
                      context_length=max_ctx + 16, cuda_graph_bs=sorted(capture_bs), kv_cache_dtype=kv_cache_dtype,
                      quantization=quantization)
    loaded = load_model(model, load_format="dummy", dtype=torch.bfloat16, device="cuda", load_tokenizer=False,
                        quantization=quantization)
    return ModelRunner(args, loaded)


def tuned_table(path: str) -> Dict[tuple, dict]:
    """(N, K, gated) -> config dict of the fastest PDL candidate at M = 1 in a
    ``gemv.py --candidates`` JSON (rows with an error or rel_err > 2e-2 ignored)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    best: Dict[tuple, dict] = {}
    for r in rows:
        if r["M"] != 1 or not r.get("pdl") or "us" not in r or r.get("rel_err", 1.0) > 2e-2:
            continue
        key = (r["N"], r["K"], r["op"] == "gated")
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return {k: dict(v["config"], candidate=v["candidate"], us=v["us"]) for k, v in best.items()}


class _Patches:
    """Benchmark-only monkeypatches of one variant (restored by `undo`)."""

    def __init__(self, runner, table: Optional[Dict[tuple, dict]], lmhead: bool):
        from attnserve.models.layers import skinny_gemm as sg

        self.sg, self.orig_cfg, self.model = sg, sg.skinny_gemm_config, runner.model
        if table:
            orig = self.orig_cfg

            def cfg(M, N, K, dtype, num_sms, *, gated=False):
                c = table.get((N, K, gated)) if M == 1 else None
                if c is None:
                    return orig(M, N, K, dtype, num_sms, gated=gated)
                return sg.SkinnyGemmConfig(c["block_n"], c["block_k"], num_warps=c["num_warps"],
                                           num_stages=c["num_stages"], use_dot=c["use_dot"],
                                           carry=c.get("carry", False), defer=c.get("defer", False))

            sg.skinny_gemm_config = cfg
        if lmhead:
            model = runner.model
            plain = model.compute_logits

            def compute_logits(h):
                if h.dim() == 2 and h.shape[0] <= sg.MAX_SKINNY_M and sg.skinny_gemm_supported(h, model.lm_head_weight):
                    return sg.skinny_linear(h, model.lm_head_weight).float()
                return plain(h)

            model.compute_logits = compute_logits

    def undo(self) -> None:
        self.sg.skinny_gemm_config = self.orig_cfg
        self.model.__dict__.pop("compute_logits", None)


def profile_graph(gr, fb, steps: int) -> dict:
    """Event time of one replay and the per-kernel profile of ``steps`` replays."""
    from torch.profiler import ProfilerActivity, profile

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
    return {"step_us": step_ms * 1e3, "busy_us": sum(k["us_per_step"] for k in kernels),
            "launches_per_step": sum(k["launches_per_step"] for k in kernels), "kernels": kernels}


def _print(model: str, bs: int, ctx: int, variant: str, r: dict, top: int) -> None:
    print(f"{model} bs={bs} ctx={ctx} [{variant}]: step {r['step_us']:.1f} us, kernels busy {r['busy_us']:.1f} us, "
          f"{r['launches_per_step']:.0f} launches/step", flush=True)
    for k in r["kernels"][:top]:
        print(f"  {k['us_per_step']:8.1f} us  x{k['launches_per_step']:5.0f}  {k['name']}", flush=True)


def profile_model(model: str, batches: List[int], ctx: int, steps: int, variants: List[str],
                  table: Optional[Dict[tuple, dict]], repeat_first: bool, top: int,
                  kv_cache_dtype: str = "auto", quantization: Optional[str] = None) -> List[dict]:
    runner = make_runner(model, max(batches), ctx, batches, kv_cache_dtype, quantization)
    gr = runner.cuda_graph_runner
    saved = {k: os.environ.get(k) for k in ("ATTNSERVE_PDL", "ATTNSERVE_SKINNY_RULE", "ATTNSERVE_DECODE_SMALL_BATCH")}
    order = list(variants) + ([variants[0]] if repeat_first and len(variants) > 1 else [])
    rows = []
    for variant in order:
        env, use_table, lmhead = VARIANTS[variant]
        os.environ.update(env)
        patches = _Patches(runner, table if use_table else None, lmhead)
        try:
            gr.capture()  # the graphs hold the launches made under this variant's settings
            for bs in batches:
                req_rows, slots, out_loc, fb = fill_decode_kv(runner, bs, ctx)
                r = profile_graph(gr, fb, steps)
                runner.token_to_kv_pool_allocator.free(torch.cat([slots, out_loc]))
                runner.req_to_token_pool.free(req_rows)
                r.update(model=model, batch=bs, context=ctx, variant=variant, env=env,
                         layers=runner.model_config.num_hidden_layers)
                rows.append(r)
                _print(model, bs, ctx, variant, r, top)
        finally:
            patches.undo()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    del runner, gr
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3-8b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    ap.add_argument("--tune-from", default=None, help="gemv.py --candidates JSON (for the tuned variants)")
    ap.add_argument("--repeat-first", action="store_true", help="time the first variant again at the end")
    ap.add_argument("--top", type=int, default=25, help="kernels printed per profile")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="linear weights (default bf16)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA GPU")
    from attnserve.pdl import pdl_supported

    print(f"PDL supported here: {pdl_supported(torch.device('cuda'))}", flush=True)
    table = tuned_table(args.tune_from) if args.tune_from else None
    if any(VARIANTS[v][1] for v in args.variants) and not table:
        ap.error("the tuned variants need --tune-from")
    if table:
        for key, c in sorted(table.items()):
            print(f"tuned {key}: {c['candidate']} {c['us']:.2f} us", flush=True)
    import triton

    rows = []
    for m in args.models:
        rows += profile_model(m, args.batch, args.context, args.steps, args.variants, table, args.repeat_first,
                              args.top, args.kv_cache_dtype, args.quantization)
    result = {"benchmark": "profile_step", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "kv_cache_dtype": args.kv_cache_dtype,
              "quantization": args.quantization, "tuned_table": {str(k): v for k, v in (table or {}).items()}, "rows": rows}
    print("\nvariant               model          bs   step us   busy us  launches")
    for r in rows:
        print(f"{r['variant']:<22}{r['model']:<15}{r['batch']:>3}{r['step_us']:>10.1f}{r['busy_us']:>10.1f}"
              f"{r['launches_per_step']:>10.0f}")
    write_result(result, args.out, "profile-step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
