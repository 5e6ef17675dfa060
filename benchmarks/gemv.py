"""Skinny GEMM (decode-sized ``M``) vs cuBLAS, with a small tile sweep.

``PYTHONPATH=src python benchmarks/gemv.py [--out DIR] [--ms 1 4 16] [--no-sweep] [--sweep-budget-s 150]``

For the decode projections of SmolLM2-135M, Gemma3-270M and Llama-3-8B (bfloat16; the
shapes in `MODELS`, ``N x K`` = weight rows x columns) and ``M`` activation rows:

* ``cublas``: ``F.linear(x, W)``; ``skinny``: `skinny_linear` with its default config
  (`skinny_gemm_config`); µs per call, TB/s = weight bytes / time, % of the copy bandwidth
  measured in the same run (`copy_bandwidth_gbs`), and the max relative error of the
  skinny result vs cuBLAS (``max |ours - cublas| / max |cublas|``).
* gated (``gate_up`` shapes): `skinny_linear_gated` vs ``F.linear`` + the act-and-mul
  kernel (`silu_and_mul`, or `gelu_tanh_and_mul` for Gemma).
* sweep (unless ``--no-sweep``): for each shape and ``M`` in ``--sweep-ms``, phase 1 times
  ``block_n x block_k x use_dot`` at 4 warps (2 stages; 3 for ``tl.dot``); phase 2 re-times
  the best three with num_warps {4, 8} x num_stages {2, 3, 4}. Configs that cannot fit
  (registers of the broadcast product, shared memory of the dot pipeline) are skipped.
  The sweep stops when ``--sweep-budget-s`` is spent (shapes are visited in the order of
  `MODELS`, linear then gated); ``sweep_complete`` in the JSON says whether it finished.

``--candidates``: instead of the sweep, time at M = 1 the v1 rule's config with and without
programmatic dependent launch (PDL) and the named deferred-reduction candidates
(`CANDIDATES_LINEAR` / `CANDIDATES_GATED`) with PDL, and the ``tl.dot`` default at
``--dot-ms`` with and without PDL; writes ``<out>/<device-slug>-gemv-candidates-<date>.json``.

Timing: a CUDA graph of >= 20 back-to-back calls (launch overhead removed; µs per call,
median of the replays). Each call reads a different copy of the weight, cycling through
enough copies to span 3x the L2 cache, so weights stream from HBM as they do in a real
decode step (activations stay hot, as they are). Writes
``<out>/<device-slug>-gemv-<date>.json`` (default out: benchmarks/results) and prints a
compact table. Needs CUDA; ``--help`` works anywhere.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

#: model -> [(projection, N, K)]; N x K is the weight ([out_features, in_features])
MODELS = {
    "smollm2-135m": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)],
    "gemma3-270m": [("qkv", 1536, 640), ("o", 640, 1024), ("gate_up", 4096, 640), ("down", 640, 2048)],
    "llama-3-8b": [
        ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
        ("lm_head", 128256, 4096),
    ],
    # one rank's shards under tensor parallelism (column-parallel qkv / gate_up / vocabulary,
    # row-parallel o / down), as the tp decode step runs them
    "llama-3-8b-tp2": [("qkv", 3072, 4096), ("o", 4096, 2048), ("gate_up", 14336, 4096), ("down", 4096, 7168),
                       ("lm_head", 64128, 4096)],
    "llama-3-8b-tp4": [("qkv", 1536, 4096), ("o", 4096, 1024), ("gate_up", 7168, 4096), ("down", 4096, 3584),
                       ("lm_head", 32064, 4096)],
    "llama-3-70b-tp4": [("qkv", 2560, 8192), ("o", 8192, 2048), ("gate_up", 14336, 8192), ("down", 8192, 7168),
                        ("lm_head", 32064, 8192)],
}
ACTIVATION = {"smollm2-135m": "silu", "gemma3-270m": "gelu_tanh", "llama-3-8b": "silu", "llama-3-8b-tp2": "silu",
              "llama-3-8b-tp4": "silu", "llama-3-70b-tp4": "silu"}
DTYPE = torch.bfloat16
DEV = "cuda"
MIN_CALLS = 20
REPLAYS = 10
MAX_COPIES = 256
ERR_LIMIT = 2e-2  # bf16: a correct kernel differs from cuBLAS by ~1e-3 of the max |y|

SWEEP_BLOCK_N_DOT = (16, 32, 64)
SWEEP_BLOCK_N_BCAST = (4, 8, 16, 32, 64)
SWEEP_BLOCK_K = (128, 256, 512)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (2, 3, 4)
BCAST_MAX_VALUES_PER_THREAD = 128  # skip broadcast configs whose float32 product exceeds this
DOT_MAX_SMEM = 200 << 10


def _weights(n: int, k: int, gen: torch.Generator) -> List[torch.Tensor]:
    """Copies of a random ``[n, k]`` weight spanning >= 3x L2 (at most MAX_COPIES)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20)
    nbytes = n * k * torch.empty((), dtype=DTYPE).element_size()
    copies = max(1, min(MAX_COPIES, math.ceil(3 * l2 / nbytes)))
    w = torch.randn(copies, n, k, device=DEV, generator=gen, dtype=torch.float32).mul_(1 / math.sqrt(k)).to(DTYPE)
    return list(w.unbind(0))


