"""FP8 linears (issue 37) against bf16 on one GPU, dummy weights, both in the same run.

``PYTHONPATH=src python benchmarks/fp8_bench.py [--out FILE.json] [--model llama-3-8b|mistral-7b|qwen2.5-7b|qwen3-0.6b] [--sweep [wide]]
[--parts engine,producers,gemm] [--variants bf16,fp8,...] [--ms 1,16,64,256,8192] [--budget-s 150]``

``--sweep wide`` replaces the GEMM rows by the FP8 mid GEMM's wide W8A8 tile sweep at the
``--ms`` rows (``--ms 64``; 33..64 meant) within ``--budget-s`` seconds of GPU time
(``benchmarks/fp8_mid_sweep.py``): per shape the best 5 tiles and the
``FP8_MID_DEFAULT_W8A8`` line to paste, JSON under ``fp8_mid_wide``.

**Engine rows** (CUDA graphs on), per ``--variants`` entry (`ENGINE_VARIANTS`): ``bf16``;
``fp8`` (``--quantization fp8``, the defaults); ``fp8-16bit-tiles``
(``ATTNSERVE_FP8_SKINNY_TABLE=0``: the W8A16 decode kernel on the bf16 tiles, as before
2026-11-26; decode only); ``fp8-w8a16-64`` (``ATTNSERVE_FP8_W8A16_MAX_M=64``: batches up to
64 rows on the W8A16 kernel instead of activation quantisation + ``_scaled_mm``; no
prefill); ``fp8-mid-w8a16`` / ``fp8-mid-w8a8`` (``ATTNSERVE_FP8_MID_GEMM``: 17..256 rows
on the FP8-weight mid GEMM, `fp8_mid_gemm`; no prefill); ``fp8-mid-off``
(``ATTNSERVE_FP8_MID_GEMM=off``: ``_scaled_mm`` at 33..64 rows too, as before the mid GEMM's
default route for the measured shapes, W8A8 at 33..64 rows on an H100; no prefill: the
route takes decode rows only, so compare its 64-request step and 64 x 512 -> 256 throughput
with ``fp8``'s); ``fp8-unfused-producers`` (``ATTNSERVE_FP8_FUSED_PRODUCERS=0``; the default since
2026-11-27 is on: add-RMSNorm and
SiLU-and-mul emit FP8 for the W8A8 linears, `fused_inputs`); ``fp8-rowwise-gate-up``
(``ATTNSERVE_FP8_FOLDED_GATE_SCALES=0``: ``gate_up`` on the row-wise ``_scaled_mm``, as before
2026-11-28); ``fp8-rowwise-down`` (``ATTNSERVE_FP8_FOLDED_DOWN_SCALES=0``: ``down_proj`` on the
row-wise ``_scaled_mm``, as before 2026-11-28's folded route); ``fp8-rowwise-o`` (``ATTNSERVE_FP8_FOLDED_O_SCALES=0``: ``o_proj`` on the row-wise
``_scaled_mm``, as before its folded route); ``fp8-lazy-off`` (``ATTNSERVE_FP8_LAZY_SCALES=0``: the folded
``o_proj`` / ``down_proj`` launch `scale_rows_cols` themselves, as before their scales were left to the
reading add-RMSNorm; decode batches only); ``fp8-exact-accum`` (``ATTNSERVE_FP8_FAST_ACCUM=0``: ``_scaled_mm`` with exact
float32 accumulation, the default until 2026-11-28); ``fp8-next`` (``fp8-w8a16-64`` with the
fused producers):

* ``decode_step_ms`` / ``decode_step_bs64_ms`` / ``decode_step_bs48_ms`` / ``decode_step_bs144_ms``: the captured
  decode graph at batch 1 / 64 / 48 / 144,
  context 512 (target for FP8 at batch 1 on an H100: <= 3.5 ms);
* ``prefill_8192_s``: one prompt of 8192 tokens, one output token (wall, after a warm-up);
* ``throughput_64x512_256_tok_s``: 64 prompts of 512 tokens -> 256 output tokens.

**GEMM rows**: per projection of the model (``gate_up`` with its SiLU-and-mul, as the
engine runs it) and ``M`` in ``--ms``, the GPU time of each path, ms per call:

* ``bf16_cublas`` (``F.linear``), ``bf16_skinny`` (M <= 16, the engine's decode path);
* ``w8a16[...]``: `skinny_linear_fp8` (M <= 128) with its default tiles
  (`fp8_skinny_config`, marked ``*``) and, with ``--sweep``, the 16-bit tiles (M <= 16)
  and ``block_k`` x2 (M = 1, M > 16) and /2 (M > 16), each
  labelled by its ``block_n x block_k / warps`` (``c`` carried, ``d`` deferred);
* ``w8a16v[variant:tile]`` (M = 1 only): the one-row variants of
  `attnserve.models.layers.fp8_gemv` (``ATTNSERVE_FP8_GEMV``; ``f32``, ``f16x2``,
  ``dot16``), each on its default tile and, with ``--sweep``, its
  `fp8_gemv_candidates`; the row's ``w8a16v`` entry gives per variant its default tile,
  its best tile, that time, its weight-stream rate (TB/s) and the default W8A16 kernel's
  time over it (> 1: the variant is faster);
* ``fp8_mid_w8a16[tile]`` / ``fp8_mid_w8a8[tile]`` / ``fp8_mid_w8a8_prequant[tile]``
  (16 < M <= 256): the opt-in FP8-weight mid GEMM (`fp8_mid_gemm`; gate fused for
  ``gate_up``) on 16-bit rows, with its activation quantisation, and on producer-quantised
  rows; the table's tile marked ``*``, with ``--sweep`` all `fp8_mid_candidates`. The
  row's ``fp8_mid`` gives per mode the default and best tile, times and the fraction of the
  copy rate (weight bytes / time / ``copy_rate_tb_s``, a 1 GiB device copy); its
  ``copy_fraction`` the same for ``bf16_cublas`` (2-byte weights), ``w8a8_scaled_mm`` and
  ``scaled_mm_prequant``; ``fp8_mid_table_suggestion`` collects the best tiles in the
  form of `fp8_mid_gemm.FP8_MID_MODE_OVERRIDES`;
* ``act_quant``: the per-token quantisation alone; ``scaled_mm_prequant``: ``_scaled_mm``
  on an already quantised input (what a producer-fused quantisation leaves);
  ``w8a8_scaled_mm``: both (the engine's path for M > 16); ``triton_channel`` /
  ``triton_block``: `scaled_fp8_gemm` with its quantisation.

Timing (``graph_ms``): each path is captured in a CUDA graph as a run of calls over
rotating weight copies (>= 200 MB of weights, so no call finds its weight in the 50 MB
L2), replayed back to back; median replay time / calls. No host launch cost, as in the
engine's decode graphs. The 2026-11-26 JSON timed one eager call between two events with
a synchronisation after each (the GPU idle at every start): its small-M numbers were the
host's launch latency (~0.06-0.15 ms per call), not the kernels; the column
``legacy_eager_ms`` repeats that method for the bf16 path, for comparison.

**Producer rows** (``--parts producers``): fused add-RMSNorm and SiLU-and-mul followed by
`quantize_activation` against the fused producer+quantiser kernels
(`fused_add_rmsnorm_quant_fp8`, `silu_and_mul_quant_fp8`).

Writes JSON after every row (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from common import bench_graph
from fp8_engine_variants import DECODE_ONLY, ENGINE_KWARGS, ENGINE_VARIANTS, NO_PREFILL

#: model -> its projections (name, N, K) of one layer (config.json of each HF release); the
#: engine rows run any of them (Qwen2.5-7B: biased qkv; Mistral-7B: Llama-3-8B's GEMMs)
SHAPES = {"llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
          "qwen2.5-7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
          "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]}
SHAPES["mistral-7b"] = SHAPES["llama-3-8b"]
ROTATE_BYTES = 200 * 2**20


def _legacy_eager_ms(fn, iters=30):
    """The 2026-11-26 method: one eager call between two events, synchronised each time."""
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(0)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _graph_ms(fn, copies: int, calls: int = 24, replays: int = 7) -> float:
    """ms per call of ``fn(i)`` (``i``: weight copy) over the copies, at least
    ``max(calls, copies)`` calls in one CUDA graph (`common.bench_graph`)."""
    fns = [functools.partial(fn, i) for i in range(copies)]
    return bench_graph(fns, min_calls=max(calls, copies), replays=replays) / 1e3


def _label(c) -> str:
    return f"{c.block_n}x{c.block_k}/{c.num_warps}w{'c' if c.carry else ''}{'d' if c.defer else ''}"


def w8a16_candidates(m, n, k, gated, sweep):
    """Default `fp8_skinny_config`, and with ``sweep`` the 16-bit tiles and neighbours."""
    import dataclasses

    from attnserve.models.layers.skinny_gemm import fp8_skinny_config, skinny_gemm_config

    base = fp8_skinny_config(m, n, k, gated=gated)
    cands = [base]
    if sweep:
        if m <= 16:
            cands.append(skinny_gemm_config(m, n, k, torch.bfloat16, 132, gated=gated))  # the 16-bit tiles
        if m == 1 or m > 16:
            cands.append(dataclasses.replace(base, block_k=base.block_k * 2))
        if m > 16:
            cands.append(dataclasses.replace(base, block_k=max(64, base.block_k // 2)))
    out, seen = [], set()
    for c in cands:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def gemv_variant_rows(x, wq, ws, n, k, gated, act, sweep, t, timed, copies):
    """Time the `fp8_gemv` variants (M = 1) into ``t`` as ``w8a16v[<variant>:<tile>]``;
    returns ``{variant: {default, best, best_ms, tb_s, default_over_best}}``."""
    from attnserve.models.layers.fp8_gemv import (
        FP8_GEMV_VARIANTS,
        fp8_gemv,
        fp8_gemv_candidates,
        fp8_gemv_supported,
    )

    cols = n // 2 if gated else n
    default_ms = next((v for kk, v in t.items() if kk.startswith("w8a16[") and kk.endswith("*")), None)
    stream_bytes = n * k + 2 * k + 2 * cols + 4 * n  # weight, x, y, scales
    summary = {}
    for variant in FP8_GEMV_VARIANTS:
        if not fp8_gemv_supported(x, wq[0], ws[0], None, variant):
            summary[variant] = "unsupported"
            continue
        cands = fp8_gemv_candidates(variant, cols, k, gated=gated)
        if not sweep:
            cands = cands[:1]
        for cfg in cands:
            key = f"w8a16v[{cfg.label()}]"
            try:
                t[key] = timed(lambda i, c=cfg, v=variant: fp8_gemv(x, wq[i], ws[i], None, act, variant=v, config=c),
                               copies)
            except Exception as e:  # a tile that does not compile (registers, shared memory)
                t[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        done = [(t[f"w8a16v[{c.label()}]"], c.label()) for c in cands
                if isinstance(t[f"w8a16v[{c.label()}]"], float)]
        if not done:
            summary[variant] = "failed"
            continue
        best_ms, best = min(done)
        summary[variant] = {"default": cands[0].label(), "best": best, "best_ms": best_ms,
                            "tb_s": stream_bytes / (best_ms * 1e-3) / 1e12,
                            "default_over_best": default_ms / best_ms if isinstance(default_ms, float) else None}
    print(f"  {n}x{k}{' gated' if gated else ''} M=1: default w8a16 {default_ms} ms; "
          + "; ".join(f"{v}: {d['best']} {d['best_ms'] * 1e3:.2f} us {d['tb_s']:.2f} TB/s"
                      if isinstance(d, dict) else f"{v}: {d}" for v, d in summary.items()), flush=True)
    return summary


def copy_rate_tb_s(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate (bytes read + written per second, TB/s) of a 1 GiB copy,
    CUDA-graph timed: the ceiling a weight stream is compared with."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _graph_ms(lambda i: b.copy_(a), 1, calls=4)
    del a, b
    return 2 * nbytes / (ms * 1e-3) / 1e12


def fp8_mid_rows(m, x, xq, xs, wq, ws, n, k, gated, act, sweep, t, timed, copies, copy_tb_s, emit_table):
    """Time `fp8_mid_linear` (16 < M <= 256) in both modes into ``t``: ``fp8_mid_w8a16[tile]``
    (16-bit x), ``fp8_mid_w8a8[tile]`` (with its `quantize_activation`) and
    ``fp8_mid_w8a8_prequant[tile]`` (producer-quantised x), the table's tile marked ``*``;
    with ``sweep`` every `fp8_mid_candidates` tile. Returns per mode the default and best
    tile, their times and their fraction of the copy rate (weight bytes / time / copy rate),
    and ``emit_table`` gets ``(mode, best tile)`` for the table suggestion."""
    from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
    from attnserve.models.layers.quantization.fp8_mid_gemm import fp8_mid_candidates
    from attnserve.models.layers.quantization.fp8_mid_gemm import fp8_mid_linear as mid_linear
    from attnserve.models.layers.split_k_workspace import SplitKWorkspace

    # split-K on a persistent workspace, as `Fp8LinearMethod` runs it (no memset per call)
    fp8_mid_linear = functools.partial(mid_linear, workspace=SplitKWorkspace())
    wbytes = n * k
    summary = {}
    for mode in ("w8a16", "w8a8_prequant", "w8a8"):
        base_mode = "w8a16" if mode == "w8a16" else "w8a8"
        cands = fp8_mid_candidates(m, n, k, base_mode, gated)
        if not sweep:
            cands = cands[:1]
        elif mode == "w8a8":  # the same kernels as w8a8_prequant: its default and best tile only
            pre = summary.get("w8a8_prequant")
            best_pre = pre.get("best_cfg") if isinstance(pre, dict) else None
            cands = cands[:1] + ([best_pre] if best_pre is not None and best_pre != cands[0] else [])
        done = []
        for j, cfg in enumerate(cands):
            key = f"fp8_mid_{mode}[{_mid_label(cfg)}]" + ("" if j else "*")
            if mode == "w8a16":
                def fn(i, c=cfg):
                    return fp8_mid_linear(x, wq[i], ws[i], None, act, config=c)
            elif mode == "w8a8_prequant":
                def fn(i, c=cfg):
                    return fp8_mid_linear(xq, wq[i], ws[i], None, act, x_scale=xs, out_dtype=torch.bfloat16, config=c)
            else:
                def fn(i, c=cfg):
                    q, s = quantize_activation(x)
                    return fp8_mid_linear(q, wq[i], ws[i], None, act, x_scale=s, out_dtype=torch.bfloat16, config=c)
            try:
                t[key] = timed(fn, copies)
                done.append((t[key], cfg))
            except Exception as e:  # a tile that does not compile (registers, shared memory)
                t[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        if not done:
            summary[mode] = "failed"
            continue
        best_ms, best = min(done, key=lambda d: d[0])
        default_ms = done[0][0] if done[0][1] == cands[0] else None
        summary[mode] = {"default": _mid_label(cands[0]), "default_ms": default_ms, "best": _mid_label(best),
                         "best_cfg": best,
                         "best_ms": best_ms, "best_tb_s": wbytes / (best_ms * 1e-3) / 1e12,
                         "best_copy_fraction": wbytes / (best_ms * 1e-3) / 1e12 / copy_tb_s,
                         "default_copy_fraction": (wbytes / (default_ms * 1e-3) / 1e12 / copy_tb_s
                                                   if default_ms else None)}
        if mode != "w8a8":
            emit_table(base_mode, best)
    for d in summary.values():
        if isinstance(d, dict):
            d.pop("best_cfg")  # JSON: the label is enough
    print(f"  {n}x{k}{' gated' if gated else ''} M={m}: " + "; ".join(
        f"{md}: {d['best']} {d['best_ms'] * 1e3:.2f} us ({d['best_copy_fraction']:.2f} of copy)"
        if isinstance(d, dict) else f"{md}: {d}" for md, d in summary.items()), flush=True)
    return summary


def _mid_label(c) -> str:
    return (f"{c.block_n}x{c.block_k}/{c.num_warps}w{c.num_stages}s/sk{c.split_k}"
            f"{'/tma' if c.use_tma else ''}")


def gemm_rows(model, ms, sweep, emit, copy_tb_s=None, table=None):
    from attnserve.models.layers.activation import act_and_mul
    from attnserve.models.layers.quantization.fp8_kernels import quantize_activation, scaled_fp8_gemm
    from attnserve.models.layers.quantization.fp8_mid_gemm import M_BUCKETS, fp8_mid_shape_class
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_block, quantize_per_row

    def _fp8_mid_bucket(m):
        return next(b for b in M_BUCKETS if m <= b)
    from attnserve.models.layers.skinny_gemm import (
        MAX_SKINNY_FP8_M,
        skinny_linear,
        skinny_linear_fp8,
        skinny_linear_gated,
    )

    for name, n, k in SHAPES[model]:
        gated = name == "gate_up"
        act = "silu" if gated else None
        post = (lambda y: act_and_mul(y, "silu", True)) if gated else (lambda y: y)
        n_bf = max(1, math.ceil(ROTATE_BYTES / (n * k * 2)))
        n_f8 = max(1, math.ceil(ROTATE_BYTES / (n * k)))
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_bf)]
        wq, ws, bq, bs = [], [], [], []
        for i in range(n_f8):
            q, s = quantize_per_row(w[i % n_bf])
            wq.append(q)
            ws.append(s)
            q, s = quantize_per_block(w[i % n_bf])
            bq.append(q)
            bs.append(s)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_activation(x)
            r = {"proj": name, "n": n, "k": k, "m": m, "gated": gated, "weight_copies": [n_bf, n_f8], "graph_ms": {}}
            t = r["graph_ms"]
            calls = 24 if m <= 256 else 4

            def timed(fn, copies, calls=calls):
                return _graph_ms(fn, copies, calls)

            def bf16_cublas(i):
                return post(F.linear(x, w[i]))

            t["bf16_cublas"] = timed(bf16_cublas, n_bf)
            if m <= 16:
                def bf16_skinny(i):
                    return skinny_linear_gated(x, w[i], "silu") if gated else skinny_linear(x, w[i])

                t["bf16_skinny"] = timed(bf16_skinny, n_bf)
                r["legacy_eager_ms"] = _legacy_eager_ms(bf16_skinny)
            else:
                r["legacy_eager_ms"] = _legacy_eager_ms(bf16_cublas)
            if m <= MAX_SKINNY_FP8_M:
                for j, cfg in enumerate(w8a16_candidates(m, n, k, gated, sweep)):
                    key = f"w8a16[{_label(cfg)}]" + ("" if j else "*")  # * = the default tiles
                    try:
                        t[key] = timed(lambda i, c=cfg: skinny_linear_fp8(x, wq[i], ws[i], None, act, config=c),
                                       n_f8)
                    except Exception as e:  # a candidate that does not compile (registers, shared memory)
                        t[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            if m == 1:
                r["w8a16v"] = gemv_variant_rows(x, wq, ws, n, k, gated, act, sweep, t, timed, n_f8)
            t["act_quant"] = timed(lambda i: quantize_activation(x), 1)
            t["scaled_mm_prequant"] = timed(lambda i: post(torch._scaled_mm(
                xq, wq[i].t(), scale_a=xs, scale_b=ws[i].view(1, -1), out_dtype=torch.bfloat16)), n_f8)

            def w8a8(i):
                q, s = quantize_activation(x)
                return post(torch._scaled_mm(q, wq[i].t(), scale_a=s, scale_b=ws[i].view(1, -1),
                                             out_dtype=torch.bfloat16))

            t["w8a8_scaled_mm"] = timed(w8a8, n_f8)
            t["triton_channel"] = timed(lambda i: post(scaled_fp8_gemm(*quantize_activation(x), wq[i], ws[i],
                                                                       torch.bfloat16)), n_f8)
            t["triton_block"] = timed(lambda i: post(scaled_fp8_gemm(*quantize_activation(x, 128), bq[i], bs[i],
                                                                     torch.bfloat16)), n_f8)
            if 16 < m <= 256 and copy_tb_s:
                def emit_table(mode, cfg, cls=fp8_mid_shape_class(n, k, gated), bucket=_fp8_mid_bucket(m)):
                    if table is not None:
                        table.setdefault(mode, {}).setdefault(cls, {})[bucket] = [
                            cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.split_k, cfg.use_tma]

                r["fp8_mid"] = fp8_mid_rows(m, x, xq, xs, wq, ws, n, k, gated, act, sweep, t, timed, n_f8,
                                            copy_tb_s, emit_table)
                r["copy_fraction"] = {kk: (n * k * (2 if kk.startswith("bf16") else 1)) / (t[kk] * 1e-3) / 1e12
                                      / copy_tb_s for kk in ("bf16_cublas", "w8a8_scaled_mm", "scaled_mm_prequant")}
            fp8_best = min((v, kk) for kk, v in t.items() if not kk.startswith("bf16") and isinstance(v, float)
                           and kk not in ("act_quant", "scaled_mm_prequant") and "prequant" not in kk)
            bf_best = min(v for kk, v in t.items() if kk.startswith("bf16"))
            r["best_fp8"] = fp8_best[1]
            r["bf16_over_best_fp8"] = bf_best / fp8_best[0]
            emit(r)
            del x, xq
        del w, wq, bq
        gc.collect()
        torch.cuda.empty_cache()


def producer_rows(ms, emit):
    """Fused add-RMSNorm / SiLU-and-mul then `quantize_activation`, against the fused
    producer+quantiser kernels."""
    from attnserve.models.layers.fused_kernels import fused_add_rmsnorm, silu_and_mul
    from attnserve.models.layers.quantization.fp8_kernels import (
        fused_add_rmsnorm_quant_fp8,
        quantize_activation,
        silu_and_mul_quant_fp8,
    )

    for m in ms:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        nw = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
        gu = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16)
        r = {"m": m, "graph_ms": {
            "add_rmsnorm+act_quant": _graph_ms(lambda i: quantize_activation(fused_add_rmsnorm(x, res, nw, 1e-5)), 1),
            "add_rmsnorm_quant_fused": _graph_ms(lambda i: fused_add_rmsnorm_quant_fp8(x, res, nw, 1e-5), 1),
            "silu_mul+act_quant": _graph_ms(lambda i: quantize_activation(silu_and_mul(gu)), 1),
            "silu_mul_quant_fused": _graph_ms(lambda i: silu_and_mul_quant_fp8(gu), 1),
        }}
        emit(r)


def engine_rows(model, variant, emit):
    from attnserve.bench.offline import graph_step_ms, timed_generate
    from attnserve.engine.engine import ALLOW_LONGER_CONTEXT_ENV
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    env = ENGINE_VARIANTS[variant]
    os.environ.update(env)
    # the 8,192-token prefill row makes one token past Llama-3-8B's 8,192 positions (timing only)
    os.environ.setdefault(ALLOW_LONGER_CONTEXT_ENV, "1")
    try:
        t0 = time.time()
        llm = LLM(model, load_format="dummy", device="cuda", context_length=8192 + 64, max_running_requests=160,
                  quantization=None if variant.startswith("bf16") else "fp8", **ENGINE_KWARGS.get(variant, {}))
        runner = llm.engine.model_runner
        row = {"model": model, "variant": variant, "env": env, "load_s": time.time() - t0,
               "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
               "peak_gib_after_load": torch.cuda.max_memory_allocated() / 2**30}
        row["decode_step_ms"] = graph_step_ms(runner, 1, 512)
        row["decode_step_bs64_ms"] = graph_step_ms(runner, 64, 512)
        row["decode_step_bs48_ms"] = graph_step_ms(runner, 48, 512)  # 32 + 16 row pieces in the mid GEMM
        row["decode_step_bs144_ms"] = graph_step_ms(runner, 144, 512)  # a mixed workload's mean batch
        vocab = llm.engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        if variant not in DECODE_ONLY + NO_PREFILL:
            one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
            long = [torch.randint(1, vocab, (8192,), generator=gen).tolist()]
            llm.generate(long, one)
            row["prefill_8192_s"] = min(timed_generate(llm, long, one)[0] for _ in range(2))
        if variant not in DECODE_ONLY:
            prompts = [torch.randint(1, vocab, (512,), generator=gen).tolist() for _ in range(64)]
            sp = SamplingParams(max_new_tokens=256, temperature=0.0, ignore_eos=True)
            llm.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
            row["throughput_64x512_256_tok_s"] = 64 * 256 / timed_generate(llm, prompts, sp)[0]
        emit(row)
        llm.shutdown()
        del llm, runner
    finally:
        for key in env:
            os.environ.pop(key, None)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _ratios(engine):
    by = {r["variant"]: r for r in engine}
    bf = by.get("bf16")
    out = {}
    for name, r in by.items():
        if name == "bf16" or bf is None:
            continue
        out[name] = {"decode_step": bf["decode_step_ms"] / r["decode_step_ms"],
                     "decode_step_bs64": bf["decode_step_bs64_ms"] / r["decode_step_bs64_ms"],
                     "decode_step_bs144": bf["decode_step_bs144_ms"] / r["decode_step_bs144_ms"]}
        if "prefill_8192_s" in r:
            out[name]["prefill_8192"] = bf["prefill_8192_s"] / r["prefill_8192_s"]
        if "throughput_64x512_256_tok_s" in r:
            out[name]["throughput"] = r["throughput_64x512_256_tok_s"] / bf["throughput_64x512_256_tok_s"]
    return out


def _mid_default_over_off(engine):
    """``fp8`` (the mid GEMM's default route on) against ``fp8-mid-off`` in the same run:
    step-time ratios ``off / default`` (> 1: the default is faster) at batch 48 and 64, and
    throughput ``default / off``; {} unless both ran."""
    by = {r["variant"]: r for r in engine}
    on, off = by.get("fp8"), by.get("fp8-mid-off")
    if on is None or off is None:
        return {}
    out = {f"decode_step_{b}": off[f"decode_step_{b}_ms"] / on[f"decode_step_{b}_ms"]
           for b in ("bs48", "bs64", "bs144")}
    if "throughput_64x512_256_tok_s" in on and "throughput_64x512_256_tok_s" in off:
        out["throughput_64x512_256"] = on["throughput_64x512_256_tok_s"] / off["throughput_64x512_256_tok_s"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--out", default="fp8_bench.json")
    ap.add_argument("--parts", default="engine,gemm,producers")
    ap.add_argument("--variants", default="bf16,fp8,fp8-16bit-tiles,fp8-next",
                    help=f"comma-separated, of {', '.join(ENGINE_VARIANTS)}")
    ap.add_argument("--ms", default=None, help="rows (default 1,16,64,256,8192; --sweep wide: 64)")
    ap.add_argument("--sweep", nargs="?", const="near", default=None, choices=["near", "wide"],
                    help="near (no value): candidate tiles besides the defaults; wide: the FP8 mid GEMM's wide "
                         "W8A8 sweep instead of the GEMM rows (fp8_mid_sweep.py)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="--sweep wide: GPU seconds in all")
    args = ap.parse_args(argv)
    import triton

    t0 = time.perf_counter()
    parts = args.parts.split(",")
    ms = [int(v) for v in (args.ms or ("64" if args.sweep == "wide" else "1,16,64,256,8192")).split(",")]
    result = {"benchmark": "fp8-bench", "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
              "timing": "graph_ms: CUDA-graph replay over rotating weight copies (>= 200 MB), ms per call",
              "engine": [], "gemm": [], "producers": []}

    def save():
        result["total_s"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def emitter(key):
        def emit(row):
            result[key].append(row)
            print(json.dumps(row), flush=True)
            save()
        return emit

    if "engine" in parts:
        for v in args.variants.split(","):
            engine_rows(args.model, v, emitter("engine"))
        result["fp8_over_bf16"] = _ratios(result["engine"])
        print(json.dumps(result["fp8_over_bf16"]), flush=True)
        mid_ab = _mid_default_over_off(result["engine"])
        if mid_ab:
            result["fp8_mid_default_over_off"] = mid_ab
            print("fp8_mid_default_over_off " + json.dumps(mid_ab), flush=True)
        save()
    if "producers" in parts:
        producer_rows(ms, emitter("producers"))
    if "gemm" in parts and args.sweep == "wide":
        from fp8_mid_sweep import run_wide_sweep

        result["copy_rate_tb_s"] = copy_rate_tb_s()
        print(f"copy rate {result['copy_rate_tb_s']:.3f} TB/s", flush=True)
        result["fp8_mid_wide"] = []

        def emit_quiet(row):  # rows are long: the sweep prints its summary, the JSON keeps the rest
            result["fp8_mid_wide"].append(row)
            save()

        run_wide_sweep(args.model, ms, args.budget_s, result["copy_rate_tb_s"], emit_quiet)
    elif "gemm" in parts:
        result["copy_rate_tb_s"] = copy_rate_tb_s()
        print(f"copy rate {result['copy_rate_tb_s']:.3f} TB/s", flush=True)
        table = {}
        gemm_rows(args.model, ms, args.sweep, emitter("gemm"), result["copy_rate_tb_s"], table)
        # the best fp8_mid tiles in `fp8_mid_gemm.FP8_MID_MODE_OVERRIDES` form
        # (mode -> class -> M bucket -> [block_n, block_k, warps, stages, split_k, use_tma])
        result["fp8_mid_table_suggestion"] = table
        print("fp8_mid_table_suggestion " + json.dumps(table), flush=True)
    save()


if __name__ == "__main__":
    main()
