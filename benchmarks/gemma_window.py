"""Decode attention of Gemma 3's local (sliding-window) vs global layers, triton backend.

``PYTHONPATH=src python benchmarks/gemma_window.py [--out DIR] [--bs 8] [--contexts 1024 2048 4096 8192]
[--dtype bfloat16]``

Gemma 3 270M's attention shape (Hq=4, Hkv=1, head_dim 256, window 512; see
`attnserve.model_loader.dummy.DUMMY_MODEL_CONFIGS["gemma3-270m"]`). For each context
length it builds a paged KV pool of two layers filled with random K/V for ``bs`` requests
of ``context`` tokens, runs the triton backend's ``init_forward_metadata`` for one DECODE
step, and times ``backend.forward_decode`` of a local `RadixAttention` layer
(``sliding_window_size=511``: it should read 512 keys per request whatever the context)
and of a global one (reads the whole context):

* ``*_graph_us``: median µs per call inside a CUDA graph of many calls (launch overhead
  removed; `common.bench_graph`);
* ``*_us``: ``triton.testing.do_bench`` median (L2 flushed before each call);
* ``*_tbps``: K+V bytes the layer must read (window or whole context) / graph time, and
  ``% of the device-to-device copy ceiling`` measured in the same run;
* peer ``sdpa_*_us``: ``F.scaled_dot_product_attention`` on contiguous, unpaged KV holding
  just the keys each layer sees (the last 512, or all), same shapes.

The KV write of the new token is not timed (``save_kv_cache=False``). Writes
``<out>/<device-slug>-gemma-window-<date>.json`` and prints one line per context.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from typing import Dict, List, Optional, Sequence

DTYPES = ("bfloat16", "float16", "float32")


def _gemma_model_config():
    from attnserve.model_loader.dummy import dummy_hf_config
    from attnserve.model_loader.model_config import ModelConfig

    return ModelConfig.from_hf_config(dummy_hf_config("gemma3-270m"))


def build_decode_case(bs: int, ctx: int, dtype, page_size: int = 1, seed: int = 0, device: str = "cuda") -> dict:
    """One DECODE step of ``bs`` requests of ``ctx`` tokens (the last one is the new token)
    over a 2-layer paged KV pool with random K/V, metadata built by the triton backend.

    Returns:
        dict with ``backend``, ``fb`` (ForwardBatch), ``q`` ``[bs, Hq * D]``, ``local`` and
        ``global`` `RadixAttention` layers (layer ids 0 and 1), ``k_buffers`` /
        ``v_buffers`` (per layer ``[slots, Hkv, D]``), ``rows`` and ``model_config``.
    """
    import torch

    from attnserve.attention.radix_attention import RadixAttention
    from attnserve.attention.backend_config import AttentionBackendConfig
    from attnserve.attention.registry import create_attention_backend
    from attnserve.forward_batch import ForwardBatch, ForwardMode
    from attnserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator

    mc = _gemma_model_config()
    hq, hkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    size = bs * (ctx + page_size)
    size -= size % page_size
    req_pool = ReqToTokenPool(bs + 1, ctx + 1, device)
    alloc = TokenToKVPoolAllocator(size, page_size)
    kv = MHATokenToKVPool(size, page_size, dtype, hkv, d, 2, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.normal_(generator=gen)
    rows = req_pool.alloc(bs)
    slots = alloc.alloc_extend([0] * bs, [ctx] * bs, [0] * bs)
    for i, r in enumerate(rows):
        req_pool.write(r, 0, slots[i * ctx:(i + 1) * ctx])
    out_loc = slots.view(bs, ctx)[:, -1].contiguous()
    config = AttentionBackendConfig.from_pools(req_pool, kv, hq, layer_windows=(mc.sliding_window_size, -1))
    backend = create_attention_backend("triton", config)
    fb = ForwardBatch.init_new(ForwardMode.DECODE, [0] * bs, rows, [ctx - 1] * bs, [1] * bs, out_loc, req_pool, kv,
                               backend, device)
    backend.init_forward_metadata(fb)
    scale = float(mc.hf_config.query_pre_attn_scalar) ** -0.5
    local = RadixAttention(hq, d, scale, hkv, layer_id=0, sliding_window_size=mc.sliding_window_size)
    glob = RadixAttention(hq, d, scale, hkv, layer_id=1, sliding_window_size=-1)
    q = torch.randn(bs, hq * d, generator=gen, device=device).to(dtype)
    return dict(backend=backend, fb=fb, q=q, local=local, glob=glob, k_buffers=kv.k_buffer, v_buffers=kv.v_buffer,
                rows=rows, slots=slots.view(bs, ctx), model_config=mc)


def decode_fn(case: dict, layer):
    backend, fb, q = case["backend"], case["fb"], case["q"]
    return lambda: backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)


def _sdpa_fn(case: dict, layer, keys: int):
    """SDPA peer on contiguous K/V of the last ``keys`` tokens of each request."""
    import torch
    import torch.nn.functional as F

    slots = case["slots"][:, -keys:].reshape(-1).to(device=case["q"].device, dtype=torch.int64)
    bs = case["slots"].shape[0]
    k = case["k_buffers"][layer.layer_id][slots].view(bs, keys, layer.tp_k_head_num, -1).transpose(1, 2).contiguous()
    v = case["v_buffers"][layer.layer_id][slots].view(bs, keys, layer.tp_v_head_num, -1).transpose(1, 2).contiguous()
    q = case["q"].view(bs, layer.tp_q_head_num, 1, -1)
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=layer.scaling, enable_gqa=True)


def measure(bs: int, ctx: int, dtype, page_size: int = 1, peer: bool = True) -> Dict[str, float]:
    """Local vs global decode-attention times (µs) and bandwidths at one (bs, ctx)."""
    import torch

    from common import bench_eager, bench_graph, try_run

    case = build_decode_case(bs, ctx, dtype, page_size)
    mc = case["model_config"]
    elem = torch.empty((), dtype=dtype).element_size()
    window_keys = min(ctx, mc.sliding_window_size + 1)
    row: Dict[str, float] = dict(bs=bs, context=ctx, window_keys=window_keys)
    for name, layer, keys in (("local", case["local"], window_keys), ("global", case["glob"], ctx)):
        fn = decode_fn(case, layer)
        row[f"{name}_graph_us"] = bench_graph([fn], min_calls=50)
        row[f"{name}_us"] = bench_eager([fn])
        row[f"{name}_bytes"] = bs * keys * mc.num_key_value_heads * (mc.head_dim + mc.v_head_dim) * elem
        row[f"{name}_tbps"] = row[f"{name}_bytes"] / (row[f"{name}_graph_us"] * 1e-6) / 1e12
        if peer:
            t, err = try_run(lambda: bench_graph([_sdpa_fn(case, layer, keys)], min_calls=50))
            row[f"sdpa_{name}_graph_us"] = t if err is None else err
    row["local_over_global"] = row["local_graph_us"] / row["global_graph_us"]
    del case
    torch.cuda.empty_cache()
    return row


def run(bs: int = 64, contexts: Sequence[int] = (1024, 2048, 4096, 8192), dtype: str = "bfloat16",
        page_size: int = 1, peer: bool = True, ceilings: bool = True) -> dict:
    """All measurements of one run as a JSON-able dict (see the module docstring)."""
    import torch
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("the gemma window benchmark needs a CUDA GPU")
    from common import measure_ceilings

    torch_dtype = getattr(torch, dtype)
    name = torch.cuda.get_device_name(0)
    results: dict = dict(
        date=_dt.date.today().isoformat(), device=name,
        versions=dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda),
        config=dict(model="gemma3-270m", hq=4, hkv=1, head_dim=256, window=512, bs=bs, dtype=dtype,
                    page_size=page_size, backend="triton"),
    )
    if ceilings:
        results["ceilings"] = measure_ceilings()
    results["rows"] = [measure(bs, ctx, torch_dtype, page_size, peer) for ctx in contexts]
    copy = results.get("ceilings", {}).get("copy_tbps")
    for row in results["rows"]:
        if copy:
            row["global_pct_copy"] = 100 * row["global_tbps"] / copy
            row["local_pct_copy"] = 100 * row["local_tbps"] / copy
    return results


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory of the JSON result")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--no-peer", action="store_true", help="skip the SDPA peer")
    args = ap.parse_args(argv)
    from attnserve.bench.results import device_slug

    results = run(args.bs, args.contexts, args.dtype, args.page_size, peer=not args.no_peer)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{device_slug('cuda')}-gemma-window-{results['date']}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    for r in results["rows"]:
        print(f"bs={r['bs']} ctx={r['context']}: local {r['local_graph_us']:.1f} us ({r['local_tbps']:.2f} TB/s), "
              f"global {r['global_graph_us']:.1f} us ({r['global_tbps']:.2f} TB/s), "
              f"local/global {r['local_over_global']:.3f}")
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
