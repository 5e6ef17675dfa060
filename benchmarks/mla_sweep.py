"""Sweep of the MLA decode kernel variants (`attention/triton_ops/mla_decode.py`) in one GPU run.

``PYTHONPATH=src python benchmarks/mla_sweep.py --out DIR`` writes
``DIR/<device_slug>-mla-sweep-<date>.json`` (`attnserve.bench.results.device_slug`) with the
date, device, torch / triton / CUDA versions, SM count, the device-to-device copy bandwidth and
a bf16 ``torch.matmul`` TFLOPS ceiling (8192^3) measured in the same run, and one row per
(shape, config):

* shapes: DeepSeek-V3 MLA (kv_lora_rank 512 + rope 64, bf16, page 64): 128 heads at batch 32
  x kv_len 4096 and 16384 (compute-heavy), 16 heads at batch 128 x kv_len 4096 (memory bound);
* ``ms``: median over ``--iters`` CUDA-graph replays of the stage-1 + merge launch pair (CUDA
  events, after warm-up; eager timing when the capture fails, ``graph`` false then);
  ``tbps`` = latent bytes ``bs * kv_len * 576 * 2`` / time; ``tflops`` = ``bs * H * kv_len * 2 *
  (576 + 512)`` / time; ``pct_copy`` = tbps / copy bandwidth;
* ``rel_err_vs_ref``: ``||o - o_ref|| / ||o_ref||`` (Frobenius) and ``max_rel_err_vs_ref``:
  ``max|o - o_ref| / max|o_ref|`` against the reference row ``ref_v1_*`` (the original pointer
  kernel with the tiles `mla_decode_config` picked before the variants existed: 128 heads
  (64, 64, 8, 2), 16 heads (16, 128, 8, 2)) on the same inputs; the ``default`` row is whatever
  `mla_decode_config` picks now; ``f64_rel_err``: the same norm
  error against a float64 PyTorch reference on a small ragged batch (lengths 1, 200, 1000,
  2047, so partial tail tiles and one-token requests are covered), from the precompile pass;
* ``stage1_kernel``: the stage-1 kernel that ran (`mla_stage1_kernel`: seesaw, gluon, tma or
  triton), so a config whose kernel does not apply here is seen to have fallen back;
* ``tma_applies``: whether the TMA path really ran (page % block_n == 0 ...) or fell back.

A config that fails to compile, launch, capture or check is recorded with its error string and
the sweep continues. Compilation runs first in ``--jobs`` worker processes (each config is
compiled and checked against float64 there; Triton's on-disk cache then makes the timing
process load it in well under a second), which also isolates crashes and hangs: a config that
kills or hangs its worker (``--job-timeout``) is marked failed and never run in the timing
process. ``--list`` prints the configs without a GPU. Everything imports lazily, so ``--help``
and ``--list`` work on a CPU-only machine. The ceilings are `common.measure_ceilings` (this
directory's shared helpers).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

D_C, D_R = 512, 64
LATENT = D_C + D_R
SM_SCALE = 1.0 / (192 ** 0.5)  # DeepSeek-V3: softmax scale of the 192-wide qk head
PAGE = 64

SHAPES = [
    dict(name="h128_b32_kv4096", bs=32, heads=128, kv_len=4096, page=PAGE),
    dict(name="h128_b32_kv16384", bs=32, heads=128, kv_len=16384, page=PAGE),
    dict(name="h16_b128_kv4096", bs=128, heads=16, kv_len=4096, page=PAGE),
    # a mixed workload's decode batches on DeepSeek-V2-Lite (16 heads): short contexts, the
    # engine's default page of 1 token against 64
    dict(name="h16_b144_kv800_p1", bs=144, heads=16, kv_len=800, page=1),
    dict(name="h16_b144_kv800", bs=144, heads=16, kv_len=800, page=PAGE),
    dict(name="h16_b256_kv800_p1", bs=256, heads=16, kv_len=800, page=1),
    dict(name="h16_b256_kv800", bs=256, heads=16, kv_len=800, page=PAGE),
    # long contexts at the engine's page of 1
    dict(name="h16_b128_kv4096_p1", bs=128, heads=16, kv_len=4096, page=1),
    dict(name="h16_b32_kv4096_p1", bs=32, heads=16, kv_len=4096, page=1),
    dict(name="h16_b8_kv16384_p1", bs=8, heads=16, kv_len=16384, page=1),
]
CHECK_LENS = [1, 200, 1000, 2047]  # the small float64-checked batch
_DEV = "cuda"
_SMOKE = False


def _set_smoke() -> None:
    """``--smoke``: exercise the whole driver on CPU under the Triton interpreter with tiny
    dims (kv_lora_rank 64 + rope 16, short sequences); timings are wall-clock and meaningless."""
    global D_C, D_R, LATENT, SHAPES, CHECK_LENS, _DEV, _SMOKE
    os.environ["TRITON_INTERPRET"] = "1"
    D_C, D_R, LATENT = 64, 16, 80
    SHAPES = [dict(name="h128_b2_kv200", bs=2, heads=128, kv_len=200, page=PAGE),
              dict(name="h16_b3_kv130", bs=3, heads=16, kv_len=130, page=PAGE)]
    CHECK_LENS = [1, 70, 129]
    _DEV, _SMOKE = "cpu", True


def _sync() -> None:
    import torch

    if _DEV == "cuda":
        torch.cuda.synchronize()


def _c(bh, bn, w, st, **kw) -> Dict:
    return dict(block_h=bh, block_n=bn, num_warps=w, num_stages=st, **kw)


def sweep_configs() -> List[Dict]:
    """The sweep list: dicts with name, heads (which shapes), cfg (MLADecodeConfig kwargs or
    None = `mla_decode_config`'s current pick), splits_scale (times the `mla_num_kv_splits`
    heuristic, rounded, >= 1) and ref (the row every other row of the shape is compared with:
    the original kernel's tiles, listed first)."""
    tma = dict(kv_load="tma")
    h128 = [
        ("ref_v1_n64_s2", _c(64, 64, 8, 2), 1),
        ("default", None, 1),
        ("v1_n32_s3", _c(64, 32, 8, 3), 1),
        ("v1_n64_s2_splits0.5x", _c(64, 64, 8, 2), 0.5),
        ("peel_n64_s2", _c(64, 64, 8, 2, peel_tail=True), 1),
        ("peel_n32_s3", _c(64, 32, 8, 3, peel_tail=True), 1),
        ("tma_n64_s2", _c(64, 64, 8, 2, **tma), 1),
        ("tma_n64_s3", _c(64, 64, 8, 3, **tma), 1),
        ("tma_n64_s1", _c(64, 64, 8, 1, **tma), 1),
        ("tma_n32_s2", _c(64, 32, 8, 2, **tma), 1),
        ("tma_n32_s3", _c(64, 32, 8, 3, **tma), 1),
        ("tma_n32_s4", _c(64, 32, 8, 4, **tma), 1),
        ("tma_h32_w4_n64_s2", _c(32, 64, 4, 2, **tma), 1),
        ("tma_n64_s2_splits0.5x", _c(64, 64, 8, 2, **tma), 0.5),
        ("tma_n64_s3_splits0.5x", _c(64, 64, 8, 3, **tma), 0.5),
        ("tma_n64_s3_splits2x", _c(64, 64, 8, 3, **tma), 2),
        ("gluon_n64_s2", _c(64, 64, 8, 2, stage1="gluon"), 1),
        ("gluon_n64_s2_splits0.5x", _c(64, 64, 8, 2, stage1="gluon"), 0.5),
        ("gluon_n64_s2_splits2x", _c(64, 64, 8, 2, stage1="gluon"), 2),
        ("seesaw", _c(64, 64, 8, 2, stage1="seesaw"), 1),
        ("seesaw_splits0.5x", _c(64, 64, 8, 2, stage1="seesaw"), 0.5),
        ("seesaw_splits2x", _c(64, 64, 8, 2, stage1="seesaw"), 2),
    ]
    h16 = [
        ("ref_v1_h16_n128_w8_s2", _c(16, 128, 8, 2), 1),
        ("default", None, 1),
        ("v1_h16_n64_w4_s2", _c(16, 64, 4, 2), 1),
        # pointer-path (page-1) candidates: deeper rings, smaller tiles, more programs per SM
        ("v1_h16_n64_w4_s3", _c(16, 64, 4, 3), 1),
        ("v1_h16_n32_w4_s4", _c(16, 32, 4, 4), 1),
        ("v1_h16_n32_w4_s5", _c(16, 32, 4, 5), 1),
        ("v1_h16_n64_w4_s2_splits2x", _c(16, 64, 4, 2), 2),
        ("v1_h16_n128_w8_s2_splits2x", _c(16, 128, 8, 2), 2),
        ("peel_h16_n128_w8_s2", _c(16, 128, 8, 2, peel_tail=True), 1),
        ("tma_h16_n64_w8_s2", _c(16, 64, 8, 2, **tma), 1),
        ("tma_h16_n64_w8_s3", _c(16, 64, 8, 3, **tma), 1),
        ("tma_h16_n64_w8_s4", _c(16, 64, 8, 4, **tma), 1),
        ("tma_h16_n64_w4_s2", _c(16, 64, 4, 2, **tma), 1),
        ("tma_h16_n64_w4_s3", _c(16, 64, 4, 3, **tma), 1),
        ("tma_h16_n32_w4_s4", _c(16, 32, 4, 4, **tma), 1),
        ("tma_h16_n32_w8_s3", _c(16, 32, 8, 3, **tma), 1),
        ("tma_h16_n32_w4_s4_splits2x", _c(16, 32, 4, 4, **tma), 2),
        ("tma_h16_n64_w8_s3_splits2x", _c(16, 64, 8, 3, **tma), 2),
        ("tma_h64pad_n64_w8_s2", _c(64, 64, 8, 2, **tma), 1),
    ]
    out = []
    for heads, rows in ((128, h128), (16, h16)):
        for name, cfg, scale in rows:
            out.append(dict(name=f"h{heads}/{name}", heads=heads, cfg=cfg, splits_scale=scale,
                            ref=name.startswith("ref_")))
    return out


def _splits(base: int, scale: float) -> int:
    return max(1, int(round(base * scale)))


# ---------------------------------------------------------------------------------------
# GPU helpers (lazy imports)
# ---------------------------------------------------------------------------------------
def _make_config(spec: Dict, heads: int):
    import torch

    from attnserve.attention.triton_ops import mla_decode as mla

    if spec["cfg"] is None:
        if _SMOKE:
            return mla.mla_decode_config(heads, D_C, D_R, torch.bfloat16, interpret=True)
        smem = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "shared_memory_per_block_optin", None)
        return mla.mla_decode_config(heads, D_C, D_R, torch.bfloat16, max_shared_mem=smem)
    return mla.MLADecodeConfig(**spec["cfg"])


