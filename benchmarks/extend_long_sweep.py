"""Long causal prefill through the extend kernel: the default config against its candidates.

``PYTHONPATH=src python benchmarks/extend_long_sweep.py [--rounds 3] [--only NAME,...] [--cases NAME,...]
[--shape llama-3-8b|phi-3-mini] [--out DIR]``

Issue 37's prefill target: the Llama-3-8B shape (Hq 32, Hkv 8, D 128, bf16) spends ~42 ms of an
8,190-token FP8 prefill in `_extend_fwd_kernel` (~418 TFLOP/s). This run times, in one process
on one GPU, the launch's own default (``default``: `extend_config` as `extend_attention_fwd`
asks it, which on sm_90 depends on the longest extend, `extend_tuning`) and each candidate of
``CANDIDATES``: tile shapes and ``ExtendConfig.kv_desc`` (TMA-descriptor reads, which apply to
plain prefills only) over the old default (128, 64, 8, 3), which is itself the candidate
``old-default``. Cases (``CASES``; the default ``--cases`` are the first four):

* ``1x8190``, ``4x2048``, ``16x512``: plain causal prefills (``has_prefix=False``, as the
  triton backend launches them);
* ``1x4096+4096``: one chunked-prefill chunk, 4,096 new tokens over a 4,096-token cached
  prefix on randomly permuted 16-slot pages (``has_prefix=True``);
* ``1x2560``, ``1x3072``, ``1x4096``: plain prefills between the two measured points of the sm_90
  rule's threshold (2,048 and 8,190 tokens).

Per case and candidate: the output is first compared with the default kernel's on the same
inputs (``bitwise_equal``, ``max_abs_diff``, ``rel_err`` = ||out - default|| / ||default||;
a candidate with ``rel_err`` > 1e-2 or an error is not timed), then timed as the median over
``--rounds`` interleaved rounds of CUDA-graph replays (5 launches a graph, 15 replays after a
warm-up launch; `kernel_timings.graph_us`), in µs per launch.

FLOPs (the convention of FlashAttention and of ``benchmarks/kernels.py``): a request with
``p`` cached and ``n`` new tokens counts ``4 * Hq * D * (n * p + n**2 / 2)``: QK^T and PV are
each ``2 * D`` flops per visible (query, key) pair and head, with ``n**2 / 2`` pairs for the
causal block (exactly ``n * (n + 1) / 2``; the convention drops the diagonal's ``n / 2``). One
8,190-token request: 0.549 TFLOP a layer, 17.6 TFLOP over 32 layers. ``tflops`` = FLOPs / time;
``pct_matmul`` = that over the bf16 8192^3 ``torch.matmul`` rate measured in the same run.

``--shape phi-3-mini`` (Hq 32, Hkv 32, D 96) times `PHI3_CANDIDATES` instead: the same tiles with
K's head of 96 read as 64 + 32 (the default) or whole, padded to 128 (``ExtendConfig.whole_dk``);
the JSON's kind is then ``extend-long-sweep-phi-3-mini``. ``--shape gemma-2-9b`` / ``gemma3-270m``
(head size 256, with the models' logit cap and sliding window, `SHAPE_LAUNCH`) time
`HEAD256_CANDIDATES` over their default tiles (their FLOPs still count the whole causal block, so
TFLOP/s overstate the windowed long cases: compare µs).

Writes ``<out>/<device>-extend-long-sweep-<date>.json`` (date, device, torch / triton / CUDA
versions, the matmul rate, every round) and prints one table. About 2-3 minutes on an H100,
most of it compiling the candidates (``--budget-s`` stops adding candidates after that many
seconds; the skipped ones are listed). A candidate that does not compile is listed with its
error: offline, Triton 3.6's ptxas 12.8 crashed on "desc" (K and V descriptors, 3 stages) but
not on the others (``scripts/extend_variants_offline.py``); ``TRITON_PTXAS_PATH`` can point
Triton at a newer ptxas (the ptxas used is recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_timings import graph_us  # noqa: E402

from attnserve.attention.triton_ops.extend_attention import ExtendConfig, extend_attention_fwd, extend_config  # noqa: E402
from attnserve.bench.results import cuda_run_metadata, write_result  # noqa: E402

#: --shape -> (Hq, Hkv, D)
SHAPES = {"llama-3-8b": (32, 8, 128), "phi-3-mini": (32, 32, 96), "gemma-2-9b": (16, 8, 256),
          "gemma3-270m": (4, 1, 256)}
#: --shape -> the launch's logit cap and sliding window (``sliding_window_size``), as the model's layers
#: pass them
SHAPE_LAUNCH = {"gemma-2-9b": dict(logit_cap=50.0, sliding_window_size=4095),
                "gemma3-270m": dict(sliding_window_size=511)}
DEVICE = "cuda"
# name -> ExtendConfig fields over the default (128, 64, 8, 3) for D 128 bf16
CANDIDATES = {
    "old-default": dict(),
    "desc": dict(kv_desc="kv"),
    "desc-k": dict(kv_desc="k"),
    "128x64x8x4+desc": dict(num_stages=4, kv_desc="kv"),
    "128x64x8x2+desc": dict(num_stages=2, kv_desc="kv"),
    "128x128x8x3+desc": dict(block_n=128, kv_desc="kv"),
    # one warpgroup a program and two (64x32: three) programs an SM (offline: 187 / 179 / 160
    # registers, 112 / 80 / 64 KB of shared memory): one program's softmax can run under
    # another's MMAs, which the CTA-wide barrier of each loop iteration forbids between the
    # two warpgroups of one 128-row program; but they read K/V from L2 twice as often (NOTES.md)
    "64x64x4x3": dict(block_m=64, num_warps=4),
    "64x64x4x2": dict(block_m=64, num_warps=4, num_stages=2),
    "64x64x4x2+desc": dict(block_m=64, num_warps=4, num_stages=2, kv_desc="kv"),
    "64x32x4x3": dict(block_m=64, block_n=32, num_warps=4),
}
# --shape phi-3-mini: name -> ExtendConfig fields over (128, 64, 8, 3)
PHI3_CANDIDATES = {
    "old-default": dict(),
    "whole": dict(whole_dk=True),
    "128x64x8x2+whole": dict(num_stages=2, whole_dk=True),
    "64x64x4x3": dict(block_m=64, num_warps=4),
    "64x64x4x3+whole": dict(block_m=64, num_warps=4, whole_dk=True),
    "64x32x4x3+whole": dict(block_m=64, block_n=32, num_warps=4, whole_dk=True),
    "128x32x8x3+whole": dict(block_n=32, whole_dk=True),
}
# --shape gemma-2-9b / gemma3-270m (head size 256): name -> ExtendConfig fields over their default,
# `extend_tuning.HEAD256_TILE` (128, 32, 8, 2) since 2026-11-28, when this sweep measured it 1.31-1.75x
# the old (64, 64, 8, 2) on one H200 (results/h200-extend-long-sweep-{gemma-2-9b,gemma3-270m}-2026-11-28.json;
# the old tile spilled 72-204 bytes with the models' window / cap offline, this one 0-4;
# scripts/family_kernels_offline.py). The others lost 3-20% to the old tile except 32x64x4x2 (+3-22%).
HEAD256_CANDIDATES = {
    "64x64x8x2 (old)": dict(block_m=64, block_n=64),
    "64x32x8x2": dict(block_m=64),
    "32x64x4x2": dict(block_m=32, block_n=64, num_warps=4),
    "32x32x4x2": dict(block_m=32, num_warps=4),
}
# name -> (new tokens per request, prefix tokens per request, requests)
CASES = {"1x8190": (8190, 0, 1), "4x2048": (2048, 0, 4), "16x512": (512, 0, 16), "1x4096+4096": (4096, 4096, 1),
         "1x2560": (2560, 0, 1), "1x3072": (3072, 0, 1), "1x4096": (4096, 0, 1)}
DEFAULT_CASES = ("1x8190", "4x2048", "16x512", "1x4096+4096")


def case_flops(n: int, p: int, bs: int, shape: str = "llama-3-8b") -> float:
    """Causal attention FLOPs of ``bs`` requests of ``n`` new tokens over ``p`` cached ones."""
    hq, _, d = SHAPES[shape]
    return bs * 4 * hq * d * (n * p + n * n / 2)


def build_case(n: int, p: int, bs: int, page: int = 16, seed: int = 0, shape: str = "llama-3-8b") -> dict:
    """Seeded bf16 inputs of `SHAPES` [shape]; the prefix (if any) on random pages of ``page`` slots."""
    HQ, HKV, D = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    t = n * bs
    q = torch.randn(t, HQ, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    pages = -(-p // page) * bs
    slots = (pages + 1) * page
    kb = torch.randn(slots, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    vb = torch.randn(slots, HKV, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(pages, device=DEVICE, generator=g) + 1  # page 0 reserved, as in the pools
    idx = []
    for i in range(bs):
        j = torch.arange(p, device=DEVICE)
        idx.append(perm[i * (pages // bs) + j // page] * page + j % page)
    kv_indices = (torch.cat(idx) if p else torch.zeros(1, device=DEVICE, dtype=torch.long)).to(torch.int32)
    qo = torch.arange(bs + 1, device=DEVICE, dtype=torch.int32) * n
    kv_indptr = torch.arange(bs + 1, device=DEVICE, dtype=torch.int32) * p
    return dict(q=q, k=k, v=v, kb=kb, vb=vb, qo=qo, kv_indptr=kv_indptr, kv_indices=kv_indices, n=n, p=p,
                o=torch.empty_like(q), d=D, launch=SHAPE_LAUNCH.get(shape, {}))


def launch(c: dict, config) -> None:
    extend_attention_fwd(c["q"], c["k"], c["v"], c["o"], c["kb"], c["vb"], c["qo"], c["kv_indptr"],
                         c["kv_indices"], None, True, None, c["n"], c["d"] ** -0.5, config=config,
                         has_prefix=c["p"] > 0, **c["launch"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated case names of {list(CASES)}")
    ap.add_argument("--budget-s", type=float, default=200.0, help="add no candidate after this many seconds")
    ap.add_argument("--shape", default="llama-3-8b", choices=list(SHAPES))
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    table = {"phi-3-mini": PHI3_CANDIDATES, "gemma-2-9b": HEAD256_CANDIDATES,
             "gemma3-270m": HEAD256_CANDIDATES}.get(args.shape, CANDIDATES)
    head_dim = SHAPES[args.shape][2]
    t0 = time.perf_counter()
    from attnserve.bench.offline_random import measure_device_rates

    mm = measure_device_rates()["matmul_flops_per_s"]
    print(f"bf16 8192^3 matmul: {mm / 1e12:.0f} TFLOP/s", flush=True)
    names = [x for x in args.only.split(",") if x] or list(table)
    unknown = [x for x in names if x not in table]
    if unknown:
        raise SystemExit(f"unknown candidates {unknown}; known: {list(table)}")
    res = {"matmul_bf16_tflops": mm / 1e12, "shape": args.shape, "candidates": {k: table[k] for k in names},
           "cases": {}, "skipped_for_budget": []}
    for case_name in [x for x in args.cases.split(",") if x]:
        n, p, bs = CASES[case_name]
        c = build_case(n, p, bs, shape=args.shape)
        if args.shape == "phi-3-mini":  # the tiles before the whole-K rule, K as 64 + 32
            old = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, block_n_prefix=128 if p else None)
        else:  # no device or length: the old default
            old = extend_config(head_dim, head_dim, torch.bfloat16, has_prefix=p > 0)
        default = extend_config(head_dim, head_dim, torch.bfloat16, has_prefix=p > 0, max_len_extend=n,
                                capability=torch.cuda.get_device_capability())  # as extend_attention_fwd asks
        launch(c, None)
        torch.cuda.synchronize()
        o_default = c["o"].clone()
        configs = {"default": None}
        rows = {"default": dict(config=dataclasses.asdict(default), bitwise_equal=True, max_abs_diff=0.0,
                                rel_err=0.0)}
        for name in names:
            if time.perf_counter() - t0 > args.budget_s:
                res["skipped_for_budget"].append(f"{case_name}/{name}")
                continue
            cfg = dataclasses.replace(old, **table[name])
            row = rows[name] = dict(config=dataclasses.asdict(cfg))
            try:
                c["o"].fill_(float("nan"))
                launch(c, cfg)
                torch.cuda.synchronize()
            except Exception as e:  # a candidate that does not compile or fit: recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{case_name} {name}: {row['error']}", flush=True)
                continue
            d = (c["o"].float() - o_default.float())
            row.update(bitwise_equal=bool(torch.equal(c["o"], o_default)), max_abs_diff=d.abs().max().item(),
                       rel_err=(d.norm() / o_default.float().norm()).item())
            if not row["rel_err"] <= 1e-2:  # NaN included
                row["error"] = f"output differs from the default's (rel err {row['rel_err']:.3g}): not timed"
                print(f"{case_name} {name}: {row['error']}", flush=True)
                continue
            configs[name] = cfg
        times = {name: [] for name in configs}
        for r in range(args.rounds):
            for name, cfg in configs.items():
                times[name].append(graph_us(lambda: launch(c, cfg), calls=5))
        flops = case_flops(n, p, bs, args.shape)
        for name, ts in times.items():
            us = statistics.median(ts)
            rows[name].update(us=us, rounds_us=ts, tflops=flops / (us * 1e-6) / 1e12,
                              pct_matmul=100 * flops / (us * 1e-6) / mm)
        base = rows["default"]["us"]
        for row in rows.values():
            if "us" in row:
                row["speedup_vs_default"] = base / row["us"]
        res["cases"][case_name] = dict(new=n, prefix=p, bs=bs, flops=flops, rows=rows)
        del c
        torch.cuda.empty_cache()
        print(f"{case_name} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    res.update(cuda_run_metadata("extend-long-sweep", t0))
    try:
        from triton import knobs

        res["ptxas"] = dict(path=knobs.nvidia.ptxas.path, version=knobs.nvidia.ptxas.version)
    except Exception as e:  # older / newer Triton without these knobs
        res["ptxas"] = repr(e)[:200]
    print_table(res)
    write_result(res, args.out, "extend-long-sweep" + ("" if args.shape == "llama-3-8b" else f"-{args.shape}"), "cuda")
    return 0


def print_table(res: dict) -> None:
    cases = list(res["cases"])
    names = list(dict.fromkeys(k for c in cases for k in res["cases"][c]["rows"]))
    print(f"\n{res['gpu']}, triton {res['triton']}, bf16 matmul {res['matmul_bf16_tflops']:.0f} TFLOP/s; "
          "per case: us / TFLOP/s / x default ('=' same bits as the default)")
    print(f"{'candidate':<28}" + "".join(f"{c:>26}" for c in cases))
    for name in names:
        cells = []
        for c in cases:
            row = res["cases"][c]["rows"].get(name)
            if row is None:
                cells.append("skipped")
            elif "us" not in row:
                cells.append("error")
            else:
                eq = "=" if row["bitwise_equal"] else " "
                cells.append(f"{row['us']:.0f} / {row['tflops']:.0f} / {row['speedup_vs_default']:.3f}{eq}")
        print(f"{name:<28}" + "".join(f"{x:>26}" for x in cells))
    for c in cases:  # the launch's own default per case (length-dependent on sm_90)
        cfg = res["cases"][c]["rows"]["default"]["config"]
        print(f"default at {c}: {cfg['block_m']}x{cfg['block_n']}x{cfg['num_warps']}x{cfg['num_stages']}"
              + (f" kv_desc={cfg['kv_desc']}" if cfg["kv_desc"] else "")
              + (f" prefix tile {cfg['block_n_prefix']}" if cfg["block_n_prefix"] else ""))
    if res["skipped_for_budget"]:
        print("skipped for the time budget:", ", ".join(res["skipped_for_budget"]))


if __name__ == "__main__":
    raise SystemExit(main())
