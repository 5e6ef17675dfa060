"""Sweep of the fused MoE GEMM launch configurations; writes the tuned tables of
`attnserve.models.layers.moe.tuned_configs`.

``PYTHONPATH=src:benchmarks python benchmarks/moe_tune.py --output tune.json --config-dir DIR
[--shapes ...] [--tokens ...] [--precompile-workers 12] [--budget-s 130]``

For each MoE shape (`SHAPES`: Qwen3-30B-A3B, DeepSeek-V2-Lite, Mixtral-8x7B at tp 1 and 2,
gpt-oss-20b timed with SiLU and no biases, the same GEMMs; bfloat16 weights) and token
count ``T`` (`TOKENS`: 1..256 and 512..8192), with uniform
random top-k routing:

* the M tiles worth trying follow the mean slots per expert ``a = T top_k / E``
  (`block_m_choices`); for each, the routing is aligned once (``T = 1``: slot blocks,
  no alignment, as `fused_experts_triton` runs it) and each GEMM (gate-up with
  SiLU-and-mul, and down with the routed weight) is timed alone for every candidate of
  `CANDIDATES` (block N / K, warps, stages); the best is re-timed with a few
  ``GROUP_SIZE_M`` values (a run-time argument: no compile);
* the entry kept is the M tile with the smallest gate-up + down time, each GEMM with its
  own best parameters.

Timing: a CUDA graph of back-to-back launches (enough for ~2 ms, at least one per
routing), median of 5 replays, µs per launch. Up to 4 routings are cycled so that the
experts read change from call to call (the weights of every shape exceed the 50 MB L2).
Configs that do not compile or fit are skipped.

``--precompile-workers N``: first compile every candidate in N spawned processes (each on
a two-expert copy of the shape, which shares every specialisation with the real one), so
the sweep finds them in Triton's on-disk cache. ``--precompile-only`` stops there.

Outputs: ``--output`` (one JSON: device, versions, every measurement and the tables) and,
with ``--config-dir``, one table file per shape (`config_file_name`). ``--unpack BUNDLE
--config-dir DIR`` writes the tables of an earlier bundle (the device tool returns only
plain file names, so tables travel inside the bundle). Needs CUDA except for ``--unpack``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Dict, List, Sequence

import torch

SHAPES = {
    "qwen3-30b-a3b": dict(E=128, H=2048, I=768, top_k=8),
    "deepseek-v2-lite": dict(E=64, H=2048, I=1408, top_k=6),
    "mixtral-8x7b": dict(E=8, H=4096, I=14336, top_k=2),
    "mixtral-8x7b-tp2": dict(E=8, H=4096, I=7168, top_k=2),
    "gpt-oss-20b": dict(E=32, H=2880, I=2880, top_k=4),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
DTYPE = torch.bfloat16
DEV = "cuda"
#: M tile -> (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages, GROUP_SIZE_M)
CANDIDATES = {
    16: [(32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (64, 256, 4, 3, 1), (128, 128, 4, 3, 1), (32, 256, 4, 4, 1),
         (16, 256, 4, 4, 1), (64, 64, 4, 6, 1), (128, 64, 4, 4, 1), (64, 128, 8, 4, 1), (32, 128, 2, 5, 1),
         (64, 256, 8, 3, 1), (128, 128, 8, 3, 1)],
    32: [(32, 128, 4, 4, 8), (64, 128, 4, 4, 8), (64, 256, 4, 3, 8), (128, 64, 4, 4, 8), (64, 128, 8, 4, 8),
         (128, 128, 8, 3, 8)],
    64: [(64, 128, 4, 4, 8), (128, 64, 4, 4, 8), (128, 64, 8, 4, 8), (256, 64, 8, 3, 8), (128, 128, 8, 3, 8),
         (256, 64, 8, 4, 8)],
    128: [(128, 64, 8, 4, 16), (256, 64, 8, 3, 16), (128, 128, 8, 3, 16), (256, 64, 8, 4, 16), (128, 64, 8, 5, 16),
          (256, 32, 8, 5, 16), (128, 64, 4, 4, 16)],
}
#: W8A8 FP8 experts (e4m3 x e4m3 dots; `tuned_configs.default_config_fp8_w8a8`): M tile ->
#: (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages, GROUP_SIZE_M); BLOCK_SIZE_K 128 (one
#: scale group a K step), 3 - 4 stages. Swept by ``benchmarks/moe_layer.py --sweep-w8a8``.
FP8_W8A8_CANDIDATES = {
    16: [(64, 128, 4, 4, 1), (128, 128, 4, 3, 1)],
    32: [(128, 128, 4, 4, 8), (64, 128, 4, 4, 8), (128, 128, 8, 3, 8)],
    64: [(128, 128, 4, 4, 8), (128, 128, 8, 3, 8), (256, 128, 8, 3, 8), (64, 128, 4, 4, 8)],
    128: [(128, 128, 8, 4, 16), (256, 128, 8, 3, 16), (128, 128, 4, 4, 16), (256, 128, 8, 4, 16)],
}
GROUP_RETRY = {16: (), 32: (1, 32), 64: (1, 32), 128: (1, 64)}
TARGET_MS = 2.0  # graph length per measurement
REPLAYS = 5


def block_m_choices(t: int, top_k: int, e: int) -> List[int]:
    a = t * top_k / e
    if a <= 4:
        return [16]
    if a <= 16:
        return [16, 32]
    if a <= 48:
        return [32, 64]
    if a <= 160:
        return [64, 128]
    return [128, 64]


def gemm_cfg(c):
    from attnserve.models.layers.moe.tuned_configs import MoEGemmConfig

    return MoEGemmConfig(block_n=c[0], block_k=c[1], num_warps=c[2], num_stages=c[3], group_m=c[4])


def graph_us(fns: Sequence[Callable[[], object]], est_us: float, replays: int = REPLAYS) -> float:
    """Median µs per call of a CUDA graph of back-to-back calls cycling through ``fns``
    (`common.bench_graph`), about ``TARGET_MS`` of work (at most 32 calls) a replay."""
    from common import bench_graph

    calls = max(1, math.ceil(min(32, max(1, TARGET_MS * 1e3 / max(est_us, 1.0)))))
    return bench_graph(fns, min_calls=calls, replays=replays)


def eager_us(fn) -> float:
    """One warm call between events (compile happens in the first, untimed call)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def measure(fns) -> float:
    """µs per call, or inf when the config fails to compile / launch."""
    try:
        est = eager_us(fns[0])
        return graph_us(fns, est)
    except Exception as e:  # out of resources, compile errors: the candidate is skipped
        print(f"    skip: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
        torch.cuda.synchronize()
        return math.inf


def random_routing(t: int, e: int, k: int, gen: torch.Generator):
    ids = torch.rand(t, e, device=DEV, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(t, k, device=DEV, generator=gen), dim=-1)
    return w, ids


def tune_shape(name: str, tokens: Sequence[int], deadline: float, log: List[dict]) -> Dict[str, dict]:
    from attnserve.models.layers.moe.align import moe_align_block_size
    from attnserve.models.layers.moe.fused_moe_triton import invoke_fused_moe_kernel

    sh = SHAPES[name]
    e, h, inter, k = sh["E"], sh["H"], sh["I"], sh["top_k"]
    gen = torch.Generator(device=DEV).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, device=DEV, generator=gen) * 0.02).to(DTYPE)
    w2 = (torch.randn(e, h, inter, device=DEV, generator=gen) * 0.02).to(DTYPE)
    table = {}
    for t in tokens:
        if time.time() > deadline:
            print(f"  {name}: budget spent, T >= {t} not tuned", flush=True)
            break
        n_rout = 4 if t <= 256 else (2 if t <= 1024 else 1)
        routs = [random_routing(t, e, k, gen) for _ in range(n_rout)]
        x = torch.randn(t, h, device=DEV, generator=gen).to(DTYPE)
        s = t * k
        best = None
        slot = t == 1  # as fused_experts_triton: one token needs no alignment (slot blocks)
        for bm in block_m_choices(t, k, e):
            if slot:
                aligned = [(ids.reshape(-1),) * 3 for _, ids in routs]
            else:
                aligned = [moe_align_block_size(ids, bm, e) for _, ids in routs]
            acts = [torch.randn(s, inter, device=DEV, generator=gen).to(DTYPE) for _ in routs]
            outs = [torch.empty(s, inter, device=DEV, dtype=DTYPE) for _ in routs]
            outs2 = [torch.empty(s, h, device=DEV, dtype=DTYPE) for _ in routs]
            flat_w = [w.reshape(-1).contiguous() for w, _ in routs]

            def g1(cfg, r):
                return lambda: invoke_fused_moe_kernel(x, w13, outs[r], None, *aligned[r], k, s, bm, cfg, gated=True,
                                                       slot_blocks=slot)

            def g2(cfg, r):
                return lambda: invoke_fused_moe_kernel(acts[r], w2, outs2[r], flat_w[r], *aligned[r], 1, s, bm, cfg,
                                                       gated=False, slot_blocks=slot)

            picks = {}
            for which, mk in (("gemm1", g1), ("gemm2", g2)):
                res = []
                for c in CANDIDATES[bm]:
                    cfg = gemm_cfg(c)
                    us = measure([mk(cfg, r) for r in range(n_rout)])
                    res.append((us, cfg))
                    log.append(dict(shape=name, T=t, block_m=bm, gemm=which, config=cfg.to_dict(), us=us))
                us0, cfg0 = min(res, key=lambda p: p[0])
                for gm in GROUP_RETRY[bm]:
                    cfg = gemm_cfg((cfg0.block_n, cfg0.block_k, cfg0.num_warps, cfg0.num_stages, gm))
                    us = measure([mk(cfg, r) for r in range(n_rout)])
                    log.append(dict(shape=name, T=t, block_m=bm, gemm=which, config=cfg.to_dict(), us=us))
                    if us < us0:
                        us0, cfg0 = us, cfg
                picks[which] = (us0, cfg0)
            total = picks["gemm1"][0] + picks["gemm2"][0]
            print(f"  {name} T={t} BM={bm}: gate-up {picks['gemm1'][0]:.1f} us {picks['gemm1'][1].to_dict()} | "
                  f"down {picks['gemm2'][0]:.1f} us {picks['gemm2'][1].to_dict()}", flush=True)
            if math.isfinite(total) and (best is None or total < best[0]):
                best = (total, bm, picks)
            del aligned, acts, outs, outs2
        if best is not None:
            _, bm, picks = best
            table[str(t)] = {"BLOCK_SIZE_M": bm, "gemm1": picks["gemm1"][1].to_dict(),
                             "gemm2": picks["gemm2"][1].to_dict(),
                             "us": {"gemm1": round(picks["gemm1"][0], 2), "gemm2": round(picks["gemm2"][0], 2)}}
    del w13, w2
    torch.cuda.empty_cache()
    return table