def _graph_us(fns: List[Callable[[], object]]) -> float:
    from common import bench_graph

    return bench_graph(fns, min_calls=MIN_CALLS, replays=REPLAYS)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _cfg_dict(cfg) -> dict:
    return {"block_n": cfg.block_n, "block_k": cfg.block_k, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "use_dot": cfg.use_dot, "carry": cfg.carry, "defer": cfg.defer}


def _fits(cfg, m: int, k: int, gated: bool) -> bool:
    tiles = 2 if gated else 1
    if cfg.use_dot:
        smem = cfg.num_stages * (16 + tiles * cfg.block_n) * cfg.block_k * 2
        return smem <= DOT_MAX_SMEM
    values = tiles * cfg.block_m(m) * cfg.block_n * cfg.block_k
    return values <= BCAST_MAX_VALUES_PER_THREAD * 32 * cfg.num_warps and cfg.block_k <= max(1024, 2 * k)


class _Case:
    """One (op, N, K, M): inputs, weight copies, the reference, and timed callables."""

    def __init__(self, op: str, n: int, k: int, m: int, activation: Optional[str], gen: torch.Generator):
        self.op, self.n, self.k, self.m, self.activation = op, n, k, m, activation
        self.ws = _weights(n, k, gen)
        self.x = torch.randn(m, k, device=DEV, generator=gen).to(DTYPE)
        self.weight_bytes = n * k * self.ws[0].element_size()
        self.ref = self.peer_once(self.ws[0])

    def peer_once(self, w: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.x, w)
        if self.op == "linear":
            return y
        from attnserve.models.layers.fused_kernels import gelu_tanh_and_mul, silu_and_mul

        return silu_and_mul(y) if self.activation == "silu" else gelu_tanh_and_mul(y)

    def ours_once(self, w: torch.Tensor, cfg, pdl: Optional[bool] = False) -> torch.Tensor:
        from attnserve.models.layers.skinny_gemm import skinny_linear, skinny_linear_gated

        if self.op == "linear":
            return skinny_linear(self.x, w, config=cfg, pdl=pdl)
        return skinny_linear_gated(self.x, w, self.activation, config=cfg, pdl=pdl)

    def time_peer(self) -> float:
        return _graph_us([lambda w=w: self.peer_once(w) for w in self.ws])

    def time_ours(self, cfg, pdl: Optional[bool] = False) -> dict:
        """µs, TB/s and error of one config (None config = default); errors are recorded.
        ``pdl``: launch with programmatic dependent launch (the calls of the timed graph then
        overlap each other's start and end, as consecutive decode kernels do)."""
        row = {"config": _cfg_dict(cfg) if cfg is not None else None, "pdl": pdl}
        try:
            out = self.ours_once(self.ws[0], cfg, pdl)
            torch.cuda.synchronize()
            row["rel_err"] = _rel_err(out, self.ref)
            row["us"] = _graph_us([lambda w=w: self.ours_once(w, cfg, pdl) for w in self.ws])
            row["tbps"] = self.weight_bytes / (row["us"] * 1e-6) / 1e12
        except Exception as e:  # a config that fails to compile or run is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return row


