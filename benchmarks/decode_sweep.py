"""Small-batch decode attention tuning: stage-1 tiles and split size.

``PYTHONPATH=src python benchmarks/decode_sweep.py [--out DIR]``

At batch 1 and short contexts the decode kernel is latency-bound (a few µs per layer), so
its launch shape matters more than bandwidth. For the attention shapes of SmolLM2-135M
(9 q heads, 3 KV heads, d 64) and Llama-3-8B (32/8, d 128), bs 1/8 and contexts 512/4096,
this times `decode_attention_fwd` inside a CUDA graph (launch overhead removed, as in a
decode step) for each combination of block_n, num_stages, the minimum split length of
`compute_num_kv_splits`; every result is checked against the default configuration's output.
Writes ``<out>/<device>-decode-sweep-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools

import torch

from attnserve.bench.results import write_result
from common import bench_graph

SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def _case(hq: int, hkv: int, d: int, bs: int, ctx: int, gen: torch.Generator):
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr

    slots = bs * ctx + 1
    k = torch.randn(slots, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(slots, hkv, d, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(bs, hq, d, generator=gen).to("cuda", torch.bfloat16)
    lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    indptr = compute_kv_indptr(lens)
    indices = (torch.randperm(slots - 1, generator=gen)[: bs * ctx] + 1).to("cuda", torch.int32)
    return q, k, v, lens, indptr, indices


def sweep(max_kv_splits: int = 32) -> list:
    from attnserve.attention.triton_ops.decode_attention import (
        DecodeConfig,
        compute_num_kv_splits,
        decode_config,
        decode_attention_fwd,
    )

    props = torch.cuda.get_device_properties(0)
    sms, smem = props.multi_processor_count, props.shared_memory_per_block_optin
    gen = torch.Generator().manual_seed(0)
    rows = []
    for (name, (hq, hkv, d)), bs, ctx in itertools.product(SHAPES.items(), (1, 8), (512, 4096)):
        q, k, v, lens, indptr, indices = _case(hq, hkv, d, bs, ctx, gen)
        logits = torch.empty(bs, hq, max_kv_splits, d, device="cuda")
        lse = torch.empty(bs, hq, max_kv_splits, device="cuda")
        base = decode_config(d, hq // hkv, torch.bfloat16, max_shared_mem=smem)
        ref = None
        for block_n, stages, min_split in itertools.product((32, 64, 128), (1, 2, 3), (32, 64, 128, 256)):
            cfg = DecodeConfig(block_n=block_n, block_h=base.block_h, num_warps=base.num_warps, num_stages=stages)
            splits = torch.empty(bs, dtype=torch.int32, device="cuda")
            compute_num_kv_splits(lens, splits, max_kv_splits, sms, hkv, min_split_tokens=min_split)
            o = torch.empty(bs, hq, d, device="cuda", dtype=torch.bfloat16)

            def call():
                decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, max_kv_splits, d ** -0.5,
                                     config=cfg)

            row = {"shape": name, "bs": bs, "context": ctx, "block_n": block_n, "num_stages": stages,
                   "min_split_tokens": min_split, "num_kv_splits": int(splits[0])}
            try:
                call()
                torch.cuda.synchronize()
                if ref is None:
                    ref = o.float().clone()
                row["max_abs_err_vs_first"] = float((o.float() - ref).abs().max())
                row["graph_us"] = bench_graph([call])
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
        best = min((r for r in rows if r["shape"] == name and r["bs"] == bs and r["context"] == ctx
                    and "graph_us" in r), key=lambda r: r["graph_us"])
        default = next(r for r in rows if r["shape"] == name and r["bs"] == bs and r["context"] == ctx
                       and r["block_n"] == base.block_n and r["num_stages"] == base.num_stages
                       and r["min_split_tokens"] == 128 and "graph_us" in r)
        print(f"{name:10s} bs={bs} ctx={ctx}: default {default['graph_us']:.2f} us; best {best['graph_us']:.2f} us "
              f"(block_n {best['block_n']}, stages {best['num_stages']}, min_split {best['min_split_tokens']}, "
              f"splits {best['num_kv_splits']})", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_sweep needs a CUDA GPU")
    import triton

    rows = sweep()
    errs = [r["max_abs_err_vs_first"] for r in rows if "max_abs_err_vs_first" in r]
    result = {"benchmark": "decode_sweep", "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
              "max_abs_err_any_config": max(errs) if errs else None, "rows": rows}
    write_result(result, args.out, "decode-sweep")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
