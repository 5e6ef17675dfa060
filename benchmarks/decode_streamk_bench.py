"""Split-K vs stream-K decode attention (`decode_streamk`) on large decode batches.

``PYTHONPATH=src python benchmarks/decode_streamk_bench.py [--out DIR] [--quick]``

Per case (Llama-3-8B heads: Hq 32, Hkv 8, D 128; KV slots are whole requests in a shuffled
order, page 1; ``max_kv_splits`` 32 as the engine): the default decode (split counts as the
triton backend computes them, `decode_config` tiles) and stream-K at 1 and 2 programs per SM
and a few tiles, each stage 1 + 2 timed inside a CUDA graph (`common.bench_graph`, launch
cost removed, as in a decode step) with the step's plan made once outside the graph (the
backend would make it once per step for all layers); the plan kernel is timed alone
(``plan_us``), and stream-K with its defaults, planning inside every call (the
``ATTNSERVE_DECODE_STREAMK=1`` path without a step plan), as ``pps env``. Bytes are ``sum(lens) * Hkv * D * 2 * elem``
(K and V); ``share`` is against the device-to-device copy rate measured in the same run.
Every stream-K output is checked against the default's (max |diff|; bf16 outputs, so ~1e-2
is one rounding). Writes ``<out>/<device>-decode-streamk-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt

import torch

from attnserve.bench.results import write_result
from common import bench_graph
from decode_batch_sweep import _case

HQ, HKV, D = 32, 8, 128
MAX_SPLITS = 32
#: (label, batch, context or (lo, hi) uniform lengths, KV dtype)
CASES = [
    ("bf16 64x640", 64, 640, torch.bfloat16),
    ("bf16 144x800", 144, 800, torch.bfloat16),
    ("bf16 256x[200,1800]", 256, (200, 1800), torch.bfloat16),
    ("e4m3 144x800", 144, 800, torch.float8_e4m3fn),
    ("e4m3 64x640", 64, 640, torch.float8_e4m3fn),
    ("bf16 8x4096", 8, 4096, torch.bfloat16),
]
#: stream-K variants: (programs per SM, (block_n, num_stages, num_warps) or None for the default tile)
VARIANTS = [(1, None), (2, None), (2, (128, 2, 4)), (1, (64, 4, 4)), (2, (64, 3, 4))]


def run(quick: bool = False) -> tuple:
    from dataclasses import replace

    from attnserve.attention.triton_ops import decode_streamk as sk
    from attnserve.attention.triton_ops.decode_attention import _head_blocks, decode_attention_fwd, decode_config
    from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS, compute_num_kv_splits
    from common import measure_ceilings

    ceil = measure_ceilings()
    copy_bps = ceil["copy_tbps"] * 1e12
    print(f"copy rate {ceil['copy_tbps']:.3f} TB/s", flush=True)
    props = torch.cuda.get_device_properties(0)
    sms, smem, name = props.multi_processor_count, props.shared_memory_per_block_optin, torch.cuda.get_device_name()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, bs, ctx, dtype in (CASES[:2] + CASES[3:4] if quick else CASES):
        q, k, v, lens, indptr, indices, total = _case(HQ, HKV, D, bs, ctx, dtype, gen)
        kv_bytes = total * HKV * D * 2 * k.element_size()
        logits = torch.empty(bs, HQ, MAX_SPLITS, D, device="cuda")
        lse = torch.empty(bs, HQ, MAX_SPLITS, device="cuda")
        splits = torch.empty(bs, dtype=torch.int32, device="cuda")
        compute_num_kv_splits(lens, splits, MAX_SPLITS, sms, HKV, small_split_tokens=SMALL_SPLIT_TOKENS)
        base = decode_config(D, HQ // HKV, dtype, max_shared_mem=smem, device_name=name, batch_size=bs,
                             num_kv_heads=HKV, num_sms=sms)
        hp = HKV * _head_blocks(max(16, base.block_h), HQ // HKV)
        o_ref = torch.empty(bs, HQ, D, device="cuda", dtype=torch.bfloat16)

        def call_default():
            decode_attention_fwd(q, k, v, o_ref, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5,
                                 streamk=False)

        call_default()
        torch.cuda.synchronize()
        us0 = bench_graph([call_default])
        case = {"case": label, "bs": bs, "context": list(ctx) if isinstance(ctx, tuple) else ctx,
                "kv_dtype": str(dtype).split(".")[-1], "kv_bytes": kv_bytes, "copy_tbps": ceil["copy_tbps"],
                "default": {"us": us0, "gbs": kv_bytes / us0 / 1e3, "share": kv_bytes / (us0 * 1e-6) / copy_bps,
                            "config": [base.block_n, base.num_stages, base.num_warps]},
                "streamk": []}
        print(f"{label:20s} default {us0:7.1f} us {kv_bytes / us0 / 1e3:7.0f} GB/s "
              f"({case['default']['share']:.3f} of copy)", flush=True)
        selected = bs * hp >= sms
        variants = VARIANTS[:2] if quick else VARIANTS
        for pps, tile in variants + [("env", None)]:
            cfg = sk.streamk_config(dtype, base)
            if tile is not None:
                cfg = replace(cfg, block_n=tile[0], num_stages=tile[1], num_warps=tile[2])
            g = sk.streamk_num_programs(sms) if pps == "env" else sk.streamk_num_programs(sms, pps)
            cap = sk.streamk_tile_capacity(indices, bs, cfg.block_n)
            plan = sk.plan_streamk_decode(indptr, bs, cap, cfg.block_n, hp, g, MAX_SPLITS)
            o = torch.empty_like(o_ref)
            row = {"programs_per_sm": pps, "tile": [cfg.block_n, cfg.num_stages, cfg.num_warps],
                   "selected_by_env_rule": selected}

            def call(plan=plan, cfg=cfg, o=o, env=pps == "env"):
                decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5,
                                     streamk=True, config=None if env else cfg,
                                     streamk_plan=None if env else plan, streamk_programs=None if env else g)

            try:
                call()
                torch.cuda.synchronize()
                row["max_abs_diff_vs_default"] = float((o.float() - o_ref.float()).abs().max())
                us = bench_graph([call])
                row.update(us=us, gbs=kv_bytes / us / 1e3, share=kv_bytes / (us * 1e-6) / copy_bps,
                           speedup=us0 / us)
                if pps == 1 and tile is None:
                    row["plan_us"] = bench_graph([lambda: sk.plan_streamk_decode(indptr, bs, cap, cfg.block_n, hp, g,
                                                                                MAX_SPLITS, out=plan)])
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            case["streamk"].append(row)
            if "us" in row:
                print(f"{'':20s} streamK pps {pps!s:3s} tile {cfg.block_n}/{cfg.num_stages}/{cfg.num_warps}: "
                      f"{row['us']:7.1f} us {row['gbs']:7.0f} GB/s ({row['share']:.3f}) x{row['speedup']:.3f} "
                      f"|diff| {row['max_abs_diff_vs_default']:.2e}"
                      + (f" plan {row['plan_us']:.1f} us" if "plan_us" in row else ""), flush=True)
            else:
                print(f"{'':20s} streamK pps {pps} tile {cfg.block_n}/{cfg.num_stages}: {row['error']}", flush=True)
        rows.append(case)
        del q, k, v, logits, lse
        torch.cuda.empty_cache()
    return rows, ceil


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="3 cases, 2 variants")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_streamk_bench needs a CUDA GPU")
    import triton

    rows, ceil = run(args.quick)
    result = {"benchmark": "decode_streamk", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "ceilings": ceil, "rows": rows}
    write_result(result, args.out, "decode-streamk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
