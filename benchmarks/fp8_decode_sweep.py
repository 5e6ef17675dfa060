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
from kernel_timings import gqa_decode  # noqa: E402

from attnserve.bench.results import device_slug, write_result  # noqa: E402

#: (block_n, num_stages, num_warps, v_pairs) timed by --pairs-ab
PAIR_CONFIGS = [(128, 5, 4, False), (128, 5, 4, True), (256, 3, 4, True), (256, 5, 4, True), (512, 3, 8, True),
                (512, 3, 4, True), (128, 7, 4, True), (64, 6, 4, True), (64, 8, 4, True)]
CONFIGS = [(128, 3, 4), (128, 4, 4), (128, 5, 4), (256, 2, 4), (256, 3, 4), (256, 3, 8), (64, 4, 4), (64, 6, 4)]


def case(bs, ctx, kv_dtype, config=None, split_cap=32):
    return gqa_decode(bs, ctx, kv_dtype=kv_dtype, config=config, split_cap=split_cap)


def _config_row(bs, ctx, kv_dtype, kv_label, print_label, config_name, cfg, base_us) -> dict:
    """One timed configuration as a result row (``error`` instead of timings when it cannot
    launch, e.g. out of shared memory), printed with its speed-up over ``base_us``."""
    try:
        r = case(bs, ctx, kv_dtype, cfg)
    except Exception as e:  # noqa: BLE001 - out of resources: record and go on
        r = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    if "us" in r:
        print(f"bs {bs} ctx {ctx} {print_label} {r['us']:.1f} us {r['tbps']:.2f} TB/s "
              f"x{base_us / r['us']:.2f} err {r.get('rel_err', 0.0):.1e}", flush=True)
    else:
        print(f"bs {bs} ctx {ctx} {print_label} {r['error']}", flush=True)
    return dict(bs=bs, ctx=ctx, kv=kv_label, config=config_name, **r)


def main(argv=None) -> int:
    from attnserve.attention.triton_ops.decode_attention import DecodeConfig

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--split-caps", type=int, nargs="*", default=[],
                    help="instead of the configurations: the default config with these split caps")
    ap.add_argument("--pairs-ab", action="store_true",
                    help="instead of the configurations: fp8 V read as int16 pairs (default) vs the byte path")
    args = ap.parse_args(argv)
    rows = []
    if args.pairs_ab:  # fp8 V as int16 column pairs (DecodeConfig.v_pairs) against the byte path
        import triton

        for bs, ctx in ((64, 8192), (8, 32768), (1, 8192)):
            base = case(bs, ctx, torch.bfloat16)
            rows.append(dict(bs=bs, ctx=ctx, kv="bf16", config="default", **base))
            print(f"bs {bs} ctx {ctx} bf16 default {base['us']:.1f} us {base['tbps']:.2f} TB/s", flush=True)
            for kv in (torch.float8_e4m3fn, torch.float8_e5m2):
                for conf in [None] + PAIR_CONFIGS:
                    cfg = None if conf is None else DecodeConfig(block_n=conf[0], block_h=16, num_warps=conf[2],
                                                                 num_stages=conf[1], v_pairs=conf[3])
                    name = "default" if conf is None else "/".join(map(str, conf[:3])) + ("/pairs" if conf[3] else "/bytes")
                    rows.append(_config_row(bs, ctx, kv, str(kv), f"{kv} {name}", name, cfg, base["us"]))
                torch.cuda.empty_cache()
        write_result({"benchmark": "fp8-decode-pairs", "date": dt.date.today().isoformat(),
                      "device": device_slug("cuda"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "rows": rows}, args.out, "fp8-decode-pairs", "cuda")
        return 0
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
            name = "default" if cfg is None else "/".join(map(str, conf))
            rows.append(_config_row(bs, ctx, torch.float8_e4m3fn, "fp8_e4m3", f"e4m3 {name:9s}", name, cfg,
                                    base["us"]))
            torch.cuda.empty_cache()
    import triton

    write_result({"benchmark": "fp8-decode-sweep", "date": dt.date.today().isoformat(), "device": device_slug("cuda"),
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "rows": rows}, args.out, "fp8-decode-sweep", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
