"""fp8-KV paged decode: the default V-pairs tiles against the opt-in ones, in one GPU run.

``PYTHONPATH=src python benchmarks/decode_fp8_variants.py [--out DIR] [--variants a,b] [--bf16-variants a,b] [--quick]
[--more-cases] [--no-pdl-rows]``

Why (benchmarks/NOTES.md, "fp8-KV decode: offline instruction analysis (2026-11-27)"): with
Triton 3.6 the default fp8 tiles (256 keys / 3 stages, 128 / 4 for big batches) keep one
shared-memory buffer of K and V, so each stage-1 program waits for its next tile only after
computing the current one; per key that compute is as long as bf16's, but the tile has half
the bytes. The opt-in tiles (`decode_tuning.FP8_TILE_VARIANTS`, chosen by
``ATTNSERVE_DECODE_FP8_TILE``) keep 2-3 buffers and/or 3 programs per SM. The bf16 cache's
tiles are single-buffered too; its opt-in tiles (`decode_tuning.BF16_TILE_VARIANTS`,
``ATTNSERVE_DECODE_BF16_TILE``, ``--bf16-variants``) are timed against the bf16 default the
same way (offline sm_90a: db64 168 registers / 70.5 KB, two buffers, 3 programs per SM).
A ``pdl-all`` row per cache dtype times its default tiles with both stages launched with PDL
at every batch (``ATTNSERVE_DECODE_PDL_ALL=1``; by default only batches whose stage 1 fits in
one wave get PDL): stage 2's launch then overlaps stage 1's last wave.

Per case (Llama-3-8B heads: Hq 32, Hkv 8, D 128, page 1, whole requests at shuffled slots as
`decode_batch_sweep.py` lays them out; e4m3 cache, bf16 queries) it times stage 1 + 2 inside
a CUDA graph (`common.bench_graph`) with the tiles `decode_config` picks for the batch
(default, then each variant through the environment variable, as the engine would), plus the
bf16 cache's default for reference, with the engine's split counts (`compute_num_kv_splits`,
32 splits at most, split tile 256, the small-batch rule as the triton backend applies it).
Prints and records µs, K+V GB/s, the share of the device-to-device copy rate measured in
the same run, the speed-up over the default and the largest |difference| from the default's
output (different tiles round differently: expect ~1e-3 on outputs of magnitude ~1).
Writes ``<out>/<device>-decode-fp8-variants-<date>.json``. Takes about a minute on an H100.
"""

from __future__ import annotations

import argparse
import datetime as dt

import torch

from attnserve.bench.results import write_result
from common import bench_graph, env_set

#: (label, batch, context or (lo, hi) uniform lengths)
CASES = [("144x800", 144, 800), ("64x640", 64, 640), ("256x[200,1800]", 256, (200, 1800)), ("8x4096", 8, 4096),
         ("1x8192", 1, 8192), ("32x2048", 32, 2048), ("16x[100,1024]", 16, (100, 1024))]
#: ``--more-cases``: batches between the small-batch and the batch tiles (where the H200 sweep of
#: 2026-11-28 found 64-key tiles faster at 64 x 800)
MORE_CASES = [("64x512", 64, 512), ("96x800", 96, 800), ("128x640", 128, 640), ("32x800", 32, 800),
              ("48x[100,2000]", 48, (100, 2000)), ("112x[100,2000]", 112, (100, 2000))]
HQ, HKV, D = 32, 8, 128
MAX_KV_SPLITS = 32  # DEFAULT_NUM_KV_SPLITS of the triton backend
DEVICE = "cuda"


#: the row of each dtype's default tiles launched with PDL at every batch (``ATTNSERVE_DECODE_PDL_ALL``)
PDL_ROW = "pdl-all"


