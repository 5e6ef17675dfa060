"""MLA decode over an fp8 latent cache: launch configurations of the Triton pairs path
(`MLADecodeConfig.kv_pairs`) against the fp8 seesaw kernel and the bf16 cache's default,
in one run.

``PYTHONPATH=src python benchmarks/mla_fp8_pairs_sweep.py [--shapes NAME ...] [--out DIR]``

For each shape (kv_lora_rank 512 + rope 64, page 64, bf16 queries, random cache values cast
to the format, kv_scale 1; split counts from `mla_num_kv_splits` as the backend computes
them; CUDA graphs of 20 calls, median of 15 replays, `kernel_timings.graph_us`): the bf16
cache with its default config, the e4m3 cache through the fp8 seesaw kernel and through
the pairs path with each ``(block_h, block_n, num_warps, num_stages)``, each pairs row
with its relative error against the seesaw kernel's output on the same inputs; then the
e5m2 cache through the seesaw kernel and the best e4m3 pairs configuration (e5m2 takes a
byte move where e4m3 takes a ``cvt``: the conversion's share of the time; `E5M2_SHAPES`). Writes
``<out>/<device>-mla-fp8-pairs-sweep-<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_timings import graph_us, mla_inputs  # noqa: E402

from attnserve.bench.results import cuda_run_metadata, write_result  # noqa: E402

#: name -> (bs, ctx, heads, pairs configs (block_h, block_n, num_warps, num_stages)); the
#: e5m2 rows run for the shapes in E5M2_SHAPES only
E5M2_SHAPES = ("h16_bs128_4k",)
SHAPES = {
    "h16_bs128_4k": (128, 4096, 16, [(16, 32, 4, 1), (16, 32, 8, 1), (16, 64, 4, 1), (16, 64, 8, 1), (16, 64, 8, 2),
                                     (16, 64, 16, 1), (16, 128, 8, 1), (16, 128, 16, 1)]),
    "h16_bs32_16k": (32, 16384, 16, [(16, 64, 8, 1), (16, 128, 8, 1), (16, 32, 8, 1)]),
    "h32_bs64_8k": (64, 8192, 32, [(16, 64, 8, 1), (32, 64, 8, 1)]),
    "h64_bs64_8k": (64, 8192, 64, [(16, 64, 8, 1), (32, 64, 8, 1)]),
    "h128_bs32_16k": (32, 16384, 128, [(16, 64, 8, 1), (32, 32, 8, 1), (32, 64, 8, 1), (16, 128, 8, 1)]),
}
SEESAW = dict(block_h=64, block_n=64, num_warps=8, num_stages=2, kv_load="tma", stage1="seesaw")


def make_inputs(bs: int, ctx: int, heads: int, kv_dtype: torch.dtype, page: int = 64) -> dict:
    """`kernel_timings.mla_inputs` (the inputs `kernel_timings.mla_decode` times) with the
    page size and the cache bytes one call reads."""
    inp = mla_inputs(bs, ctx, heads, page, kv_dtype)
    return dict(inp, page=page, bytes=bs * ctx * 576 * inp["kv"].element_size())


def time_config(inp: dict, cfg, ref=None) -> dict:
    """us / TB/s / stage-1 kind of one config (None: the default); ``rel_err`` vs ``ref``."""
    from attnserve.attention.triton_ops.mla_decode import mla_decode_fwd, mla_stage1_kernel

    o = torch.empty_like(inp["q_nope"])  # each config its own output (the reference is kept)
    kw = {} if inp["kv"].dtype == torch.bfloat16 else dict(kv_scale=1.0)

    def call():
        mla_decode_fwd(inp["q_nope"], inp["q_pe"], inp["kv"], inp["table"], inp["lens"], inp["page"], o, 192 ** -0.5,
                       inp["splits"], inp["splits"], workspace=inp["ws"], config=cfg, **kw)

    try:
        us = graph_us(call)
    except Exception as e:  # noqa: BLE001 - out of resources: record and go on
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    row = dict(us=us, tbps=inp["bytes"] / (us * 1e-6) / 1e12, splits=inp["splits"],
               stage1=mla_stage1_kernel(inp["q_nope"], inp["q_pe"], inp["kv"], inp["page"], cfg), out=o)
    if ref is not None:
        row["rel_err"] = float((o.float() - ref.float()).norm() / ref.float().norm())
    return row


def _show(shape: str, label: str, row: dict, base_us: float) -> dict:
    row = {k: v for k, v in row.items() if k != "out"}
    if "us" in row:
        print(f"{shape} {label}: {row['us']:.1f} us {row['tbps']:.2f} TB/s x{base_us / row['us']:.2f} vs bf16 "
              f"[{row['stage1']}] err {row.get('rel_err', 0.0):.1e}", flush=True)
    else:
        print(f"{shape} {label}: {row['error']}", flush=True)
    return dict(config=label, **row)


def main(argv=None) -> int:
    from attnserve.attention.triton_ops.mla_decode import MLADecodeConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = {"shapes": {}}
    seesaw = MLADecodeConfig(**SEESAW)
    for shape in args.shapes:
        bs, ctx, heads, configs = SHAPES[shape]
        rows = []
        inp = make_inputs(bs, ctx, heads, torch.bfloat16)
        base = time_config(inp, None)
        base_us = base["us"]
        rows.append(_show(shape, "bf16 default", base, base_us))
        del inp
        best = None
        fmts = (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2))[: 2 if shape in E5M2_SHAPES else 1]
        for fmt, kv_dtype in fmts:
            inp = make_inputs(bs, ctx, heads, kv_dtype)
            ref = time_config(inp, seesaw)
            rows.append(dict(_show(shape, f"{fmt} seesaw_fp8", ref, base_us), kv=fmt))
            todo = configs if fmt == "e4m3" else [best] if best else []
            for bh, bn, nw, ns in todo:
                cfg = MLADecodeConfig(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns, kv_pairs=True)
                r = time_config(inp, cfg, ref.get("out"))
                rows.append(dict(_show(shape, f"{fmt} pairs {bh}/{bn}/{nw}/{ns}", r, base_us), kv=fmt))
                if fmt == "e4m3" and "us" in r and (best is None or r["us"] < best_us):
                    best, best_us = (bh, bn, nw, ns), r["us"]
            del inp, ref
            torch.cuda.empty_cache()
        res["shapes"][shape] = dict(bs=bs, ctx=ctx, heads=heads, page=64, rows=rows, best_e4m3_pairs=best)
    res.update(cuda_run_metadata("mla-fp8-pairs-sweep", t0))
    write_result(res, args.out, "mla-fp8-pairs-sweep", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
