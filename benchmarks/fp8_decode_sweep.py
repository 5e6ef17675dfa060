"""Stage-1 launch configurations of the paged decode kernel over an FP8 cache.

``PYTHONPATH=src python benchmarks/fp8_decode_sweep.py`` times `decode_attention_fwd`
(Hq 32, Hkv 8, D 128, page 16, bf16 queries, e4m3 cache) inside CUDA graphs for each
``(block_n, num_stages, num_warps)`` at bs 64 x 8K, 8 x 32K and 1 x 8K, next to the bf16
cache with its default configuration. An fp8 tile is half the bytes of a bf16 one, so the
default (tuned for bf16: 128 keys, 3 stages) keeps half as many bytes in flight. Writes
``<out>/<device>-fp8-decode-sweep-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_timings import graph_us  # noqa: E402

from attnserve.bench.results import device_slug, write_result  # noqa: E402

CONFIGS = [(128, 3, 4), (128, 4, 4), (128, 5, 4), (256, 2, 4), (256, 3, 4), (256, 3, 8), (64, 4, 4), (64, 6, 4)]


def case(bs, ctx, kv_dtype, config=None, page=16, hq=32, hkv=8, d=128, split_cap=32):
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
    cap = 32
    splits = torch.empty(bs, dtype=torch.int32, device="cuda")
    compute_num_kv_splits(lens, splits, split_cap, torch.cuda.get_device_properties(0).multi_processor_count, hkv)
    q = torch.randn(bs, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    o = torch.empty_like(q)
    logits = torch.empty(bs, hq, cap, d, device="cuda")
    lse = torch.empty(bs, hq, cap, device="cuda")
    ref = torch.empty_like(q)
    decode_attention_fwd(q, kb, vb, ref, indptr, idx, logits, lse, splits, cap, d ** -0.5)
    us = graph_us(lambda: decode_attention_fwd(q, kb, vb, o, indptr, idx, logits, lse, splits, cap, d ** -0.5,
                                               config=config))
    err = float((o.float() - ref.float()).norm() / ref.float().norm())  # same math as the default config
    return dict(us=us, tbps=2 * bs * ctx * hkv * d * kb.element_size() / (us * 1e-6) / 1e12, rel_err=err)


def main(argv=None) -> int:
    from attnserve.attention.triton_ops.decode_attention import DecodeConfig

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--split-caps", type=int, nargs="*", default=[],
                    help="instead of the configurations: the default config with these split caps")
    args = ap.parse_args(argv)
    rows = []
    if args.split_caps:
        for bs, ctx in ((64, 8192), (8, 32768), (1, 8192), (1, 32768)):
            for kv in (torch.bfloat16, torch.float8_e4m3fn):
                for c in args.split_caps:
                    r = case(bs, ctx, kv, split_cap=c)
                    rows.append(dict(bs=bs, ctx=ctx, kv=str(kv), split_cap=c, **r))
                    print(f"bs {bs} ctx {ctx} {kv} cap {c}: {r['us']:.1f} us {r['tbps']:.2f} TB/s", flush=True)
        write_result({"benchmark": "fp8-decode-splits", "date": dt.date.today().isoformat(),
                      "device": device_slug("cuda"), "gpu": torch.cuda.get_device_name(), "rows": rows},
                     args.out, "fp8-decode-splits", "cuda")
        return 0
    for bs, ctx in ((64, 8192), (8, 32768), (1, 8192)):
        base = case(bs, ctx, torch.bfloat16)
        rows.append(dict(bs=bs, ctx=ctx, kv="bf16", config="default", **base))
        print(f"bs {bs} ctx {ctx} bf16 default {base['us']:.1f} us {base['tbps']:.2f} TB/s", flush=True)
        for conf in [None] + CONFIGS:
            cfg = None if conf is None else DecodeConfig(block_n=conf[0], block_h=16, num_warps=conf[2],
                                                         num_stages=conf[1])
            try:
                r = case(bs, ctx, torch.float8_e4m3fn, cfg)
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.: record and go on
                r = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            name = "default" if cfg is None else "/".join(map(str, conf))
            rows.append(dict(bs=bs, ctx=ctx, kv="fp8_e4m3", config=name, **r))
            if "us" in r:
                print(f"bs {bs} ctx {ctx} e4m3 {name:9s} {r['us']:.1f} us {r['tbps']:.2f} TB/s "
                      f"x{base['us'] / r['us']:.2f} err {r['rel_err']:.1e}", flush=True)
            else:
                print(f"bs {bs} ctx {ctx} e4m3 {name:9s} {r['error']}", flush=True)
            torch.cuda.empty_cache()
    import triton

    write_result({"benchmark": "fp8-decode-sweep", "date": dt.date.today().isoformat(), "device": device_slug("cuda"),
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "rows": rows}, args.out, "fp8-decode-sweep", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