def _sweep(case: _Case) -> List[dict]:
    from attnserve.models.layers.skinny_gemm import SkinnyGemmConfig

    gated = case.op == "gated"
    phase1 = []
    for use_dot in (False, True):
        for bn in SWEEP_BLOCK_N_DOT if use_dot else SWEEP_BLOCK_N_BCAST:
            for bk in SWEEP_BLOCK_K + (() if use_dot or case.k > 1024 else (1024,)):
                cfg = SkinnyGemmConfig(bn, bk, num_warps=4, num_stages=3 if use_dot else 2, use_dot=use_dot)
                if _fits(cfg, case.m, case.k, gated):
                    phase1.append(cfg)
    rows = [dict(case.time_ours(c), phase=1) for c in phase1]
    ok = sorted((r for r in rows if "us" in r and r["rel_err"] <= ERR_LIMIT), key=lambda r: r["us"])
    seen = {tuple(sorted(r["config"].items())) for r in rows}
    for best in ok[:3]:
        c = best["config"]
        for w in SWEEP_WARPS:
            for s in SWEEP_STAGES:
                cfg = SkinnyGemmConfig(c["block_n"], c["block_k"], num_warps=w, num_stages=s, use_dot=c["use_dot"])
                key = tuple(sorted(_cfg_dict(cfg).items()))
                if key in seen or not _fits(cfg, case.m, case.k, gated):
                    continue
                seen.add(key)
                rows.append(dict(case.time_ours(cfg), phase=2))
    return sorted(rows, key=lambda r: r.get("us", float("inf")))


#: named M = 1 candidates of `run_candidates`: (block_n, block_k, num_warps, carry, defer), plain
CANDIDATES_LINEAR = {
    "d512x4w4": (4, 512, 4, False, True), "dc512x4w4": (4, 512, 4, True, True),
    "d1024x4w8": (4, 1024, 8, False, True), "dc1024x4w8": (4, 1024, 8, True, True),
    "d1024x4w4": (4, 1024, 4, False, True), "d1024x2w4": (2, 1024, 4, False, True),
    "d512x8w8": (8, 512, 8, False, True), "d256x8w4": (8, 256, 4, False, True),
    "d2048x2w8": (2, 2048, 8, False, True), "dc512x2w2": (2, 512, 2, True, True),
}
#: the same for the gated form (block_n counts gate rows; a program reads twice as many)
CANDIDATES_GATED = {
    "d512x4w4": (4, 512, 4, False, True), "dc512x4w4": (4, 512, 4, True, True),
    "d512x8w8": (8, 512, 8, False, True), "dc512x8w8": (8, 512, 8, True, True),
    "d1024x4w8": (4, 1024, 8, False, True), "d256x8w4": (8, 256, 4, False, True),
    "d512x4w8": (4, 512, 8, False, True), "d512x2w4": (2, 512, 4, False, True),
}


