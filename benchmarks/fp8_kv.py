"""FP8 vs bf16 KV cache on a GPU, in one run: the attention kernels and a whole decode step.
Writes ``<out>/<device>-fp8-kv-<date>.json``.

``PYTHONPATH=src python benchmarks/fp8_kv.py [--skip-step]``

* Kernels (inside CUDA graphs of many calls, median of replays; `kernel_timings`' shapes and
  functions):
  paged GQA decode (Hq 32, Hkv 8, D 128, page 16) at bs 64 x 8K and 8 x 32K; GQA extend of
  512 new tokens over an 8K cached prefix (4 requests, the prefix in the format); MLA decode
  (kv_lora_rank 512 + rope 64, page 64) at 16 heads bs 128 x 4K and bs 32 x 16K and 128
  heads bs 32 x 16K with the defaults, plus fp8-only rows for other stage-1 paths (the
  Triton byte path ``*_triton_stage1``, its pairs path ``*_triton_pairs``) and pages of 32.
  The same random K/V (fp8 entries = the bf16 values cast, scale 1) for each dtype; TB/s
  counts the cache bytes read once; copy bandwidth measured in the same run.
* Decode step (``--skip-step`` to leave out): Llama-3-8B shape, dummy weights, 64 requests
  x 8K context, the engine's captured decode graph, bf16 vs fp8_e4m3 cache (needs ~80 GB
  for the bf16 cache + weights: an H200). Prediction: weights 16 GB + KV 64 GB (bf16) ->
  16 + 32 GB (fp8), so the step shrinks by about 0.4x of its bf16 time if it runs at the
  same bandwidth.
"""

from __future__ import annotations

import argparse
import os
import gc
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import copy_bandwidth_gbs, fill_requests, time_ms  # noqa: E402
from kernel_timings import extend_prefix, gqa_decode, mla_decode  # noqa: E402

from attnserve.bench.results import cuda_run_metadata, write_result  # noqa: E402
from attnserve.mem_cache.kv_quant import quantize_kv  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _kernel_breakdown(fn, iters: int = 5, top: int = 8) -> dict:
    """GPU time per kernel name of one ``fn()`` (kernels inside CUDA graphs included), us,
    mean over ``iters`` calls, the ``top`` largest; ``(other kernels)``: the rest's total,
    ``(kernel launches)``: kernels per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        totals, launches = {}, 0
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                totals[ev.name] = totals.get(ev.name, 0.0) + ev.device_time / iters
                launches += 1
    except Exception as e:  # the breakdown is a diagnostic: never lose the timings for it
        return {"error": repr(e)[:200]}
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    out = {k[:80]: round(v, 1) for k, v in ranked[:top]}
    out["(other kernels)"] = round(sum(v for _, v in ranked[top:]), 1)
    out["(kernel launches)"] = launches // iters
    out.update(_idle_gaps(fn))
    return out


def _idle_gaps(fn, show: int = 4) -> dict:
    """Where the GPU waits inside one profiled ``fn()``: ``(span us)`` from its first kernel's
    start to its last kernel's end, ``(idle us)`` the span minus the kernels' busy time
    (overlapping kernels merged), ``(largest gaps)`` the ``show`` longest waits as "before ->
    after: us". The waits between the input copies before a graph replay are host time
    stretched by the profiler (ms under it), not the step's own gaps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        ks = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                     if ev.device_type.name == "CUDA"), key=lambda k: k[0])
    except Exception as e:  # a diagnostic: never lose the timings for it
        return {"(gaps error)": repr(e)[:200]}
    if not ks:
        return {}
    gaps, busy, end, prev = [], 0.0, ks[0][0], ks[0][2]
    for start, stop, name in ks:
        if start > end:
            gaps.append((start - end, f"{prev[:40]} -> {name[:40]}"))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    span = end - ks[0][0]
    return {"(span us)": round(span, 1), "(idle us)": round(span - busy, 1),
            "(largest gaps)": [f"{where}: {g:.1f}" for g, where in sorted(gaps, reverse=True)[:show]]}