def run(variants, quick: bool = False, bf16_variants=(), pdl_rows: bool = True, more_cases: bool = False) -> tuple:
    from decode_batch_sweep import _case

    from attnserve.attention.backend_config import DEFAULT_SPLIT_TILE_SIZE
    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention_fwd
    from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS
    from attnserve.attention.triton_ops.decode_tuning import (BF16_TILE_ENV, FP8_TILE_ENV, PDL_ALL_ENV,
                                                              decode_config, small_batch_rule_enabled)
    from common import measure_ceilings

    ceil = measure_ceilings()
    copy_bps = ceil["copy_tbps"] * 1e12
    props = torch.cuda.get_device_properties(0)
    sms, smem, name = props.multi_processor_count, props.shared_memory_per_block_optin, torch.cuda.get_device_name()
    print(f"{name}: copy rate {ceil['copy_tbps']:.3f} TB/s; variants {variants}", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, bs, ctx in (CASES[:2] if quick else CASES) + (MORE_CASES if more_cases else []):
        ref, inputs = {}, {}
        for kv_name, variant in ([("bf16", None), ("fp8_e4m3", None)] + [("fp8_e4m3", v) for v in variants]
                                 + [("bf16", v) for v in bf16_variants]
                                 + ([("bf16", PDL_ROW), ("fp8_e4m3", PDL_ROW)] if pdl_rows else [])):
            dtype = torch.bfloat16 if kv_name == "bf16" else torch.float8_e4m3fn
            if variant is None:  # new inputs per dtype; the variants reuse that dtype's
                inputs[kv_name] = _case(HQ, HKV, D, bs, ctx, dtype, gen)
            q, k, v, lens, indptr, indices, total = inputs[kv_name]
            kv_bytes = total * HKV * D * 2 * k.element_size()
            tile = None if variant == PDL_ROW else variant
            with env_set(FP8_TILE_ENV if kv_name == "fp8_e4m3" else BF16_TILE_ENV, tile), \
                    env_set(PDL_ALL_ENV, "1" if variant == PDL_ROW else None):
                cfg = decode_config(D, HQ // HKV, dtype, max_shared_mem=smem, device_name=name, batch_size=bs,
                                    num_kv_heads=HKV, num_sms=sms)
            splits = torch.empty(bs, dtype=torch.int32, device=DEVICE)
            compute_num_kv_splits(lens, splits, MAX_KV_SPLITS, sms, HKV, split_tile_size=DEFAULT_SPLIT_TILE_SIZE,
                                  small_split_tokens=SMALL_SPLIT_TOKENS if small_batch_rule_enabled() else 0)
            logits = torch.empty(bs, HQ, MAX_KV_SPLITS, D, device=DEVICE)
            lse = torch.empty(bs, HQ, MAX_KV_SPLITS, device=DEVICE)
            o = torch.empty(bs, HQ, D, device=DEVICE, dtype=torch.bfloat16)

            def call():
                decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, MAX_KV_SPLITS, D ** -0.5,
                                     config=cfg)

            row = {"case": label, "bs": bs, "context": list(ctx) if isinstance(ctx, tuple) else ctx,
                   "kv_dtype": kv_name, "variant": variant or "default", "block_n": cfg.block_n,
                   "num_stages": cfg.num_stages, "num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg,
                   "v_pairs": cfg.v_pairs, "pdl": cfg.pdl, "kv_bytes": kv_bytes,
                   "mean_splits": float(splits.float().mean())}
            try:
                call()
                torch.cuda.synchronize()
                if variant is None:
                    ref[kv_name] = o.float().clone()
                row["max_abs_diff_vs_default"] = float((o.float() - ref[kv_name]).abs().max())
                us = bench_graph([call])
                row.update(graph_us=us, kv_gbs=kv_bytes / us / 1e3, share_of_copy_rate=kv_bytes / (us * 1e-6) / copy_bps)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
        base = {r["kv_dtype"]: r for r in rows if r["case"] == label and r["variant"] == "default" and "graph_us" in r}
        for r in rows:
            if r["case"] != label:
                continue
            if r["kv_dtype"] in base and "graph_us" in r:
                r["speedup_vs_default"] = base[r["kv_dtype"]]["graph_us"] / r["graph_us"]
            tile = f"{r['block_n']}/{r['num_stages']}/{r['num_warps']}" + (f" r{r['maxnreg']}" if r["maxnreg"] else "")
            if "graph_us" in r:
                extra = (f" x{r['speedup_vs_default']:.3f} |diff| {r['max_abs_diff_vs_default']:.2e}"
                         if "speedup_vs_default" in r else "")
                print(f"{label:15s} {r['kv_dtype']:8s} {r['variant']:10s} {tile:12s} {r['graph_us']:8.1f} us "
                      f"{r['kv_gbs']:7.0f} GB/s {r['share_of_copy_rate']:.3f} of copy{extra}", flush=True)
            else:
                print(f"{label:15s} {r['kv_dtype']:8s} {r['variant']:10s} {tile:12s} ERROR {r['error']}", flush=True)
        del q, k, v, inputs
        torch.cuda.empty_cache()
    return rows, ceil


def main(argv=None) -> int:
    from attnserve.attention.triton_ops.decode_tuning import BF16_TILE_VARIANTS, FP8_TILE_VARIANTS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--variants", default=",".join(FP8_TILE_VARIANTS),
                    help=f"comma-separated names of FP8_TILE_VARIANTS (default: all, {sorted(FP8_TILE_VARIANTS)})")
    ap.add_argument("--bf16-variants", default=",".join(BF16_TILE_VARIANTS),
                    help=f"comma-separated names of BF16_TILE_VARIANTS (default: all, {sorted(BF16_TILE_VARIANTS)})")
    ap.add_argument("--quick", action="store_true", help="the first two cases only")
    ap.add_argument("--more-cases", action="store_true", help="also MORE_CASES (batches of 32-128 requests)")
    ap.add_argument("--no-pdl-rows", action="store_true", help="without the pdl-all rows")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bf16_variants = [v for v in args.bf16_variants.split(",") if v]
    for names, table in ((variants, FP8_TILE_VARIANTS), (bf16_variants, BF16_TILE_VARIANTS)):
        unknown = [v for v in names if v not in table]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {sorted(table)}")
    if not torch.cuda.is_available():
        raise SystemExit("decode_fp8_variants needs a CUDA GPU")
    import triton

    rows, ceil = run(variants, args.quick, bf16_variants, not args.no_pdl_rows, args.more_cases)
    result = {"benchmark": "decode_fp8_variants", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "ceilings": ceil, "heads": [HQ, HKV, D], "max_kv_splits": MAX_KV_SPLITS,
              "rows": rows}
    write_result(result, args.out, "decode-fp8-variants")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
