"""fp8-KV paged decode: the Triton stage 1 against the Gluon one (``ATTNSERVE_DECODE_FP8_GLUON=1``).

``PYTHONPATH=src python benchmarks/decode_fp8_gluon_bench.py [--out DIR] [--quick]``

Per case (Llama-3-8B heads: Hq 32, Hkv 8, D 128, page 1, whole requests at shuffled slots as
`decode_batch_sweep.py` lays them out; e4m3 cache, bf16 queries, k_scale 1, v_scale 0.5)
it runs each path (`PATHS`: the Triton fp8 stage 1, the Gluon default and three other
Gluon tiles through the environment variable, as the engine would; same split counts:
`compute_num_kv_splits` as the triton backend calls it, 32 splits at most, the small-batch
rule; all cut splits at 128 keys), checks that the call was routed as intended and that the
output matches float64 attention over the dequantised cache on up to 8 requests (a path
off by more than 2e-2 + 2e-2 |ref| is reported and not timed; the |difference| from the
Triton output is recorded too), then times the full decode (stage 1 + stage 2) in
a CUDA graph (`common.bench_graph`) and prints µs, K+V GB/s and the share of the
device-to-device copy rate measured in the same run (`common.measure_ceilings`).
Writes ``<out>/<device>-decode-fp8-gluon-<date>.json`` with the date, device and versions.
Expected to take well under 3 minutes on an H100 (the Gluon kernel's compile is ~10 s).
"""

from __future__ import annotations

import argparse
import datetime as dt

import torch

from attnserve.bench.results import write_result
from common import bench_graph, env_set

#: (label, batch, context or (lo, hi) uniform lengths)
CASES = [("144x800", 144, 800), ("256x[200,1800]", 256, (200, 1800)), ("64x640", 64, 640), ("8x4096", 8, 4096),
         ("1x8192", 1, 8192)]
HQ, HKV, D = 32, 8, 128
MAX_KV_SPLITS = 32  # DEFAULT_NUM_KV_SPLITS of the triton backend
V_SCALE = 0.5
ATOL = RTOL = 2e-2  # bf16 outputs, fp16 dots (tests/gpu/test_decode_fp8_gluon_gpu.py)
DEVICE = "cuda"
#: timed paths: name -> value of ATTNSERVE_DECODE_FP8_GLUON (None: the Triton fp8 kernel)
PATHS = {"triton": None, "gluon": "1", "gluon-64x3": "64x3", "gluon-128x2": "128x2", "gluon-64x4-bytes": "64x4-bytes"}


def _reference(q, k, v, indptr, indices, rows_b):
    """float64 attention of requests ``rows_b`` over the dequantised cache ([n, HQ, D])."""
    group = HQ // HKV
    out = []
    for b in rows_b:
        rows = indices[int(indptr[b]):int(indptr[b + 1])].long()
        kb = k[rows].double().repeat_interleave(group, dim=1)
        vb = v[rows].double().repeat_interleave(group, dim=1) * V_SCALE
        s = torch.einsum("hd,nhd->hn", q[b].double(), kb) * D ** -0.5
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vb))
    return torch.stack(out)


