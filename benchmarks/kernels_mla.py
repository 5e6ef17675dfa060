"""Benchmark of the Triton MLA decode kernel (`attention/triton_ops/mla_decode.py`).

``PYTHONPATH=src python benchmarks/kernels_mla.py --out DIR`` writes ``DIR/<device-slug>-mla-<date>.json``
with the date, device, torch/triton/CUDA versions, the device-to-device copy bandwidth
measured in the same run, and one row per config:

* ms (triton.testing.do_bench median of a CUDA-graph replay of the two launches, as
  decode runs; ``eager_ms`` without the graph, Python launch overhead included), TB/s counting the latent bytes once
  (``bs * kv_len * 576 * 2``), % of the copy bandwidth, achieved TFLOPS
  (``bs * H * kv_len * 2 * (576 + 512)``);
* the peer measured in the same run: the same math in PyTorch (gather the latent rows,
  bf16 ``q @ latent^T``, fp32 softmax, bf16 ``p @ c_kv``);
* for batch 32 the CUTLASS MLA reference time on H100 (from the task brief) beside ours;
* ``stage1_kernel``: the stage-1 kernel that ran (`mla_stage1_kernel`: seesaw, gluon, tma or
  triton; a Gluon config falls back to the Triton kernel off sm_90).

``--sweep`` (on by default) also times every candidate tile config on two key shapes so
`mla_decode_config` can be tuned from one run. `run(results)` appends to ``results["mla"]``
(and ``results["mla_sweep"]``). Needs a CUDA GPU; all imports of GPU-only code are lazy.
The copy bandwidth is `common.copy_bandwidth_gbs` (this directory's shared helpers).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from typing import Dict, List

from common import copy_bandwidth_gbs

from attnserve.bench.results import device_slug

D_C, D_R = 512, 64
LATENT = D_C + D_R

# CUTLASS MLA on H100, batch 32, 128 heads, page 128 (reference table given with the task)
CUTLASS_REF_MS = {1024: 0.52, 4096: 1.83, 16384: 7.21, 65536: 28.92}

# (block_h, block_n, num_warps, num_stages) tried by the sweep
SWEEP_CANDIDATES = {
    128: [(64, 64, 8, 2), (64, 64, 8, 1), (64, 32, 8, 2), (64, 32, 8, 3), (64, 32, 8, 1),
          (32, 32, 4, 2), (16, 32, 4, 2), (16, 64, 4, 2)],
    16: [(16, 64, 4, 2), (16, 64, 4, 1), (16, 32, 4, 2), (16, 32, 4, 3), (16, 64, 8, 2), (16, 128, 8, 2)],
}


def standard_configs() -> List[Dict]:
    rows = [dict(bs=32, kv_len=n, heads=128, page=128) for n in (1024, 4096, 16384, 65536)]
    rows.append(dict(bs=32, kv_len=4096, heads=128, page=64))
    rows += [dict(bs=b, kv_len=4096, heads=128, page=128) for b in (1, 2, 4, 8, 16, 64)]  # 32 is above
    rows.append(dict(bs=128, kv_len=4096, heads=16, page=128))
    return rows


def make_inputs(bs: int, kv_len: int, heads: int, page: int, seed: int = 0):
    """Random bf16 latent cache in shuffled pages (page 0 reserved) and its block table."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-kv_len // page)
    num_pages = 1 + bs * blocks
    kv = torch.randn(num_pages * page, 1, LATENT, device="cuda", generator=g, dtype=torch.bfloat16)
    perm = torch.randperm(num_pages - 1, device="cuda", generator=g).to(torch.int32) + 1
    table = torch.full((bs, blocks + 1), -1, dtype=torch.int32, device="cuda")
    table[:, :blocks] = perm.view(bs, blocks)
    q_nope = torch.randn(bs, heads, D_C, device="cuda", generator=g, dtype=torch.bfloat16)
    q_pe = torch.randn(bs, heads, D_R, device="cuda", generator=g, dtype=torch.bfloat16)
    seq_lens = torch.full((bs,), kv_len, dtype=torch.int32, device="cuda")
    return q_nope, q_pe, kv, table, seq_lens


def time_one(bs, kv_len, heads, page, copy_tbps, *, config=None, peer=True, sm_count=None) -> Dict:
    """One row (see the module note); the inputs are freed and the CUDA cache emptied after it."""
    import torch

    row = _measure(bs, kv_len, heads, page, copy_tbps, config=config, peer=peer, sm_count=sm_count)
    torch.cuda.empty_cache()  # _measure's tensors, graph and closures died with its frame
    return row


