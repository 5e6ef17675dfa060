"""Key attention-kernel timings through the public kernel API, to compare two trees.

``PYTHONPATH=<tree>/src python benchmarks/kernel_timings.py --label NAME --out DIR`` times,
inside CUDA graphs of many calls (launch overhead removed, median of replays), the shapes
the README quotes: paged GQA decode (Hq 32, Hkv 8, D 128, page 16) at bs 64 x 8K and
8 x 32K, causal extend 1 x 8192, and MLA decode (kv_lora_rank 512 + rope 64, page 64) at
128 heads bs 32 x 16K and 16 heads bs 128 x 4K, with the kernels' own default configs and
split heuristics. Only functions that exist with the same signature in every tree since
2026-11-21 are called, so the same file measures an older checkout (its ``src`` first on
``PYTHONPATH``) and the current one in one device session. Writes
``<out>/<label>.json`` with the attnserve path it imported.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics

import torch


def graph_us(fn, calls: int = 20, replays: int = 15) -> float:
    """Median µs per call of ``fn`` captured ``calls`` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def _kv_args(kv_dtype: torch.dtype, *names: str) -> dict:
    """Scale keywords (1.0) for an fp8 cache; none for bf16, so older trees run unchanged."""
    return {n: 1.0 for n in names} if kv_dtype != torch.bfloat16 else {}