def _sm_count() -> int:
    import torch

    if _SMOKE:
        return 4
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def make_inputs(bs: int, heads: int, lens: List[int], page: int, seed: int = 0) -> Dict:
    """Random bf16 latent cache in shuffled pages (page 0 reserved) and its -1-padded table."""
    import torch

    g = torch.Generator(device=_DEV).manual_seed(seed)
    blocks = [-(-n // page) for n in lens]
    width = max(blocks) + 1
    num_pages = 1 + sum(blocks)
    kv = torch.randn(num_pages * page, 1, LATENT, device=_DEV, generator=g, dtype=torch.bfloat16)
    perm = torch.randperm(num_pages - 1, device=_DEV, generator=g).to(torch.int32) + 1
    table = torch.full((bs, width), -1, dtype=torch.int32, device=_DEV)
    pos = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[pos : pos + nb]
        pos += nb
    q_nope = torch.randn(bs, heads, D_C, device=_DEV, generator=g, dtype=torch.bfloat16)
    q_pe = torch.randn(bs, heads, D_R, device=_DEV, generator=g, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=_DEV)
    return dict(q_nope=q_nope, q_pe=q_pe, kv=kv, table=table, seq_lens=seq_lens, page=page, lens=list(lens))


def reference_f64(inp: Dict):
    """float64 o [bs, H, 512] by direct softmax over each request's gathered rows."""
    import torch

    outs = []
    page = inp["page"]
    for i, n in enumerate(inp["lens"]):
        t = torch.arange(n, device=_DEV)
        slots = inp["table"][i].long()[t // page] * page + t % page
        lat = inp["kv"][slots, 0].double()
        s = (inp["q_nope"][i].double() @ lat[:, :D_C].T + inp["q_pe"][i].double() @ lat[:, D_C:].T) * SM_SCALE
        outs.append(torch.softmax(s, -1) @ lat[:, :D_C])
    return torch.stack(outs)


def _rel_errs(o, ref) -> Dict:
    d = (o.double() - ref.double())
    r = ref.double()
    return dict(rel_err=(d.norm() / r.norm().clamp_min(1e-30)).item(),
                max_rel_err=(d.abs().max() / r.abs().max().clamp_min(1e-30)).item(),
                nan=bool(torch_isnan_any(o)))


def torch_isnan_any(t) -> bool:
    import torch

    return bool(torch.isnan(t).any().item())


def _runner(inp: Dict, cfg, splits: int):
    """A closure running one decode (stage 1 + merge) into a fixed output; no allocation.
    Returns ``(fn, o)``."""
    import torch

    from attnserve.attention.triton_ops import mla_decode as mla

    bs, heads, _ = inp["q_nope"].shape
    ws = torch.empty(mla.mla_workspace_size(0, bs, splits, heads, D_C), dtype=torch.uint8, device=_DEV)
    o = torch.empty(bs, heads, D_C, dtype=torch.bfloat16, device=_DEV)

    def fn():
        mla.mla_decode_fwd(inp["q_nope"], inp["q_pe"], inp["kv"], inp["table"], inp["seq_lens"], inp["page"], o,
                           SM_SCALE, splits, splits, workspace=ws, config=cfg)

    return fn, o


def _stage1_kernel(cfg, inp: Dict) -> str:
    from attnserve.attention.triton_ops import mla_decode as mla

    return mla.mla_stage1_kernel(inp["q_nope"], inp["q_pe"], inp["kv"], inp["page"], cfg)


def _tma_applies(cfg, inp: Dict) -> Optional[bool]:
    from attnserve.attention.triton_ops import mla_decode as mla

    if cfg.kv_load == "ptr":
        return None
    rows = inp["kv"].view(-1, LATENT)
    return mla.mla_tma_applicable(rows, D_C, inp["page"], cfg.block_n)


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= 2000 else s[:1000] + " ... " + s[-1000:]


# ---------------------------------------------------------------------------------------
# precompile workers
# ---------------------------------------------------------------------------------------
def _worker(jobs: List[Dict]) -> int:
    """Compile + float64-check each job (config index, heads, splits); one JSON line each."""
    configs = sweep_configs()
    inputs = {}
    for job in jobs:
        print(json.dumps(dict(event="start", key=job["key"])), flush=True)
        spec = configs[job["idx"]]
        heads, splits = job["heads"], job["splits"]
        res = dict(event="done", key=job["key"])
        t0 = time.perf_counter()
        try:
            if heads not in inputs:
                inputs[heads] = make_inputs(len(CHECK_LENS), heads, CHECK_LENS, PAGE, seed=1)
            inp = inputs[heads]
            cfg = _make_config(spec, heads)
            fn, o = _runner(inp, cfg, splits)
            o.fill_(float("nan"))
            fn()
            _sync()
            res["compile_s"] = time.perf_counter() - t0
            res["stage1_kernel"] = _stage1_kernel(cfg, inp)
            errs = _rel_errs(o, reference_f64(inp))
            res.update(ok=not errs["nan"] and errs["rel_err"] <= 1e-2, f64_rel_err=errs["rel_err"],
                       f64_max_rel_err=errs["max_rel_err"], f64_nan=errs["nan"])
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            res.update(ok=False, error=_short(e), compile_s=time.perf_counter() - t0)
        print(json.dumps(res), flush=True)
        if not res.get("ok"):
            try:  # a sticky CUDA error poisons this process: let the driver restart the rest
                _sync()
            except Exception:  # noqa: BLE001
                return 3
    return 0


def _pump(proc, q):
    for line in proc.stdout:
        q.put(line)
    q.put(None)


def precompile(jobs: List[Dict], n_workers: int, job_timeout: float, log=print) -> Dict[str, Dict]:
    """Run `_worker` over ``jobs`` in ``n_workers`` processes; returns {key: result}. A job
    whose worker dies or stays silent past ``job_timeout`` seconds is failed; the jobs after
    it are re-queued in a fresh worker."""
    results: Dict[str, Dict] = {}
    pending = list(jobs)
    while pending:
        n = max(1, min(n_workers, len(pending)))
        chunks = [pending[i::n] for i in range(n)]
        pending = []
        procs = []
        for chunk in chunks:
            cmd = [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(chunk)]
            p = subprocess.Popen(cmd + (["--smoke"] if _SMOKE else []),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            q: "queue.Queue" = queue.Queue()
            threading.Thread(target=_pump, args=(p, q), daemon=True).start()
            errbuf: List[str] = []
            threading.Thread(target=lambda p=p, b=errbuf: b.append(p.stderr.read()), daemon=True).start()
            procs.append(dict(p=p, q=q, chunk=chunk, last=time.time(), running=None, done=set(), eof=False, err=errbuf))
        while any(not w["eof"] for w in procs):
            for w in procs:
                if w["eof"]:
                    continue
                try:
                    line = w["q"].get(timeout=0.2)
                except queue.Empty:
                    if time.time() - w["last"] > job_timeout:
                        w["p"].kill()
                        w["hung"] = True
                    continue
                w["last"] = time.time()
                if line is None:
                    w["eof"] = True
                    continue
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("event") == "start":
                    w["running"] = r["key"]
                elif r.get("event") == "done":
                    results[r["key"]] = r
                    w["done"].add(r["key"])
                    w["running"] = None
                    log(f"  compiled {r['key']}: " + ("ok" if r.get("ok") else "FAILED " + str(r.get("error", r.get("f64_rel_err"))))[:200]
                        + f" ({r.get('compile_s', 0):.1f} s)")
        for w in procs:
            w["p"].wait()
            missing = [j for j in w["chunk"] if j["key"] not in w["done"]]
            if missing:
                culprit = w["running"] or missing[0]["key"]
                why = "hung (no progress for %.0f s)" % job_timeout if w.get("hung") else f"worker died (rc {w['p'].returncode})"
                tail = "".join(w["err"])[-1500:]
                results[culprit] = dict(key=culprit, ok=False, error=f"{why}: {tail}")
                log(f"  {culprit}: {why}")
                pending += [j for j in missing if j["key"] != culprit]
    return results


# ---------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------
def time_ms(fn, iters: int, warmup: int) -> Dict:
    """Median ms of ``iters`` CUDA-graph replays of ``fn`` (eager when capture fails)."""
    import torch

    for _ in range(warmup):
        fn()
    _sync()
    if _DEV != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return dict(ms=statistics.median(times), ms_min=min(times), graph=False, graph_error="smoke (CPU)")
    graph, run, err = None, fn, None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        for _ in range(2):
            run()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        graph, run, err = None, fn, _short(e)
        torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in ev]
    del graph
    return dict(ms=statistics.median(times), ms_min=min(times), graph=err is None, graph_error=err)


def sweep_shape(shape: Dict, specs: List[Dict], pre: Dict[str, Dict], base_splits: int, copy_tbps: float,
                iters: int, warmup: int, rows: List[Dict], log=print) -> None:
    """Time every spec on one shape, appending a row per spec to ``rows`` (as it goes, so a
    sticky CUDA error, re-raised, leaves the rows so far in place)."""
    import torch

    bs, heads, kv_len, page = shape["bs"], shape["heads"], shape["kv_len"], shape["page"]
    inp = make_inputs(bs, heads, [kv_len] * bs, page, seed=0)
    nbytes = bs * kv_len * LATENT * 2
    flops = 2 * bs * heads * kv_len * (LATENT + D_C)
    ref = None
    for spec in specs:
        splits = _splits(base_splits, spec["splits_scale"])
        key = f"{spec['name']}@{splits}"
        row = dict(shape=shape["name"], bs=bs, heads=heads, kv_len=kv_len, page_size=page, name=spec["name"],
                   num_kv_splits=splits, splits_scale=spec["splits_scale"])
        p = pre.get(key, {})
        row.update({k: p.get(k) for k in ("compile_s", "f64_rel_err", "f64_max_rel_err")})
        try:
            cfg = _make_config(spec, heads)
            row["config"] = dataclasses.asdict(cfg)
            row["tma_applies"] = _tma_applies(cfg, inp)
            row["stage1_kernel"] = _stage1_kernel(cfg, inp)
            if p and not p.get("ok") and p.get("error"):
                raise RuntimeError("precompile failed: " + p["error"])
            fn, o = _runner(inp, cfg, splits)
            t0 = time.perf_counter()
            fn()
            _sync()
            row["first_call_s"] = time.perf_counter() - t0
            if spec["ref"]:
                ref = o.clone()
            if ref is not None:
                e = _rel_errs(o, ref)
                row.update(rel_err_vs_ref=e["rel_err"], max_rel_err_vs_ref=e["max_rel_err"], nan=e["nan"])
            row.update(time_ms(fn, iters, warmup))
            row["tbps"] = nbytes / (row["ms"] * 1e-3) / 1e12
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            row["pct_copy"] = 100.0 * row["tbps"] / copy_tbps if copy_tbps else None
            ok_f64 = p.get("ok", True)
            ok_ref = row.get("rel_err_vs_ref") is None or (row["rel_err_vs_ref"] <= 1e-2 and not row["nan"])
            row["ok"] = bool(ok_f64 and ok_ref)
            log(f"  {spec['name']:<44} splits {splits:>2}: {row['ms']:.4f} ms  {row['tbps']:.2f} TB/s  "
                f"{row['tflops']:.0f} TFLOPS  stage 1 {row['stage1_kernel']}  "
                f"err {row.get('rel_err_vs_ref', float('nan')):.1e}"
                + ("" if row["ok"] else "  NOT OK"))
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=_short(e))
            log(f"  {spec['name']:<44} FAILED: {row['error'][:300]}")
            rows.append(row)
            _sync()  # a sticky CUDA error raises here and ends the sweep (rows kept)
            continue
        rows.append(row)
    del inp
    if _DEV == "cuda":
        torch.cuda.empty_cache()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="MLA decode kernel variant sweep (needs a CUDA GPU except --list)")
    ap.add_argument("--out", default="benchmarks/results", help="output directory for the JSON")
    ap.add_argument("--iters", type=int, default=20, help="timed graph replays per config (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="precompile worker processes (0: none)")
    ap.add_argument("--job-timeout", type=float, default=180.0, help="seconds without progress before a worker is killed")
    ap.add_argument("--only", default=None, help="regex on config names (the ref and default rows always run)")
    ap.add_argument("--shapes", default=None, help="regex on shape names")
    ap.add_argument("--list", action="store_true", help="print the shapes and configs and exit (no GPU needed)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU self-test of the driver under the Triton interpreter (tiny dims, meaningless times)")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        _set_smoke()

    if args._worker is not None:
        return _worker(json.loads(args._worker))

    specs = sweep_configs()
    if args.only:
        rx = re.compile(args.only)
        specs = [s for s in specs if s["ref"] or s["cfg"] is None or rx.search(s["name"])]
    shapes = [s for s in SHAPES if not args.shapes or re.search(args.shapes, s["name"])]
    if args.list:
        for sh in shapes:
            print(sh)
        for s in specs:
            print(f"{s['name']:<48} splits x{s['splits_scale']:<4} {s['cfg']}")
        return 0

    import torch

    if not torch.cuda.is_available() and not _SMOKE:
        print("mla_sweep needs a CUDA GPU (use --list to see the configs, --smoke for a CPU self-test)", file=sys.stderr)
        return 2
    import triton

    from common import measure_ceilings

    from attnserve.bench.results import device_slug

    t_start = time.perf_counter()
    sm = _sm_count()
    from attnserve.attention.triton_ops.mla_decode import mla_num_kv_splits, mla_split_sm_count

    base = {sh["name"]: mla_num_kv_splits(sh["kv_len"], sh["bs"], mla_split_sm_count(sm, sh["heads"]))
            for sh in shapes}
    jobs, seen = [], set()
    for i, spec in enumerate(sweep_configs()):
        if spec not in specs:
            continue
        for sh in shapes:
            if sh["heads"] != spec["heads"]:
                continue
            splits = _splits(base[sh["name"]], spec["splits_scale"])
            key = f"{spec['name']}@{splits}"
            if key not in seen:
                seen.add(key)
                jobs.append(dict(key=key, idx=i, heads=spec["heads"], splits=splits))

    dev_name = "cpu (smoke)" if _SMOKE else torch.cuda.get_device_name()
    result = dict(
        benchmark="mla_sweep", date=dt.date.today().isoformat(), device=dev_name,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, sm_count=sm,
        shared_memory_per_block_optin=None if _SMOKE else getattr(
            torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", None),
        shapes=shapes, num_kv_splits_heuristic=base, rows=[],
    )
    os.makedirs(args.out, exist_ok=True)
    slug = "cpu-smoke" if _SMOKE else device_slug("cuda")
    path = os.path.join(args.out, f"{slug}-mla-sweep-{result['date']}.json")

    def save():
        result["elapsed_s"] = time.perf_counter() - t_start
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

    print(f"{result['device']}: torch {result['torch']}, triton {result['triton']}, CUDA {result['cuda']}, {sm} SMs")
    print(f"precompiling {len(jobs)} (config, splits) pairs in {args.jobs} workers ...")
    t0 = time.perf_counter()
    pre = precompile(jobs, args.jobs, args.job_timeout) if args.jobs > 0 else {}
    result["precompile_s"] = time.perf_counter() - t0
    result["precompile"] = pre
    print(f"precompile: {result['precompile_s']:.0f} s")

    if _SMOKE:
        result["copy_bandwidth_gbs"], result["matmul_bf16_tflops_8192"] = 1.0, 1.0
    else:
        ceilings = measure_ceilings()
        result["copy_bandwidth_gbs"] = ceilings["copy_tbps"] * 1e3
        result["matmul_bf16_tflops_8192"] = ceilings["matmul_bf16_tflops"]
    copy_tbps = result["copy_bandwidth_gbs"] / 1e3
    print(f"copy {result['copy_bandwidth_gbs']:.0f} GB/s, bf16 matmul 8192^3 {result['matmul_bf16_tflops_8192']:.0f} TFLOPS")
    save()
    try:
        for sh in shapes:
            print(f"{sh['name']} (splits heuristic {base[sh['name']]}):")
            mine = [s for s in specs if s["heads"] == sh["heads"]]
            sweep_shape(sh, mine, pre, base[sh["name"]], copy_tbps, args.iters, args.warmup, result["rows"])
            save()
    finally:
        save()
    print("\nbest per shape (ok rows):")
    for sh in shapes:
        ok = sorted((r for r in result["rows"] if r["shape"] == sh["name"] and r.get("ok") and r.get("ms")),
                    key=lambda r: r["ms"])
        for r in ok[:5]:
            print(f"  {sh['name']:<18} {r['name']:<44} {r['ms']:.4f} ms {r['tbps']:.2f} TB/s {r['tflops']:.0f} TFLOPS")
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