def _compile_jobs(shapes: Sequence[str]) -> List[tuple]:
    """One job per distinct compiled specialisation: (shape, bm, candidate, gated, slot blocks)."""
    seen, jobs = set(), []
    for name in shapes:
        sh = SHAPES[name]
        for bm, cands in CANDIDATES.items():
            for c in cands:
                for gated in (True, False):
                    for slot in ((False, True) if bm == 16 else (False,)):
                        k_red = sh["H"] if gated else sh["I"]
                        key = (bm, c[:4], gated, k_red % c[1] == 0, slot)
                        if key not in seen:
                            seen.add(key)
                            jobs.append((name, bm, c, gated, slot))
    return jobs


def _compile_worker(jobs: List[tuple]) -> int:
    """Compile ``jobs`` by launching each once on a two-expert copy of its shape."""
    from attnserve.models.layers.moe.align import moe_align_block_size
    from attnserve.models.layers.moe.fused_moe_triton import invoke_fused_moe_kernel

    done = 0
    for job in jobs:
        try:
            if job[0] == "align":
                _, e, s = job
                moe_align_block_size(torch.randint(0, e, (s,), device=DEV, dtype=torch.int32), 16, e)
                done += 1
                continue
            name, bm, c, gated, slot = job
            sh = SHAPES[name]
            h, inter, k = sh["H"], sh["I"], sh["top_k"]
            ids = (torch.arange(k, device=DEV, dtype=torch.int32) % 2).view(1, k)
            st, ex, n = (ids.reshape(-1),) * 3 if slot else moe_align_block_size(ids, bm, 2)
            cfg = gemm_cfg(c)
            if gated:
                x = torch.randn(1, h, device=DEV).to(DTYPE)
                w = torch.randn(2, 2 * inter, h, device=DEV).to(DTYPE)
                invoke_fused_moe_kernel(x, w, torch.empty(k, inter, device=DEV, dtype=DTYPE), None, st, ex, n, k, k,
                                        bm, cfg, gated=True, slot_blocks=slot)
            else:
                a = torch.randn(k, inter, device=DEV).to(DTYPE)
                w = torch.randn(2, h, inter, device=DEV).to(DTYPE)
                invoke_fused_moe_kernel(a, w, torch.empty(k, h, device=DEV, dtype=DTYPE),
                                        torch.rand(k, device=DEV), st, ex, n, 1, k, bm, cfg, gated=False,
                                        slot_blocks=slot)
            torch.cuda.synchronize()
            done += 1
        except Exception as e:  # reported by the sweep itself when it meets the config
            print(f"  precompile {job}: {type(e).__name__}", flush=True)
    return done