def gqa_decode(bs: int, ctx: int, page: int = 16, hq: int = 32, hkv: int = 8, d: int = 128,
               kv_dtype: torch.dtype = torch.bfloat16, config=None, split_cap: int = 32,
               ceil_splits: bool = False) -> dict:
    """Paged GQA decode; ``kv_dtype`` bf16 or an fp8 format (random values |x| < 448 cast
    directly, i.e. scale 1; `benchmarks/fp8_kv.py`). ``config`` (a `DecodeConfig`) or
    ``split_cap`` other than the defaults also report ``rel_err`` against the default
    configuration (`benchmarks/fp8_decode_sweep.py`). ``ceil_splits`` replays the split
    policy before issue 21 (split counts rounded up, computed here on the host) for A/B runs."""
    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention_fwd

    g = torch.Generator(device="cuda").manual_seed(0)
    pages = bs * ctx // page + 1
    kb = torch.randn(pages * page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).to(kv_dtype)
    vb = torch.randn(pages * page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).to(kv_dtype)
    perm = (torch.randperm(pages - 1, device="cuda", generator=g) + 1).view(bs, ctx // page)
    idx = (perm[:, :, None] * page + torch.arange(page, device="cuda")).reshape(-1).to(torch.int32)
    lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(lens, 0)
    splits_cap = 32
    splits = torch.empty(bs, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    compute_num_kv_splits(lens, splits, split_cap, sms, hkv)
    if ceil_splits:  # same per-split length t, rounded up (lengths are uniform here)
        per = max(-(-bs * ctx // max(1, sms * 4 // hkv)), 128)
        splits.fill_(min(max(-(-ctx // per), 1), split_cap))
    q = torch.randn(bs, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    o = torch.empty_like(q)
    logits = torch.empty(bs, hq, splits_cap, d, device="cuda")
    lse = torch.empty(bs, hq, splits_cap, device="cuda")
    kw = _kv_args(kv_dtype, "k_scale", "v_scale")
    if config is not None:
        kw["config"] = config
    us = graph_us(lambda: decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, splits, splits_cap, d ** -0.5,
                                               **kw))
    nbytes = 2 * bs * ctx * hkv * d * kb.element_size()
    out = dict(us=us, tbps=nbytes / (us * 1e-6) / 1e12)
    if config is not None or split_cap != 32:  # the same function as the defaults compute
        ref = torch.empty_like(q)
        compute_num_kv_splits(lens, splits, splits_cap, sms, hkv)
        decode_attention_fwd(q, kb, vb, ref, indptr, idx, logits, lse, splits, splits_cap, d ** -0.5,
                             **_kv_args(kv_dtype, "k_scale", "v_scale"))
        out["rel_err"] = float((o.float() - ref.float()).norm() / ref.float().norm())
    return out


def _plain_prefill_hint(extend_fwd) -> dict:
    """``has_prefix=False`` (what the triton backend passes for a batch without cached
    prefixes) where ``extend_fwd`` takes it; none on trees before session 14."""
    return {"has_prefix": False} if "has_prefix" in inspect.signature(extend_fwd).parameters else {}


def extend(t: int = 8192, hq: int = 32, hkv: int = 8, d: int = 128) -> dict:
    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    qo = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    kv_indptr = torch.zeros(2, dtype=torch.int32, device="cuda")
    kv_idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    kw = _plain_prefill_hint(extend_attention_fwd)
    us = graph_us(lambda: extend_attention_fwd(q, k, v, o, k, v, qo, kv_indptr, kv_idx, None, True, None, t,
                                               d ** -0.5, **kw), calls=5)
    return dict(us=us, tflops=2 * 2 * t * t / 2 * hq * d / (us * 1e-6) / 1e12)


def extend_prefix(bs: int = 4, prefix: int = 8192, new: int = 512, hq: int = 32, hkv: int = 8, d: int = 128,
                  kv_dtype: torch.dtype = torch.bfloat16, config=None, plain_new: int = 0) -> dict:
    """Causal extend of ``new`` bf16 tokens a request over a cached ``prefix`` of
    ``kv_dtype`` (random slots; fp8 entries = the bf16 values cast, scale 1): the prefill
    of a prefix-cache hit. ``tflops`` counts the prefix and the causal new-token scores.
    ``config``: an `ExtendConfig` instead of the default (`benchmarks/fp8_extend_sweep.py`).
    ``plain_new`` > 0 adds one request of that many new tokens and no prefix first (a mixed
    batch: a plain prefill chunk beside the prefix hits)."""
    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

    g = torch.Generator(device="cuda").manual_seed(3)
    news = ([plain_new] if plain_new else []) + [new] * bs
    prefixes = ([0] if plain_new else []) + [prefix] * bs
    t = sum(news)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    slots = bs * prefix + 2
    kb = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).to(kv_dtype)
    vb = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).to(kv_dtype)
    qo = torch.tensor([0] + news, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)
    kv_indptr = torch.tensor([0] + prefixes, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)
    kv_idx = (torch.randperm(slots - 1, device="cuda", generator=g) + 1).to(torch.int32)
    kw = _kv_args(kv_dtype, "k_scale", "v_scale")
    if config is not None:
        kw["config"] = config
    if prefix == 0:
        kw.update(_plain_prefill_hint(extend_attention_fwd))
    us = graph_us(lambda: extend_attention_fwd(q, k, v, o, kb, vb, qo, kv_indptr, kv_idx, None, True, None, max(news),
                                               d ** -0.5, **kw), calls=5)
    flops = hq * d * 2 * 2 * sum(e * p + e * e / 2 for e, p in zip(news, prefixes))
    return dict(us=us, tflops=flops / (us * 1e-6) / 1e12)


def summarize_rounds(res: dict, shape: str, times: dict, base: str) -> None:
    """Record one shape's timed rounds in ``res``: ``res["rounds"][shape] = times`` (name ->
    list of us) and ``res["us"][shape]`` their medians; print each median with ``base``'s
    median over it (> 1: faster than ``base``)."""
    res["rounds"][shape] = times
    res["us"][shape] = {k: statistics.median(t) for k, t in times.items()}
    b = res["us"][shape][base]
    for k, t in res["us"][shape].items():
        print(f"{shape} {k:30s} {t:8.1f} us  {base}/this {b / t:.3f}", flush=True)


def mla_inputs(bs: int, ctx: int, heads: int, page: int = 64, kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Seeded inputs of `mla_decode` (512 + 64 dims, ``bs`` requests of ``ctx`` tokens on
    random distinct pages, the device split heuristic's count): ``q_nope``, ``q_pe``, ``kv``
    (pool ``[slots, 1, 576]`` of ``kv_dtype``, random bf16 values cast), ``table``,
    ``lens``, ``o``, ``splits``, ``ws`` (workspace), in that order."""
    from attnserve.attention.triton_ops.mla_decode import mla_num_kv_splits, mla_split_sm_count, mla_workspace_size

    g = torch.Generator(device="cuda").manual_seed(2)
    blocks = ctx // page
    pages = bs * blocks + 1
    kv = torch.randn(pages * page, 1, 576, device="cuda", dtype=torch.bfloat16, generator=g).to(kv_dtype)
    table = ((torch.randperm(pages - 1, device="cuda", generator=g) + 1).to(torch.int32)).view(bs, blocks)
    lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    q_nope = torch.randn(bs, heads, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(bs, heads, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    o = torch.empty(bs, heads, 512, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = mla_num_kv_splits(ctx, bs, mla_split_sm_count(sms, heads, kv_dtype))
    ws = torch.empty(mla_workspace_size(ctx, bs, splits, heads, 512), dtype=torch.uint8, device="cuda")
    return dict(q_nope=q_nope, q_pe=q_pe, kv=kv, table=table, lens=lens, o=o, splits=splits, ws=ws)


def mla_decode(bs: int, ctx: int, heads: int, page: int = 64, kv_dtype: torch.dtype = torch.bfloat16,
               triton_stage1: bool = False, config=None) -> dict:
    """Paged MLA decode (512 + 64, CUDA graph). ``triton_stage1``: an fp8 cache runs the
    Triton stage 1 it ran before the fp8 seesaw kernel (the 16-bit default config with
    ``stage1="triton"``), for A/B rows in one run. ``config``: an explicit `MLADecodeConfig`
    (e.g. the fp8 seesaw kernel's, to time the fp8 default of an older tree)."""
    from attnserve.attention.triton_ops.mla_decode import mla_decode_fwd

    q_nope, q_pe, kv, table, lens, o, splits, ws = mla_inputs(bs, ctx, heads, page, kv_dtype).values()
    kw = _kv_args(kv_dtype, "kv_scale")
    if triton_stage1:
        import dataclasses

        from attnserve.attention.triton_ops.mla_decode import mla_decode_config

        kw["config"] = dataclasses.replace(mla_decode_config(heads, 512, 64, torch.bfloat16), stage1="triton")
    if config is not None:
        kw["config"] = config
    us = graph_us(lambda: mla_decode_fwd(q_nope, q_pe, kv, table, lens, page, o, 192 ** -0.5, splits, splits,
                                         workspace=ws, **kw))
    out = dict(us=us, tbps=bs * ctx * 576 * kv.element_size() / (us * 1e-6) / 1e12, splits=splits)
    if kw:  # which stage 1 ran (an fp8 cache, or an explicit config)
        from attnserve.attention.triton_ops.mla_decode import mla_stage1_kernel

        out["stage1"] = str(mla_stage1_kernel(q_nope, q_pe, kv, page, kw.get("config")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import attnserve
    import triton

    rows = {
        "gqa_decode_bs64_8k": gqa_decode(64, 8192),
        "gqa_decode_bs8_32k": gqa_decode(8, 32768),
        "extend_1x8192": extend(),
        "mla128_decode_bs32_16k": mla_decode(32, 16384, 128),
        "mla16_decode_bs128_4k": mla_decode(128, 4096, 16),
    }
    res = dict(label=args.label, attnserve=os.path.dirname(attnserve.__file__), device=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.label}.json"), "w") as f:
        json.dump(res, f, indent=1)
    for k, v in rows.items():
        print(args.label, k, {a: round(b, 3) if isinstance(b, float) else b for a, b in v.items()}, flush=True)


if __name__ == "__main__":
    main()