def run_candidates(models: List[str], dot_ms: List[int], out_dir: Optional[str] = None) -> Dict[str, object]:
    """M = 1: the v1 rule's config with and without PDL, the default (`skinny_gemm_config`,
    with PDL), the named candidates with PDL (and
    the first one without, to separate the two effects); M in ``dot_ms``: the default
    ``tl.dot`` config with and without PDL; the cuBLAS peer (``candidate`` "peer") at those M
    and at M = 64 (no lm_head). One row per (shape, M, candidate, pdl); with
    ``out_dir``, the JSON is rewritten after every shape (a run cut short keeps its rows)."""
    from common import copy_bandwidth_gbs
    from attnserve.bench.results import write_result
    from attnserve.models.layers.skinny_gemm import MAX_SKINNY_M, SkinnyGemmConfig, _rule_v1, skinny_gemm_config

    copy_gbs = copy_bandwidth_gbs()
    torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    # the projections a decode step runs: gate_up only in its gated form; lm_head last (largest)
    todo = []
    for m_ in models:
        shapes = sorted(MODELS[m_], key=lambda t: t[0] == "lm_head")
        todo += [(m_, p, "gated" if p == "gate_up" else "linear", n, k, ACTIVATION[m_] if p == "gate_up" else None)
                 for p, n, k in shapes]
    for model, proj, op, n, k, act in todo:
        gated = op == "gated"
        for m in [1] + [d for d in dot_ms if proj != "lm_head"] + ([64] if proj != "lm_head" else []):
            case = _Case(op, n, k, m, act, gen)
            if m > MAX_SKINNY_M:  # cuBLAS only (what a 64-request decode step runs)
                peer_us = case.time_peer()
                rows.append({"model": model, "proj": proj, "op": op, "N": n, "K": k, "M": m, "candidate": "peer",
                             "weight_bytes": case.weight_bytes, "us": peer_us,
                             "tbps": case.weight_bytes / (peer_us * 1e-6) / 1e12})
                print(f"{model:<11}{proj:<8}{op:<7}M={m:<3}{'peer':<11}       {peer_us:8.2f} us "
                      f"{rows[-1]['tbps']:5.2f} TB/s", flush=True)
                del case
                continue
            v1 = _rule_v1(m, n, k, 2, gated)
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            runs = [("v1", v1, False), ("v1", v1, True),
                    ("default", skinny_gemm_config(m, n, k, DTYPE, sms, gated=gated), True)]
            if m == 1:
                cands = CANDIDATES_GATED if gated else CANDIDATES_LINEAR
                for i, (name, (bn, bk, w, carry, defer)) in enumerate(cands.items()):
                    cfg = SkinnyGemmConfig(bn, bk, num_warps=w, num_stages=1, carry=carry, defer=defer)
                    runs += [(name, cfg, True)] + ([(name, cfg, False)] if i == 0 else [])
            peer_us = case.time_peer()
            rows.append({"model": model, "proj": proj, "op": op, "N": n, "K": k, "M": m, "candidate": "peer",
                         "weight_bytes": case.weight_bytes, "us": peer_us,
                         "tbps": case.weight_bytes / (peer_us * 1e-6) / 1e12})
            print(f"{model:<11}{proj:<8}{op:<7}M={m:<3}{'peer':<11}       {peer_us:8.2f} us "
                  f"{rows[-1]['tbps']:5.2f} TB/s", flush=True)
            for name, cfg, pdl in runs:
                r = case.time_ours(cfg, pdl)
                row = {"model": model, "proj": proj, "op": op, "N": n, "K": k, "M": m, "candidate": name,
                       "weight_bytes": case.weight_bytes, **r}
                if "us" in r:
                    row["pct_copy"] = 100 * r["tbps"] * 1e3 / copy_gbs
                rows.append(row)
                print(f"{model:<11}{proj:<8}{op:<7}M={m:<3}{name:<11}pdl={int(pdl)}  "
                      f"{_fmt(r.get('us'), '8.2f')} us {_fmt(r.get('tbps'), '5.2f')} TB/s "
                      f"err {_fmt(r.get('rel_err'), '.1e')} {r.get('error', '')}", flush=True)
            del case
            torch.cuda.empty_cache()
            if out_dir:
                write_result(_candidates_result(copy_gbs, rows), out_dir, "gemv-candidates")
    return _candidates_result(copy_gbs, rows)


