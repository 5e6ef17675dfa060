"""Benchmark of the Triton attention kernels (decode and extend) against PyTorch peers.

``PYTHONPATH=src python benchmarks/kernels.py [--out DIR] [--mla] [--max-kv-splits N] [--sweep]
[--decode-config BN,BH,W,S] [--extend-config BM,BN,W,S]`` measures, in one run on one GPU:

* ceilings: device-to-device copy bandwidth (large ``.copy_``, bytes read + written,
  median) and bf16 matmul TFLOPS (8192^3);
* decode (Hq=32, Hkv=8, D=128, bf16; page 16 and page 1; (bs, kv_len) in (1, 4096),
  (32, 4096), (64, 8192), (128, 2048) and bs 64 with lengths uniform in 128..8192):
  - ``ours``: `compute_num_kv_splits` + `decode_attention_fwd` (the kv-index build,
    `compute_kv_indptr` + `create_kv_indices`, is timed on its own as ``index_us``);
  - ``sdpa``: ``F.scaled_dot_product_attention(..., enable_gqa=True)`` on contiguous,
    unpaged ``[bs, Hkv, L, D]`` KV (the mixed batch is padded to the longest request with a
    boolean key mask, so SDPA reads the padding too);
  - ``gather_sdpa``: gather the paged KV by slot (``index_select``, padded likewise) then
    the same SDPA call; the gather is timed.
  Reported: µs (``triton.testing.do_bench`` median; L2 flushed before every call by
  do_bench and KV sets rotated when they fit in 4x L2), µs under a CUDA graph of many
  calls (``*_graph_us``, launch overhead removed, sets rotated), TB/s counting the real
  tokens' K+V bytes read once, % of the copy ceiling, and peer time / our time.
* extend: causal prefill of 1x8192 and 8x2048 tokens (Hq=32, Hkv=8, D=128, bf16) in
  TFLOPS (causal flops ``2 * 2 * T^2 / 2 * Hq * D`` per request) vs SDPA causal with the
  flash backend on KV pre-expanded to Hq heads (expansion not timed), plus one
  prefix + extend row (chunked prefill, no peer).

Writes ``<out>/<device-slug>-attention-<YYYY-MM-DD>.json`` (default out:
benchmarks/results) and prints a compact table last. ``--mla`` also calls
``kernels_mla.run(results)`` (benchmarks/kernels_mla.py); ``--sweep`` times
candidate tile configs and split policies on the target shapes (``results["sweep"]``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
from typing import List, Optional

from attnserve.bench.results import device_slug
from common import bench_eager, bench_graph, measure_ceilings, try_run

HQ, HKV, HEAD_DIM = 32, 8, 128
DECODE_SHAPES = [(1, 4096), (32, 4096), (64, 8192), (128, 2048), (64, "mixed")]
PREFILL_SHAPES = [(1, 8192), (8, 2048)]
TARGETS = {"decode_tbps": 2.6, "decode_vs_gather": 2.5, "decode_bs1_us": 25.0, "prefill_tflops": 350.0}


# ------------------------------------------------------------------------------- timing
# ------------------------------------------------------------------------------ decode
def _paged_table(lens: List[int], page_size: int, gen, device):
    """req_to_token [bs, max_len] over randomly permuted pages; returns (table, num_slots)."""
    import torch

    pages = [-(-n // page_size) for n in lens]
    num_pages = 1 + sum(pages)
    perm = torch.randperm(num_pages - 1, generator=gen, device="cpu").to(device) + 1
    r2t = torch.zeros(len(lens), max(lens), dtype=torch.int32, device=device)
    off = 0
    for i, n in enumerate(lens):
        t = torch.arange(n, device=device)
        r2t[i, :n] = (perm[off : off + pages[i]][t // page_size] * page_size + t % page_size).to(torch.int32)
        off += pages[i]
    return r2t, num_pages * page_size


def build_decode_case(lens: List[int], page_size: int, max_kv_splits: int, n_sets: int, device="cuda",
                      hq=HQ, hkv=HKV, d=HEAD_DIM, num_sms: Optional[int] = None, seed: int = 0,
                      config=None, split_kwargs: Optional[dict] = None):
    """Everything one decode config needs: paged KV sets, indices, scratch, and callables
    for ours / index build / peers."""
    import torch
    import torch.nn.functional as F

    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention_fwd
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    gen = torch.Generator().manual_seed(seed)  # page permutation (host)
    dgen = torch.Generator(device=device).manual_seed(seed)  # tensor contents (on the device)
    bs, max_len = len(lens), max(lens)
    r2t, slots = _paged_table(lens, page_size, gen, device)
    rows = torch.arange(bs, dtype=torch.int32, device=device)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
    kv_indices = torch.empty(sum(lens), dtype=torch.int32, device=device)

    def build_index():
        compute_kv_indptr(seq, out=kv_indptr)
        create_kv_indices(r2t, rows, seq, kv_indptr, None, kv_indices)

    build_index()
    num_sms = num_sms or torch.cuda.get_device_properties(0).multi_processor_count
    num_kv_splits = torch.empty(bs, dtype=torch.int32, device=device)
    logits = torch.empty(bs, hq, max_kv_splits, d, dtype=torch.float32, device=device)
    lse = torch.empty(bs, hq, max_kv_splits, dtype=torch.float32, device=device)
    uniform = min(lens) == max_len
    # padded slot table for the peers: [bs, max_len], padding points at slot 0 and is masked
    pad_idx = torch.zeros(bs, max_len, dtype=torch.int64, device=device)
    for i, n in enumerate(lens):
        pad_idx[i, :n] = r2t[i, :n]
    pad_idx = pad_idx.reshape(-1)
    key_mask = None
    if not uniform:
        key_mask = (torch.arange(max_len, device=device)[None, :] < seq[:, None])[:, None, None, :]

    sets = []
    for _ in range(n_sets):
        k_buf = (torch.randn(slots, hkv, d, generator=dgen, device=device) * 0.5).to(dtype)
        v_buf = torch.randn(slots, hkv, d, generator=dgen, device=device).to(dtype)
        q = torch.randn(bs, hq, d, generator=dgen, device=device).to(dtype)
        o = torch.empty(bs, hq, d, dtype=dtype, device=device)
        k_contig = k_buf[pad_idx].view(bs, max_len, hkv, d).transpose(1, 2).contiguous()
        v_contig = v_buf[pad_idx].view(bs, max_len, hkv, d).transpose(1, 2).contiguous()
        sets.append(dict(k=k_buf, v=v_buf, q=q, o=o, kc=k_contig, vc=v_contig))

    sm_scale = d ** -0.5

    split_kwargs = split_kwargs or {}

    def ours(s):
        def fn():
            compute_num_kv_splits(seq, num_kv_splits, max_kv_splits, num_sms, hkv, **split_kwargs)
            decode_attention_fwd(s["q"], s["k"], s["v"], s["o"], kv_indptr, kv_indices, logits, lse,
                                 num_kv_splits, max_kv_splits, sm_scale, config=config)
        return fn

    def sdpa(s):
        q4 = s["q"].unsqueeze(2)  # [bs, hq, 1, d]
        return lambda: F.scaled_dot_product_attention(q4, s["kc"], s["vc"], attn_mask=key_mask, scale=sm_scale,
                                                      enable_gqa=True)

    def gather_sdpa(s):
        q4 = s["q"].unsqueeze(2)

        def fn():
            k = s["k"].index_select(0, pad_idx).view(bs, max_len, hkv, d).transpose(1, 2)
            v = s["v"].index_select(0, pad_idx).view(bs, max_len, hkv, d).transpose(1, 2)
            return F.scaled_dot_product_attention(q4, k, v, attn_mask=key_mask, scale=sm_scale, enable_gqa=True)
        return fn

    return dict(
        sets=sets, build_index=build_index, ours=[ours(s) for s in sets], sdpa=[sdpa(s) for s in sets],
        gather_sdpa=[gather_sdpa(s) for s in sets], kv_bytes=2 * sum(lens) * hkv * d * torch.finfo(dtype).bits // 8,
        num_kv_splits=num_kv_splits,
    )


def run_decode(results: dict, max_kv_splits: int, graph: bool, config=None) -> None:
    import torch

    copy = results["ceilings"]["copy_tbps"]
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20)
    rows = results.setdefault("decode", [])
    gen = torch.Generator().manual_seed(1234)
    for page_size in (16, 1):
        for bs, kv in DECODE_SHAPES:
            if kv == "mixed":
                lens = torch.randint(128, 8193, (bs,), generator=gen).tolist()
                label = "mixed128-8192"
            else:
                lens, label = [kv] * bs, str(kv)
            kv_bytes = 2 * sum(lens) * HKV * HEAD_DIM * 2
            n_sets = min(16, max(1, math.ceil(4 * l2 / kv_bytes)))
            case = build_decode_case(lens, page_size, max_kv_splits, n_sets, config=config)
            row = dict(kind="decode", page_size=page_size, bs=bs, kv_len=label, tokens=sum(lens), kv_sets=n_sets,
                       max_kv_splits=max_kv_splits, kv_bytes=case["kv_bytes"])
            row["us"] = bench_eager(case["ours"])
            row["index_us"] = bench_eager([case["build_index"]])
            case["ours"][0]()
            row["splits_mean"] = float(case["num_kv_splits"].float().mean())
            row["tbps"] = case["kv_bytes"] / (row["us"] * 1e-6) / 1e12
            row["pct_copy"] = 100 * row["tbps"] / copy
            for peer in ("sdpa", "gather_sdpa"):
                t, err = try_run(bench_eager, case[peer])
                row[f"{peer}_us"] = t
                row[f"{peer}_tbps"] = case["kv_bytes"] / (t * 1e-6) / 1e12 if t else None
                row[f"vs_{peer}"] = t / row["us"] if t else None
                if err:
                    row[f"{peer}_error"] = err
            if graph:
                for name in ("ours", "sdpa", "gather_sdpa"):
                    t, err = try_run(bench_graph, case[name])
                    row[f"{name}_graph_us"] = t
                    if err:
                        row[f"{name}_graph_error"] = err
                if row.get("ours_graph_us"):
                    row["graph_tbps"] = case["kv_bytes"] / (row["ours_graph_us"] * 1e-6) / 1e12
            rows.append(row)
            print(f"decode page={page_size} bs={bs} kv={label}: {row['us']:.1f} us {row['tbps']:.2f} TB/s "
                  f"(sdpa {row['sdpa_us'] or float('nan'):.1f} us, gather+sdpa {row['gather_sdpa_us'] or float('nan'):.1f} us)",
                  flush=True)
            del case
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ extend
def build_extend_case(lens: List[int], prefix: int = 0, device="cuda", hq=HQ, hkv=HKV, d=HEAD_DIM, seed=0,
                      config=None):
    import torch
    import torch.nn.functional as F

    from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    bs, t = len(lens), sum(lens)
    q = torch.randn(t, hq, d, generator=dgen, device=device).to(dtype)
    k = (torch.randn(t, hkv, d, generator=dgen, device=device) * 0.5).to(dtype)
    v = torch.randn(t, hkv, d, generator=dgen, device=device).to(dtype)
    o = torch.empty(t, hq, d, dtype=dtype, device=device)
    qo_indptr = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    slots = max(prefix * bs, 1) + 16
    k_buf = (torch.randn(slots, hkv, d, generator=dgen, device=device) * 0.5).to(dtype)
    v_buf = torch.randn(slots, hkv, d, generator=dgen, device=device).to(dtype)
    kv_indptr = torch.arange(bs + 1, device=device, dtype=torch.int32) * prefix
    kv_indices = (torch.randperm(slots - 16, generator=gen)[: prefix * bs] + 16).to(torch.int32).to(device)
    if kv_indices.numel() == 0:
        kv_indices = torch.zeros(1, dtype=torch.int32, device=device)
    sm_scale = d ** -0.5

    def ours():
        extend_attention_fwd(q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None, True, None,
                             max(lens), sm_scale, config=config, has_prefix=prefix > 0)  # as the backend passes

    peer = None
    if prefix == 0 and len(set(lens)) == 1:
        n = lens[0]
        q4 = q.view(bs, n, hq, d).transpose(1, 2).contiguous()
        k4 = k.view(bs, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1).contiguous()
        v4 = v.view(bs, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1).contiguous()

        def peer():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=sm_scale)

    flops = sum(2 * 2 * n * n / 2 * hq * d + 2 * 2 * n * prefix * hq * d for n in lens)
    return dict(ours=ours, peer=peer, flops=flops)


def run_extend(results: dict, config=None) -> None:
    import torch

    mm = results["ceilings"]["matmul_bf16_tflops"]
    rows = results.setdefault("extend", [])
    shapes = [(bs, n, 0) for bs, n in PREFILL_SHAPES] + [(1, 4096, 4096)]
    for bs, n, prefix in shapes:
        case = build_extend_case([n] * bs, prefix=prefix, config=config)
        row = dict(kind="extend_causal", bs=bs, extend_len=n, prefix_len=prefix, flops=case["flops"])
        row["us"] = bench_eager([case["ours"]])
        row["tflops"] = case["flops"] / (row["us"] * 1e-6) / 1e12
        row["pct_matmul"] = 100 * row["tflops"] / mm
        if case["peer"] is not None:
            t, err = try_run(bench_eager, [case["peer"]])
            row["sdpa_flash_us"] = t
            row["sdpa_flash_tflops"] = case["flops"] / (t * 1e-6) / 1e12 if t else None
            row["vs_sdpa_flash"] = t / row["us"] if t else None
            if err:
                row["sdpa_flash_error"] = err
        rows.append(row)
        print(f"extend bs={bs} len={n} prefix={prefix}: {row['us']:.1f} us {row['tflops']:.0f} TFLOPS", flush=True)
        del case
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- sweep
DECODE_SWEEP = [(64, 16, 4, 2), (64, 16, 4, 3), (32, 16, 4, 2), (32, 16, 4, 3), (128, 16, 8, 2), (128, 16, 4, 2),
                (64, 16, 8, 2), (64, 16, 4, 1)]
SPLIT_SWEEP = [dict(waves=w, min_split_tokens=m) for w in (2, 4, 8) for m in (64, 128, 256)]
EXTEND_SWEEP = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 8, 3),
                (64, 64, 4, 3), (64, 128, 4, 2)]


def run_sweep(results: dict, max_kv_splits: int) -> None:
    """Time candidate configs on the target shapes so `decode_config`, the split policy and
    `extend_config` can be tuned from one run (rows in ``results["sweep"]``)."""
    import torch

    from attnserve.attention.triton_ops.decode_attention import DecodeConfig
    from attnserve.attention.triton_ops.extend_attention import ExtendConfig

    rows = results.setdefault("sweep", [])
    for bs, kv in ((32, 4096), (128, 2048)):
        for bn, bh, w, st in DECODE_SWEEP:
            cfg = DecodeConfig(block_n=bn, block_h=bh, num_warps=w, num_stages=st)
            case = build_decode_case([kv] * bs, 16, max_kv_splits, 1, config=cfg)
            t, err = try_run(bench_eager, case["ours"])
            rows.append(dict(kind="decode_config", bs=bs, kv_len=kv, config=list((bn, bh, w, st)), us=t, error=err,
                             tbps=case["kv_bytes"] / (t * 1e-6) / 1e12 if t else None))
            print("sweep", rows[-1], flush=True)
            del case
    gen = torch.Generator().manual_seed(1234)
    mixed = torch.randint(128, 8193, (64,), generator=gen).tolist()
    for lens, label in (([4096], "1x4096"), (mixed, "64xmixed"), ([4096] * 8, "8x4096")):
        for mks in sorted({max_kv_splits, 32}):
            for kw in SPLIT_SWEEP:
                case = build_decode_case(lens, 16, mks, 4 if len(lens) == 1 else 1, split_kwargs=kw)
                t, err = try_run(bench_eager, case["ours"])
                rows.append(dict(kind="split_policy", shape=label, max_kv_splits=mks, **kw, us=t, error=err,
                                 tbps=case["kv_bytes"] / (t * 1e-6) / 1e12 if t else None))
                print("sweep", rows[-1], flush=True)
                del case
    for bm, bn, w, st in EXTEND_SWEEP:
        case = build_extend_case([8192], config=ExtendConfig(bm, bn, w, st))
        t, err = try_run(bench_eager, [case["ours"]])
        rows.append(dict(kind="extend_config", shape="1x8192", config=[bm, bn, w, st], us=t, error=err,
                         tflops=case["flops"] / (t * 1e-6) / 1e12 if t else None))
        print("sweep", rows[-1], flush=True)
        del case
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ report
def _checks(results: dict) -> List[dict]:
    out = []
    for r in results.get("decode", []):
        if r["kv_len"] != "mixed128-8192" and r["bs"] >= 32 and int(r["kv_len"]) >= 2048:
            out.append(dict(what=f"decode page{r['page_size']} bs{r['bs']} kv{r['kv_len']} TB/s",
                            value=r["tbps"], target=f">= {TARGETS['decode_tbps']}", ok=r["tbps"] >= TARGETS["decode_tbps"]))
            g = r.get("vs_gather_sdpa")
            out.append(dict(what=f"decode page{r['page_size']} bs{r['bs']} kv{r['kv_len']} vs gather+SDPA",
                            value=g, target=f">= {TARGETS['decode_vs_gather']}x",
                            ok=bool(g and g >= TARGETS["decode_vs_gather"])))
        if r["bs"] == 1 and r["kv_len"] == "4096":
            out.append(dict(what=f"decode page{r['page_size']} bs1 kv4096 us", value=r["us"],
                            target=f"<= {TARGETS['decode_bs1_us']}", ok=r["us"] <= TARGETS["decode_bs1_us"]))
    for r in results.get("extend", []):
        if r["bs"] == 1 and r["extend_len"] == 8192 and r["prefix_len"] == 0:
            out.append(dict(what="causal prefill 1x8192 TFLOPS", value=r["tflops"],
                            target=f">= {TARGETS['prefill_tflops']}", ok=r["tflops"] >= TARGETS["prefill_tflops"]))
    return out


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def print_table(results: dict) -> None:
    c = results["ceilings"]
    print(f"\n{results['device']}  torch {results['versions']['torch']}  triton {results['versions']['triton']}  "
          f"CUDA {results['versions']['cuda']}")
    print(f"ceilings: copy {c['copy_tbps']:.2f} TB/s, bf16 matmul {c['matmul_bf16_tflops']:.0f} TFLOPS")
    print(f"{'decode':<8}{'page':>5}{'bs':>5}{'kv_len':>15}{'us':>9}{'graph':>9}{'idx_us':>8}{'TB/s':>7}{'%copy':>7}"
          f"{'sdpa':>9}{'x':>6}{'gath+sdpa':>10}{'x':>6}")
    for r in results.get("decode", []):
        print(f"{'':<8}{r['page_size']:>5}{r['bs']:>5}{r['kv_len']:>15}{r['us']:>9.1f}{_fmt(r.get('ours_graph_us')):>9}"
              f"{r['index_us']:>8.1f}{r['tbps']:>7.2f}{r['pct_copy']:>7.1f}{_fmt(r['sdpa_us']):>9}"
              f"{_fmt(r['vs_sdpa'], '.2f'):>6}{_fmt(r['gather_sdpa_us']):>10}{_fmt(r['vs_gather_sdpa'], '.2f'):>6}")
    print(f"{'extend':<8}{'bs':>5}{'len':>7}{'prefix':>8}{'us':>10}{'TFLOPS':>8}{'%mm':>6}{'flash us':>10}{'TFLOPS':>8}{'x':>6}")
    for r in results.get("extend", []):
        print(f"{'':<8}{r['bs']:>5}{r['extend_len']:>7}{r['prefix_len']:>8}{r['us']:>10.1f}{r['tflops']:>8.0f}"
              f"{r['pct_matmul']:>6.1f}{_fmt(r.get('sdpa_flash_us')):>10}{_fmt(r.get('sdpa_flash_tflops'), '.0f'):>8}"
              f"{_fmt(r.get('vs_sdpa_flash'), '.2f'):>6}")
    for ch in results.get("checks", []):
        print(f"  [{'ok' if ch['ok'] else 'MISS'}] {ch['what']}: {_fmt(ch['value'], '.2f')} (target {ch['target']})")


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory of the JSON result")
    ap.add_argument("--mla", action="store_true", help="also run benchmarks/kernels_mla.py")
    ap.add_argument("--max-kv-splits", type=int, default=16, help="decode split capacity (scratch size)")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--sweep", action="store_true", help="also time candidate tile configs / split policies")
    ap.add_argument("--decode-config", help="override decode_config: BLOCK_N,BLOCK_H,WARPS,STAGES")
    ap.add_argument("--extend-config", help="override extend_config: BLOCK_M,BLOCK_N,WARPS,STAGES")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-extend", action="store_true")
    args = ap.parse_args(argv)

    import torch
    import triton

    from attnserve.attention.triton_ops.decode_attention import DecodeConfig, decode_config
    from attnserve.attention.triton_ops.extend_attention import ExtendConfig, extend_config

    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA GPU")
    dcfg = DecodeConfig(*map(int, args.decode_config.split(","))) if args.decode_config else None
    ecfg = ExtendConfig(*map(int, args.extend_config.split(","))) if args.extend_config else None
    name = torch.cuda.get_device_name(0)
    results: dict = dict(
        date=_dt.date.today().isoformat(),
        device=name,
        capability=".".join(map(str, torch.cuda.get_device_capability(0))),
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
        versions=dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda),
        config=dict(hq=HQ, hkv=HKV, head_dim=HEAD_DIM, dtype="bfloat16", max_kv_splits=args.max_kv_splits,
                    decode_config=vars(dcfg or decode_config(HEAD_DIM, HQ // HKV, torch.bfloat16)),
                    extend_config=vars(ecfg or extend_config(HEAD_DIM, HEAD_DIM, torch.bfloat16))),
    )
    results["ceilings"] = measure_ceilings()
    results["copy_tbps"] = results["ceilings"]["copy_tbps"]  # read by kernels_mla.run
    print(f"ceilings: {results['ceilings']}", flush=True)
    if not args.skip_decode:
        run_decode(results, args.max_kv_splits, graph=not args.no_graph, config=dcfg)
    if not args.skip_extend:
        run_extend(results, config=ecfg)
    if args.sweep:
        run_sweep(results, args.max_kv_splits)
    if args.mla:
        import kernels_mla

        kernels_mla.run(results)
    results["checks"] = _checks(results)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{device_slug('cuda')}-attention-{results['date']}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")
    print_table(results)
    return results


if __name__ == "__main__":
    main()