def _measure(bs, kv_len, heads, page, copy_tbps, *, config, peer, sm_count) -> Dict:
    import torch
    import triton.testing

    from attnserve.attention.triton_ops import mla_decode as mla

    sm_count = sm_count or torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    q_nope, q_pe, kv, table, seq_lens = make_inputs(bs, kv_len, heads, page)
    sm_scale = 1.0 / (192 ** 0.5)
    splits = mla.mla_num_kv_splits(kv_len, bs, mla.mla_split_sm_count(sm_count, heads))
    ws = torch.empty(mla.mla_workspace_size(kv_len, bs, splits, heads, D_C), dtype=torch.uint8, device="cuda")
    o = torch.empty(bs, heads, D_C, dtype=torch.bfloat16, device="cuda")
    cfg = config or mla.mla_decode_config(heads, D_C, D_R, torch.bfloat16)

    def kernel():
        mla.mla_decode_fwd(q_nope, q_pe, kv, table, seq_lens, page, o, sm_scale, splits, splits, workspace=ws,
                           config=cfg)

    kernel()
    torch.cuda.synchronize()
    eager_ms = triton.testing.do_bench(kernel, return_mode="median")
    # decode runs under CUDA graphs: time the captured launch pair without Python overhead
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel()
    ms = triton.testing.do_bench(graph.replay, return_mode="median")

    nbytes = bs * kv_len * LATENT * 2
    flops = 2 * bs * heads * kv_len * (LATENT + D_C)
    row = dict(
        bs=bs, kv_len=kv_len, heads=heads, page_size=page, num_kv_splits=splits,
        config=dict(block_h=cfg.block_h, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                    kv_load=cfg.kv_load, stage1=cfg.stage1),
        stage1_kernel=mla.mla_stage1_kernel(q_nope, q_pe, kv, page, cfg),
        ms=ms, eager_ms=eager_ms, tbps=nbytes / (ms * 1e-3) / 1e12, tflops=flops / (ms * 1e-3) / 1e12,
    )
    row["pct_copy"] = 100.0 * row["tbps"] / copy_tbps
    if bs == 32 and heads == 128 and page == 128 and kv_len in CUTLASS_REF_MS:
        row["cutlass_ref_ms"] = CUTLASS_REF_MS[kv_len]

    if peer:
        # same math in PyTorch; slot gather indices are prepared once (index metadata)
        t = torch.arange(kv_len, device="cuda")
        slots = (table[:, : -(-kv_len // page)].long()[:, t // page] * page + t % page)  # [bs, kv_len]
        rows2d = kv.view(-1, LATENT)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [bs, H, 576]

        def torch_peer():
            lat = rows2d[slots]  # [bs, L, 576] bf16
            s = torch.matmul(q, lat.transpose(1, 2))  # bf16
            p = torch.softmax(s.float() * sm_scale, dim=-1).to(torch.bfloat16)
            return torch.matmul(p, lat[..., :D_C])

        try:
            ref = torch_peer()
            err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            row["rel_err_vs_peer"] = err
            pms = triton.testing.do_bench(torch_peer, return_mode="median")
            row.update(peer_ms=pms, peer_tbps=nbytes / (pms * 1e-3) / 1e12, speedup_vs_peer=pms / ms)
        except torch.cuda.OutOfMemoryError:
            row["peer_ms"] = None
            row["peer_note"] = "out of memory"
    return row


def run(results: dict, *, sweep: bool = True) -> None:
    """Append one row per standard config to ``results["mla"]`` (and sweep rows to
    ``results["mla_sweep"]``). Uses ``results["copy_tbps"]`` when present, else measures it."""
    import torch

    from attnserve.attention.triton_ops.mla_decode import MLADecodeConfig

    if not torch.cuda.is_available():
        raise RuntimeError("the MLA kernel benchmark needs a CUDA GPU")
    if "copy_tbps" not in results:
        results["copy_tbps"] = copy_bandwidth_gbs() / 1e3
    copy_tbps = results["copy_tbps"]
    rows = results.setdefault("mla", [])
    for c in standard_configs():
        row = time_one(c["bs"], c["kv_len"], c["heads"], c["page"], copy_tbps)
        rows.append(row)
        _print_row(row)
    if not sweep:
        return
    from triton.runtime.errors import OutOfResources

    sweep_rows = results.setdefault("mla_sweep", [])
    for (bs, kv_len, heads) in ((32, 16384, 128), (32, 4096, 128), (128, 4096, 16)):
        for bh, bn, w, st in SWEEP_CANDIDATES[heads]:
            cfg = MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st)
            try:
                row = time_one(bs, kv_len, heads, 128, copy_tbps, config=cfg, peer=False)
            except OutOfResources as e:
                row = dict(bs=bs, kv_len=kv_len, heads=heads, page_size=128,
                           config=dict(block_h=bh, block_n=bn, num_warps=w, num_stages=st), error=str(e))
                torch.cuda.empty_cache()
            sweep_rows.append(row)
            _print_row(row, prefix="sweep ")


def _print_row(row: Dict, prefix: str = "") -> None:
    c = row["config"]
    tag = f"{prefix}bs={row['bs']:>3} kv={row['kv_len']:>6} H={row['heads']:>3} page={row['page_size']:>3} " \
          f"cfg=({c['block_h']},{c['block_n']},w{c['num_warps']},s{c['num_stages']})"
    if "error" in row:
        print(f"{tag}  ERROR {row['error'][:80]}", flush=True)
        return
    line = f"{tag} splits={row['num_kv_splits']:>3}  {row['ms']:.4f} ms  {row['tbps']:.2f} TB/s " \
           f"({row['pct_copy']:.0f}% copy)  {row['tflops']:.0f} TFLOPS"
    if row.get("peer_ms"):
        line += f" | torch {row['peer_ms']:.3f} ms ({row['speedup_vs_peer']:.1f}x)"
    if "cutlass_ref_ms" in row:
        line += f" | cutlass ref {row['cutlass_ref_ms']:.2f} ms"
    line += f" | stage 1: {row['stage1_kernel']}"
    print(line, flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for <device-slug>-mla-<date>.json")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile-config sweep")
    args = ap.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("the MLA kernel benchmark needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    results: dict = dict(
        date=_dt.datetime.now().isoformat(timespec="seconds"),
        device=name,
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        sm_count=torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count,
    )
    results["copy_tbps"] = copy_bandwidth_gbs() / 1e3
    print(f"{name}: copy {results['copy_tbps']:.2f} TB/s", flush=True)
    run(results, sweep=not args.no_sweep)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{device_slug('cuda')}-mla-{_dt.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