def _candidates_result(copy_gbs: float, rows: List[dict]) -> Dict[str, object]:
    import triton

    return {
        "benchmark": "gemv-candidates", "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "dtype": str(DTYPE), "copy_bandwidth_gbs": copy_gbs,
        "timing": f"CUDA graph of >= {MIN_CALLS} calls over weight copies spanning 3x L2; median of {REPLAYS} replays",
        "rows": rows,
    }


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _cfg_str(c: Optional[dict]) -> str:
    if not c:
        return "-"
    form = "dot" if c["use_dot"] else ("defer" if c.get("defer") else "bc") + ("+carry" if c.get("carry") else "")
    return f"{c['block_n']}x{c['block_k']} w{c['num_warps']} s{c['num_stages']} {form}"


def run(ms: List[int], sweep_ms: List[int], sweep: bool, budget_s: float, models: List[str]) -> Dict[str, object]:
    from common import copy_bandwidth_gbs
    from attnserve.models.layers.skinny_gemm import skinny_gemm_config

    copy_gbs = copy_bandwidth_gbs()
    torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows, sweeps = [], []
    todo = []  # (model, proj, op, n, k, activation)
    for model in models:
        for proj, n, k in MODELS[model]:
            todo.append((model, proj, "linear", n, k, None))
    for model in models:
        for proj, n, k in MODELS[model]:
            if proj == "gate_up":
                todo.append((model, proj, "gated", n, k, ACTIVATION[model]))
    t_sweep, sweep_complete = 0.0, True
    for model, proj, op, n, k, act in todo:
        for m in sorted(set(ms) | (set(sweep_ms) if sweep else set())):
            case = _Case(op, n, k, m, act, gen)
            peer_us = case.time_peer()
            ours = case.time_ours(None)
            default = skinny_gemm_config(m, n, k, DTYPE, num_sms, gated=op == "gated")
            row = {
                "model": model, "proj": proj, "op": op, "activation": act, "N": n, "K": k, "M": m,
                "weight_bytes": case.weight_bytes, "weight_copies": len(case.ws),
                "peer": "F.linear" if op == "linear" else f"F.linear+{act}_and_mul",
                "peer_us": peer_us, "peer_tbps": case.weight_bytes / (peer_us * 1e-6) / 1e12,
                "default_config": _cfg_dict(default), "default_us": ours.get("us"),
                "default_tbps": ours.get("tbps"), "default_rel_err": ours.get("rel_err"),
                "default_error": ours.get("error"),
            }
            if ours.get("us"):
                row["speedup_vs_peer"] = peer_us / ours["us"]
                row["default_pct_copy"] = 100 * ours["tbps"] * 1e3 / copy_gbs
            if sweep and m in sweep_ms:
                if t_sweep < budget_s:
                    t0 = time.perf_counter()
                    entries = _sweep(case)
                    t_sweep += time.perf_counter() - t0
                    best = next((e for e in entries if "us" in e and e["rel_err"] <= ERR_LIMIT), None)
                    if best is not None:
                        row.update(best_config=best["config"], best_us=best["us"], best_tbps=best["tbps"],
                                   best_pct_copy=100 * best["tbps"] * 1e3 / copy_gbs)
                    sweeps.append({"model": model, "proj": proj, "op": op, "N": n, "K": k, "M": m, "entries": entries})
                else:
                    sweep_complete = False
            rows.append(row)
            print(f"{model:<13}{proj:<8}{op:<7}{n:>7}{k:>6}{m:>4}  {peer_us:8.2f}  {_fmt(row['default_us'], '8.2f')}"
                  f"  {_fmt(row.get('best_us'), '8.2f')}  [{_cfg_str(row.get('best_config'))}]", flush=True)
            del case
            torch.cuda.empty_cache()
    import triton

    return {
        "benchmark": "gemv", "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "dtype": str(DTYPE), "num_sms": num_sms, "copy_bandwidth_gbs": copy_gbs,
        "timing": f"CUDA graph of >= {MIN_CALLS} calls over weight copies spanning 3x L2; median of {REPLAYS} replays",
        "sweep_budget_s": budget_s, "sweep_seconds": t_sweep, "sweep_complete": sweep_complete,
        "rows": rows, "sweep": sweeps,
    }