def decode_step(kv_cache_dtype, bs=64, ctx=8192, fused_store=True):
    """One Llama-3-8B-shape decode step (bs x ctx, captured graph). ``fused_store=False``:
    the pool offers no fused RoPE + KV store (the path an fp8 pool took before session 13:
    RoPE, then `store_kv`), patched on the class while the engine captures its graphs."""
    from attnserve.engine.engine import ALLOW_LONGER_CONTEXT_ENV, Engine
    from attnserve.forward_batch import ForwardMode
    from attnserve.mem_cache.memory_pool import MHATokenToKVPool
    from attnserve.server_args import ServerArgs

    # 8,192 cached tokens + the step's own run one position past Llama-3-8B's 8,192 (timing only)
    os.environ.setdefault(ALLOW_LONGER_CONTEXT_ENV, "1")
    saved = MHATokenToKVPool.fused_store_target
    if not fused_store:
        MHATokenToKVPool.fused_store_target = lambda self, *a, **k: None
    try:
        engine = Engine(ServerArgs(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
                                   kv_cache_dtype=kv_cache_dtype, context_length=ctx + 64, max_running_requests=bs,
                                   cuda_graph_bs=[bs], mem_fraction_static=0.9))
    finally:
        MHATokenToKVPool.fused_store_target = saved
    runner = engine.model_runner
    pool = runner.token_to_kv_pool
    for buf in pool.buffers():  # random cache contents (not zeros)
        for chunk in torch.split(buf, 1 << 18):
            chunk.copy_(quantize_kv(torch.randn(chunk.shape, device="cuda", dtype=torch.bfloat16), 1.0, buf.dtype))
    alloc = runner.token_to_kv_pool_allocator
    rows, loc = fill_requests(runner, bs, ctx)
    out_loc = loc[:, -1].contiguous().to("cuda")
    fb = runner.build_forward_batch(ForwardMode.DECODE, [11] * bs, rows, [ctx - 1] * bs, [1] * bs, out_loc)
    step_ms = time_ms(lambda: runner.forward(fb), iters=20)
    kv_bytes = bs * ctx * runner.model_config.kv_cache_bytes_per_token(pool.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    out = dict(step_ms=step_ms, kv_bytes=kv_bytes, weight_bytes=weight_bytes,
               pool_tokens=alloc.size, kernels_us=_kernel_breakdown(lambda: runner.forward(fb)))
    del engine, runner, pool
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _pairs(block_h: int, block_n: int):
    """The Triton kernel's fp8 pairs path with 8 warps (`MLADecodeConfig.kv_pairs`)."""
    from attnserve.attention.triton_ops.mla_decode import MLADecodeConfig

    return MLADecodeConfig(block_h=block_h, block_n=block_n, num_warps=8, num_stages=1, kv_pairs=True)


def _fp8_only(bs: int, ctx: int, heads: int, **kw):
    """A case function timing `mla_decode` for fp8 formats only (None for bf16)."""
    return lambda dt_: None if dt_ == torch.bfloat16 else mla_decode(bs, ctx, heads, kv_dtype=dt_, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="kernel cases to run (names as in the JSON)")
    ap.add_argument("--step-bs", type=int, default=64, help="decode-step batch (64 x 8K in bf16 needs an H200)")
    ap.add_argument("--step-unfused-ab", action="store_true",
                    help="also time the fp8 step with the un-fused RoPE + store (the path before session 13)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = {"copy_tbps": copy_bandwidth_gbs() / 1e3, "kernels": {}}
    print(f"copy {res['copy_tbps']:.2f} TB/s", flush=True)
    cases = [("gqa_decode_bs64_8k", lambda dt_: gqa_decode(64, 8192, kv_dtype=dt_)),
             ("gqa_decode_bs8_32k", lambda dt_: gqa_decode(8, 32768, kv_dtype=dt_)),
             # a prefix-cache hit's prefill: 512 new tokens over an 8K cached prefix, 4 requests
             ("gqa_extend_bs4_prefix8k_new512", lambda dt_: extend_prefix(4, 8192, 512, kv_dtype=dt_)),
             # the split counts before issue 21's rounding change (rounded up), same run
             ("gqa_decode_bs64_8k_ceil_splits", lambda dt_: gqa_decode(64, 8192, kv_dtype=dt_, ceil_splits=True)),
             ("gqa_decode_bs8_32k_ceil_splits", lambda dt_: gqa_decode(8, 32768, kv_dtype=dt_, ceil_splits=True)),
             ("mla16_decode_bs128_4k", lambda dt_: mla_decode(128, 4096, 16, kv_dtype=dt_)),
             ("mla128_decode_bs32_16k", lambda dt_: mla_decode(32, 16384, 128, kv_dtype=dt_)),
             # an fp8 cache through the Triton stage 1 it ran before the fp8 seesaw kernel, same run
             ("mla16_decode_bs128_4k_triton_stage1", lambda dt_: mla_decode(128, 4096, 16, kv_dtype=dt_,
                                                                            triton_stage1=True)),
             ("mla128_decode_bs32_16k_triton_stage1", lambda dt_: mla_decode(32, 16384, 128, kv_dtype=dt_,
                                                                             triton_stage1=True)),
             # session 12: the fp8 seesaw kernel against the Triton kernel's pairs path (fp8 rows
             # only; their speed-up is against the bf16 row of the case their name extends)
             ("mla16_decode_bs32_16k", lambda dt_: mla_decode(32, 16384, 16, kv_dtype=dt_)),
             ("mla16_decode_bs128_4k_triton_pairs", _fp8_only(128, 4096, 16, config=_pairs(16, 128))),
             ("mla16_decode_bs32_16k_triton_pairs", _fp8_only(32, 16384, 16, config=_pairs(16, 128))),
             ("mla128_decode_bs32_16k_triton_pairs", _fp8_only(32, 16384, 128, config=_pairs(32, 64))),
             # pages of 32 tokens (no fp8 seesaw kernel): the pairs path (16 heads) and the byte path
             ("mla16_decode_bs128_4k_page32", lambda dt_: mla_decode(128, 4096, 16, page=32, kv_dtype=dt_)),
             ("mla16_decode_bs128_4k_page32_triton_stage1", _fp8_only(128, 4096, 16, page=32, triton_stage1=True)),
             ("mla64_decode_bs64_8k_page32", lambda dt_: mla_decode(64, 8192, 64, page=32, kv_dtype=dt_)),
             ("mla64_decode_bs64_8k_page32_triton_pairs", _fp8_only(64, 8192, 64, page=32, config=_pairs(32, 64)))]
    cases = [c for c in cases if args.only is None or c[0] in args.only]
    for name, fn in [] if args.skip_kernels else cases:
        row = {}
        for fmt in args.formats:
            r = fn(DTYPES[fmt])
            if r is not None:
                row[fmt] = r
            torch.cuda.empty_cache()
        # an fp8-only row: the bf16 time of the case its name extends (run earlier)
        base = row.get("bf16") or next((res["kernels"][k]["bf16"] for k in sorted(res["kernels"], key=len, reverse=True)
                                        if name.startswith(k + "_") and "bf16" in res["kernels"][k]), None)
        for fmt in row:
            if fmt != "bf16" and base is not None:
                row[fmt]["speedup_vs_bf16"] = base["us"] / row[fmt]["us"]
        res["kernels"][name] = row
        print(name, {f: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for f, r in row.items()},
              flush=True)
    if not args.skip_step:
        step = {name: decode_step(name, bs=args.step_bs) for name in ("auto", "fp8_e4m3")}
        if args.step_unfused_ab:  # the fp8 step with RoPE, then a separate store (before session 13)
            step["fp8_e4m3_unfused_store"] = decode_step("fp8_e4m3", bs=args.step_bs, fused_store=False)
        for name in step:
            if name != "auto":
                step[name]["speedup_vs_bf16"] = step["auto"]["step_ms"] / step[name]["step_ms"]
        a = step["auto"]
        step["predicted_speedup"] = (a["weight_bytes"] + a["kv_bytes"]) / (a["weight_bytes"] + a["kv_bytes"] / 2)
        step["bs"], step["ctx"] = args.step_bs, 8192
        res["llama3_8b_decode_8k"] = step
        print("decode step", step, flush=True)
    res.update(cuda_run_metadata("fp8-kv", t0))
    write_result(res, args.out, "fp8-kv", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
