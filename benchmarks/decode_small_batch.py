"""Small-batch decode attention: the launch before the small-batch rule against the rule and
its parts (issues 37/38: batch-1 steps, where latency rules, not bandwidth).

``PYTHONPATH=src python benchmarks/decode_small_batch.py [--out DIR] [--quick] [--variants ...]``

For batch 1/2/4/8 at contexts 128/576/2048/8192 and the attention heads of Llama-3-8B at
tp 1 (32 q / 8 KV heads) and tp 4 (8 / 2) and Qwen3-0.6B (16 / 8), d 128, bf16 KV (``--kv-dtypes``
adds fp8_e4m3), page size 1 with whole requests in shuffled order (as after prefill), this
times inside a CUDA graph (`common.bench_graph`, launch cost removed as in a decode step):

* ``attn_us``: one decode attention call (stage 1 + stage 2), the graph cycling over enough
  layers' K/V buffers (up to 32) that the KV is not L2-resident, as in a real step;
* ``call_us``: the split-count kernel (`compute_num_kv_splits`, once per step in the engine)
  plus one attention call.

Variants (``--variants``; `VARIANTS`): ``current`` = the launch before the rule
(``ATTNSERVE_DECODE_SMALL_BATCH=0``: one split merged per step, no PDL, whole-wave split
counts); ``merge`` = + stage 2 merging 32 splits per step; ``merge_pdl`` = + PDL on both
stages; ``new`` = the default rule (`decode_config` with the rule on, one-tile splits of
`SMALL_SPLIT_TOKENS`); ``new_nopdl``; ``split256`` / ``split512`` = the rule with 2- and
4-tile splits (fewer, longer splits); ``bn64`` = the rule with 64-key tiles and 64-key
splits (smaller tiles at tiny lengths; decode_config's stages); ``one_split`` = every request in one split (stage 1
writes ``o``, stage 2 launches and returns: what skipping stage 2 could reach, at the cost
of the long contexts). Every variant's output is checked against float64 (max |err|).

Prints a table of µs per case and, per variant, the geometric mean of ``attn_us`` relative
to ``current`` and the worst case; writes ``<out>/<device>-decode-small-batch-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
from dataclasses import replace

import torch

from attnserve.bench.results import write_result
from common import bench_graph

DEV = "cuda"
SHAPES = {"llama-tp1": (32, 8), "llama-tp4": (8, 2), "qwen3-0.6b": (16, 8)}
D = 128
BATCHES = (1, 2, 4, 8)
CONTEXTS = (128, 576, 2048, 8192)
MAX_KV_SPLITS = 32  # the engine's default (backend_config.DEFAULT_NUM_KV_SPLITS)
DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
#: name -> (merge_block or None for decode_config's, pdl or None for decode_config's,
#: small_split_tokens, force one split, block_n or None for decode_config's)
VARIANTS = {
    "current": (1, False, 0, False, None),
    "merge": (32, False, 0, False, None),
    "merge_pdl": (32, True, 0, False, None),
    "new": (None, None, 128, False, None),
    "new_nopdl": (None, False, 128, False, None),
    "split256": (None, None, 256, False, None),
    "split512": (None, None, 512, False, None),
    "bn64": (None, None, 64, False, 64),
    "one_split": (None, None, 0, True, None),
}
_L2_BYTES = 96 << 20  # K/V bytes the layer rotation covers (> an H100's / H200's 50 / 60 MB L2)


def _case(hq, hkv, bs, ctx, dtype, gen):
    """q, per-layer K/V buffers, lengths, indptr, indices (whole requests, shuffled)."""
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr

    lens = torch.full((bs,), ctx, dtype=torch.int32)
    total = bs * ctx
    order = torch.randperm(bs, generator=gen).tolist()
    starts, pos = [0] * bs, 1
    for i in order:
        starts[i] = pos
        pos += ctx
    indices = torch.cat([torch.arange(s, s + ctx) for s in starts]).to(DEV, torch.int32)
    kv_bytes = total * hkv * D * 2 * torch.empty(0, dtype=dtype).element_size()
    layers = max(1, min(32, math.ceil(_L2_BYTES / kv_bytes)))
    ks = [torch.randn(total + 1, hkv, D, generator=gen).to(DEV, torch.bfloat16).to(dtype) for _ in range(layers)]
    vs = [torch.randn(total + 1, hkv, D, generator=gen).to(DEV, torch.bfloat16).to(dtype) for _ in range(layers)]
    q = torch.randn(bs, hq, D, generator=gen).to(DEV, torch.bfloat16)
    lens = lens.to(DEV)
    return q, ks, vs, lens, compute_kv_indptr(lens), indices, kv_bytes


def _reference(q, k, v, indices, ctx):
    bs, hq, _ = q.shape
    group = hq // k.shape[1]
    out = torch.empty(bs, hq, D, dtype=torch.float64, device=DEV)
    for i in range(bs):
        s = indices[i * ctx:(i + 1) * ctx].long()
        kk = k[s].double().repeat_interleave(group, dim=1)
        vv = v[s].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), kk) / math.sqrt(D), dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, vv)
    return out


def _rule_config(hq, hkv, bs, dtype):
    """`decode_config` with the small-batch rule on, for this device and batch."""
    from attnserve.attention.triton_ops.decode_attention import decode_config
    from attnserve.attention.triton_ops.decode_tuning import SMALL_BATCH_ENV

    props = torch.cuda.get_device_properties(0)
    old = os.environ.get(SMALL_BATCH_ENV)
    os.environ[SMALL_BATCH_ENV] = "1"
    try:
        return decode_config(D, hq // hkv, dtype, max_shared_mem=props.shared_memory_per_block_optin,
                             device_name=torch.cuda.get_device_name(), batch_size=bs, num_kv_heads=hkv,
                             num_sms=props.multi_processor_count)
    finally:
        if old is None:
            del os.environ[SMALL_BATCH_ENV]
        else:
            os.environ[SMALL_BATCH_ENV] = old


def run_case(shape, bs, ctx, dname, variants, gen):
    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention_fwd

    hq, hkv = SHAPES[shape]
    dtype = DTYPES[dname]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, ks, vs, lens, indptr, indices, kv_bytes = _case(hq, hkv, bs, ctx, dtype, gen)
    ref = _reference(q, ks[0], vs[0], indices, ctx)
    rule = _rule_config(hq, hkv, bs, dtype)
    logits = torch.empty(bs, hq, MAX_KV_SPLITS, D, device=DEV)
    lse = torch.empty(bs, hq, MAX_KV_SPLITS, device=DEV)
    rows = []
    for name in variants:
        merge_block, pdl, small_tokens, one, block_n = VARIANTS[name]
        cfg = replace(rule, merge_block=rule.merge_block if merge_block is None else merge_block,
                      pdl=rule.pdl if pdl is None else pdl, block_n=block_n or rule.block_n)
        splits = torch.empty(bs, dtype=torch.int32, device=DEV)

        def meta():
            if one:
                splits.fill_(1)
            else:
                compute_num_kv_splits(lens, splits, MAX_KV_SPLITS, sms, hkv, small_split_tokens=small_tokens)

        outs = [torch.empty(bs, hq, D, device=DEV, dtype=torch.bfloat16) for _ in ks]

        def attn(i):
            decode_attention_fwd(q, ks[i], vs[i], outs[i], indptr, indices, logits, lse, splits, MAX_KV_SPLITS,
                                 D ** -0.5, config=cfg)

        attn_fns = [lambda i=i: attn(i) for i in range(len(ks))]
        call_fns = [lambda i=i: (meta(), attn(i)) for i in range(len(ks))]
        row = {"shape": shape, "hq": hq, "hkv": hkv, "bs": bs, "context": ctx, "kv_dtype": dname,
               "variant": name, "block_n": cfg.block_n, "merge_block": cfg.merge_block, "pdl": cfg.pdl,
               "small_split_tokens": small_tokens, "layers_rotated": len(ks), "kv_bytes_per_layer": kv_bytes}
        try:
            meta()
            attn(0)
            torch.cuda.synchronize()
            row["num_kv_splits"] = splits.tolist()
            row["max_abs_err_vs_f64"] = float((outs[0].double() - ref).abs().max())
            row["attn_us"] = bench_graph(attn_fns, min_calls=max(24, len(ks)))
            row["call_us"] = bench_graph(call_fns, min_calls=max(24, len(ks)))
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    del q, ks, vs, logits, lse
    torch.cuda.empty_cache()
    return rows


def summarize(rows, variants):
    """Per variant: geometric mean and worst of attn_us / current's attn_us over the cases
    where both ran, and the cases where it was best."""
    cases = {}
    for r in rows:
        cases.setdefault((r["shape"], r["bs"], r["context"], r["kv_dtype"]), {})[r["variant"]] = r
    out = {}
    for v in variants:
        ratios, wins = [], 0
        for case in cases.values():
            if "attn_us" in case.get(v, {}) and "attn_us" in case.get("current", {}):
                ratios.append(case[v]["attn_us"] / case["current"]["attn_us"])
            ok = {k: c["attn_us"] for k, c in case.items() if "attn_us" in c}
            if ok and min(ok, key=ok.get) == v:
                wins += 1
        if ratios:
            out[v] = {"geomean_vs_current": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                      "worst_vs_current": max(ratios), "best_vs_current": min(ratios), "cases": len(ratios),
                      "fastest_in": wins}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="bs 1 and 8, contexts 576 and 8192")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--kv-dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_small_batch needs a CUDA GPU")
    import time

    import triton

    from attnserve.pdl import pdl_enabled

    variants = ["current"] + [v for v in args.variants if v != "current"]
    t0 = time.perf_counter()
    pdl = pdl_enabled(torch.device(DEV))
    print(f"{torch.cuda.get_device_name()}: PDL {'available' if pdl else 'OFF (variants with pdl run without)'}",
          flush=True)
    batches, contexts = ((1, 8), (576, 8192)) if args.quick else (BATCHES, CONTEXTS)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'shape':11s} {'kv':8s} {'bs':>2s} {'ctx':>5s} " + " ".join(f"{v:>10s}" for v in variants)
          + "   (attn_us; call_us of current/new)", flush=True)
    for dname in args.kv_dtypes:
        for shape in args.shapes:
            for bs in batches:
                for ctx in contexts:
                    case = run_case(shape, bs, ctx, dname, variants, gen)
                    rows.extend(case)
                    by = {r["variant"]: r for r in case}
                    cells = " ".join(f"{by[v]['attn_us']:10.2f}" if "attn_us" in by[v] else f"{'err':>10s}"
                                     for v in variants)
                    calls = " / ".join(f"{by[v]['call_us']:.2f}" for v in ("current", "new")
                                       if v in by and "call_us" in by[v])
                    print(f"{shape:11s} {dname:8s} {bs:2d} {ctx:5d} {cells}   ({calls})", flush=True)
    bad = [r for r in rows if "error" in r or r.get("max_abs_err_vs_f64", 0.0) > (0.1 if "fp8" in r["kv_dtype"]
                                                                                   else 0.02)]
    summary = summarize(rows, variants)
    print("\nattn_us relative to current (geomean / best / worst over cases; fastest in n cases):")
    for v, s in summary.items():
        print(f"  {v:10s} {s['geomean_vs_current']:.3f} / {s['best_vs_current']:.3f} / {s['worst_vs_current']:.3f}"
              f"  fastest in {s['fastest_in']} of {s['cases']}")
    print(f"correctness: {'PASS' if not bad else 'FAIL'} ({len(bad)} rows with an error or max |err| above bound)")
    for r in bad[:10]:
        print("  ", {k: r.get(k) for k in ("shape", "bs", "context", "kv_dtype", "variant", "error",
                                           "max_abs_err_vs_f64")})
    result = {"benchmark": "decode_small_batch", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "pdl_enabled": pdl, "max_kv_splits": MAX_KV_SPLITS,
              "total_s": time.perf_counter() - t0, "summary": summary, "correct": not bad, "rows": rows}
    write_result(result, args.out, "decode-small-batch")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