def print_table(result: dict) -> None:
    copy = result["copy_bandwidth_gbs"] / 1e3
    print(f"\n{result['device']}: copy {copy:.2f} TB/s; µs per call (CUDA graph), TB/s of weight bytes")
    hdr = (f"{'model':<13}{'proj':<8}{'op':<7}{'N':>7}{'K':>6}{'M':>4}{'peer':>8}{'TB/s':>6}{'skinny':>8}{'TB/s':>6}"
           f"{'x':>6}{'err':>8}{'best':>8}{'TB/s':>6}  best config")
    print(hdr)
    print("-" * len(hdr))
    for r in result["rows"]:
        print(
            f"{r['model']:<13}{r['proj']:<8}{r['op']:<7}{r['N']:>7}{r['K']:>6}{r['M']:>4}"
            f"{r['peer_us']:>8.2f}{r['peer_tbps']:>6.2f}{_fmt(r['default_us'], '.2f'):>8}"
            f"{_fmt(r['default_tbps'], '.2f'):>6}{_fmt(r.get('speedup_vs_peer'), '.2f'):>6}"
            f"{_fmt(r['default_rel_err'], '.1e'):>8}{_fmt(r.get('best_us'), '.2f'):>8}"
            f"{_fmt(r.get('best_tbps'), '.2f'):>6}  {_cfg_str(r.get('best_config'))}"
            + (f"  ERROR {r['default_error']}" if r.get("default_error") else "")
        )
    bad = [r for r in result["rows"] if (r["default_rel_err"] or 0) > ERR_LIMIT]
    if bad:
        print(f"WARNING: {len(bad)} default-config results differ from the peer by > {ERR_LIMIT}")
    if not result["sweep_complete"]:
        print(f"sweep stopped after {result['sweep_seconds']:.0f} s (budget); rows without 'best' were not swept")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="directory of the JSON result")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16], help="activation rows M to time")
    ap.add_argument("--sweep-ms", type=int, nargs="+", default=[1, 4, 16], help="M values to sweep configs for")
    ap.add_argument("--no-sweep", action="store_true", help="time cuBLAS and the default config only")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0, help="stop sweeping after this many seconds")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--candidates", action="store_true",
                    help="time the named M=1 candidates and PDL on/off (run_candidates) instead of the sweep")
    ap.add_argument("--dot-ms", type=int, nargs="*", default=[4],
                    help="--candidates: M values (>= 2) at which the tl.dot default is timed with and without PDL")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gemv.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    from attnserve.bench.results import write_result
    from attnserve.models.layers.skinny_gemm import MAX_SKINNY_M

    bad_m = [m for m in args.ms + args.sweep_ms if not 1 <= m <= MAX_SKINNY_M]
    if bad_m:
        ap.error(f"M values must be in 1..{MAX_SKINNY_M}: {bad_m}")
    t0 = time.perf_counter()
    if args.candidates:
        result = run_candidates(args.models, args.dot_ms, args.out)
        result["total_seconds"] = time.perf_counter() - t0
        write_result(result, args.out, "gemv-candidates")
        return 0
    result = run(args.ms, args.sweep_ms, not args.no_sweep, args.sweep_budget_s, args.models)
    result["total_seconds"] = time.perf_counter() - t0
    print_table(result)
    write_result(result, args.out, "gemv")
    print(f"({result['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