def run(quick: bool = False) -> tuple:
    from decode_batch_sweep import _case

    from attnserve.attention.backend_config import DEFAULT_SPLIT_TILE_SIZE
    from attnserve.attention.triton_ops.decode_attention import (_fp8_gluon_route, compute_num_kv_splits,
                                                                 decode_attention_fwd)
    from attnserve.attention.triton_ops.decode_fp8_gluon import FP8_GLUON_ENV
    from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS
    from attnserve.attention.triton_ops.decode_tuning import small_batch_rule_enabled
    from common import measure_ceilings

    ceil = measure_ceilings()
    copy_bps = ceil["copy_tbps"] * 1e12
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: copy rate {ceil['copy_tbps']:.3f} TB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, bs, ctx in CASES[:2] if quick else CASES:
        q, k, v, lens, indptr, indices, total = _case(HQ, HKV, D, bs, ctx, torch.float8_e4m3fn, gen)
        kv_bytes = total * HKV * D * 2
        splits = torch.empty(bs, dtype=torch.int32, device=DEVICE)
        compute_num_kv_splits(lens, splits, MAX_KV_SPLITS, sms, HKV, split_tile_size=DEFAULT_SPLIT_TILE_SIZE,
                              small_split_tokens=SMALL_SPLIT_TOKENS if small_batch_rule_enabled() else 0)
        logits = torch.empty(bs, HQ, MAX_KV_SPLITS, D, device=DEVICE)
        lse = torch.empty(bs, HQ, MAX_KV_SPLITS, device=DEVICE)
        outs = {p: torch.empty(bs, HQ, D, device=DEVICE, dtype=torch.bfloat16) for p in PATHS}

        def call(path):
            decode_attention_fwd(q, k, v, outs[path], indptr, indices, logits, lse, splits, MAX_KV_SPLITS,
                                 D ** -0.5, v_scale=V_SCALE)

        base = {"case": label, "bs": bs, "context": list(ctx) if isinstance(ctx, tuple) else ctx,
                "kv_bytes": kv_bytes, "mean_splits": float(splits.float().mean()), "max_splits": int(splits.max())}
        sample = sorted({0, bs // 2, bs - 1} | set(range(0, bs, max(1, bs // 5))))[:8]
        ref = _reference(q, k, v, indptr, indices, sample)
        for path, flag in PATHS.items():
            with env_set(FP8_GLUON_ENV, flag):
                routed = _fp8_gluon_route(q, k, v, indptr, indices, splits, 0.0, False) is not None
                call(path)
            torch.cuda.synchronize()
            err = (outs[path][sample].double() - ref).abs()
            row = dict(base, path=path, env=flag, routed_to_gluon=routed,
                       max_abs_diff_vs_float64=float(err.max()),
                       within_tol_vs_float64=bool((err - RTOL * ref.abs()).max() <= ATOL),
                       nan=bool(torch.isnan(outs[path]).any()),
                       max_abs_diff_vs_triton=float((outs[path].float() - outs["triton"].float()).abs().max()))
            ok = row["within_tol_vs_float64"] and not row["nan"] and routed == (flag is not None)
            if not ok:
                row["error"] = "correctness or routing check failed: not timed"
            else:
                try:
                    with env_set(FP8_GLUON_ENV, flag):  # read while the graph is captured
                        us = bench_graph([lambda p=path: call(p)])
                    row.update(graph_us=us, kv_gbs=kv_bytes / us / 1e3,
                               share_of_copy_rate=kv_bytes / (us * 1e-6) / copy_bps)
                except Exception as e:  # noqa: BLE001 - a failing launch is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            checks = (f"|out - f64| {row['max_abs_diff_vs_float64']:.2e} |out - triton| "
                      f"{row['max_abs_diff_vs_triton']:.2e}")
            if "graph_us" in row:
                print(f"{label:15s} {path:17s} {row['graph_us']:8.1f} us {row['kv_gbs']:7.0f} GB/s "
                      f"{row['share_of_copy_rate']:.3f} of copy  {checks}", flush=True)
            else:
                print(f"{label:15s} {path:17s} ERROR {row['error']}  {checks}", flush=True)
        t_tri = next((r.get("graph_us") for r in rows if r["case"] == label and r["path"] == "triton"), None)
        for r in rows:
            if r["case"] == label and t_tri and r.get("graph_us"):
                r["speedup_vs_triton"] = t_tri / r["graph_us"]
                if r["path"] != "triton":
                    print(f"{label:15s} {r['path']:17s} x{r['speedup_vs_triton']:.3f} over triton", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows, ceil


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="the first two cases only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_fp8_gluon_bench needs a CUDA GPU")
    import triton

    rows, ceil = run(args.quick)
    result = {"benchmark": "decode_fp8_gluon", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "ceilings": ceil, "heads": [HQ, HKV, D], "max_kv_splits": MAX_KV_SPLITS,
              "v_scale": V_SCALE, "rows": rows}
    write_result(result, args.out, "decode-fp8-gluon")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