def precompile(shapes: Sequence[str], workers: int) -> None:
    import multiprocessing as mp

    jobs = _compile_jobs(shapes)
    for e in sorted({SHAPES[n]["E"] for n in shapes}):
        jobs += [("align", e, 64), ("align", e, 8192)]
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        done = sum(ex.map(_compile_worker, [c for c in chunks if c]))
    print(f"precompiled {done}/{len(jobs)} kernels in {time.time() - t0:.1f} s with {workers} workers", flush=True)


def write_tables(bundle: dict, config_dir: str) -> List[str]:
    os.makedirs(config_dir, exist_ok=True)
    written = []
    for fname, table in bundle["tables"].items():
        entries = sorted(table["configs"].items(), key=lambda kv: int(kv[0]))
        lines = [f'  {json.dumps(k)}: {json.dumps(v)}' for k, v in entries]
        with open(os.path.join(config_dir, fname), "w") as f:
            f.write('{"meta": ' + json.dumps(table["meta"]) + ',\n "configs": {\n' + ",\n".join(lines) + "\n}}\n")
        written.append(fname)
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default=None, help="bundle JSON (measurements + tables)")
    p.add_argument("--config-dir", default=None, help="write one table file per shape here")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new token counts after this")
    p.add_argument("--precompile-workers", type=int, default=0)
    p.add_argument("--precompile-only", action="store_true")
    p.add_argument("--unpack", default=None, help="write the tables of this bundle to --config-dir and exit")
    args = p.parse_args()
    if args.unpack:
        with open(args.unpack) as f:
            print("\n".join(write_tables(json.load(f), args.config_dir or ".")))
        return
    t_start = time.time()
    if args.precompile_workers > 0:
        precompile(args.shapes, args.precompile_workers)
        if args.precompile_only:
            return
    import triton

    from attnserve.models.layers.moe.tuned_configs import config_file_name

    dev = torch.cuda.get_device_name()
    bundle = {"date": dt.date.today().isoformat(), "device": dev, "torch": torch.__version__,
              "triton": triton.__version__, "cuda": torch.version.cuda, "dtype": str(DTYPE)[6:],
              "candidates": {str(k): v for k, v in CANDIDATES.items()}, "tables": {}, "measurements": []}
    deadline = t_start + args.budget_s
    for name in args.shapes:
        sh = SHAPES[name]
        table = tune_shape(name, args.tokens, deadline, bundle["measurements"])
        if not table:
            continue
        meta = dict(E=sh["E"], N=sh["I"], K=sh["H"], top_k=sh["top_k"], dtype=str(DTYPE)[6:], device_name=dev,
                    shape=name, date=bundle["date"], tool="benchmarks/moe_tune.py", torch=torch.__version__,
                    triton=triton.__version__)
        fname = config_file_name(sh["E"], sh["I"], sh["H"], DTYPE, dev)
        bundle["tables"][fname] = {"meta": meta, "configs": table}
        if args.output:  # after every shape: a timeout keeps what was done
            with open(args.output, "w") as f:
                json.dump(bundle, f, indent=1)
        if args.config_dir:
            write_tables({"tables": {fname: bundle["tables"][fname]}}, args.config_dir)
    print(f"tuned {len(bundle['tables'])} shapes in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
