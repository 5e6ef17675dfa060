"""Decode-step latency: eager vs CUDA graphs, against the weights+KV bandwidth floor and HF.

``PYTHONPATH=src python benchmarks/decode.py [--out DIR] [--models smollm2-135m llama-3-8b]``

For each model shape (dummy weights, bf16) and each (batch, context) it pre-fills the KV
pool with random K/V for ``batch`` requests of ``context`` tokens, then times one decode
step (embedding -> layers -> logits) eagerly and by graph replay, with CUDA events, median
of many steps. The floor is (weight bytes + KV bytes read) / measured copy bandwidth. The
peer is HF ``transformers`` ``generate`` on the same config and random weights, timed per
step as (t(n2 tokens) - t(n1 tokens)) / (n2 - n1) so its prefill cancels out.
Writes ``<out>/<device>-decode-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import statistics

import torch

from attnserve.bench.offline import fill_decode_kv
from attnserve.bench.results import write_result
from common import copy_bandwidth_gbs, make_runner, time_ms


def bench_model(model: str, batches, contexts, copy_gbs: float) -> list:
    rows_out = []
    runner = make_runner(model, max(batches), max(contexts), graphs=True)
    mc = runner.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_token_bytes = mc.kv_cache_bytes_per_token(runner.dtype)
    for ctx in contexts:
        for bs in batches:
            rows, slots, out_loc, fb = fill_decode_kv(runner, bs, ctx)
            graph_runner = runner.cuda_graph_runner

            def eager():
                runner.attn_backend.init_forward_metadata(fb)
                h = runner.model(fb.input_ids, fb.positions, fb)
                return runner.model.compute_logits(h)

            with torch.inference_mode():
                t_eager = time_ms(eager)
                t_graph = time_ms(lambda: graph_runner.replay(fb))
            floor_ms = (weight_bytes + kv_token_bytes * bs * (ctx + 1)) / (copy_gbs * 1e9) * 1e3
            row = {"model": model, "batch": bs, "context": ctx, "eager_ms": t_eager, "graph_ms": t_graph,
                   "floor_ms": floor_ms, "graph_pct_of_floor": 100 * floor_ms / t_graph,
                   "graph_speedup": t_eager / t_graph, "weight_bytes": weight_bytes,
                   "kv_bytes_read": kv_token_bytes * bs * (ctx + 1)}
            rows_out.append(row)
            print(f"{model:14s} bs={bs:3d} ctx={ctx:5d} eager {t_eager:7.3f} ms  graph {t_graph:7.3f} ms  "
                  f"floor {floor_ms:6.3f} ms ({row['graph_pct_of_floor']:.0f}%)", flush=True)
            runner.token_to_kv_pool_allocator.free(torch.cat([slots, out_loc]))
            runner.req_to_token_pool.free(rows)
    del runner, graph_runner
    gc.collect()
    torch.cuda.empty_cache()
    _ = mc
    return rows_out


def bench_hf(model: str, batches, contexts) -> list:
    """HF transformers generate with random weights: per-step decode time."""
    import transformers
    from transformers import AutoModelForCausalLM

    from attnserve.model_loader.dummy import dummy_hf_config

    cfg = dummy_hf_config(model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    out = []
    for ctx in contexts:
        for bs in batches:
            ids = torch.randint(0, cfg.vocab_size, (bs, ctx), device="cuda")

            def gen(n):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                with torch.inference_mode():
                    hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                b.record()
                torch.cuda.synchronize()
                return a.elapsed_time(b)

            gen(2)
            n1, n2 = 4, 36
            t = statistics.median([(gen(n2) - gen(n1)) / (n2 - n1) for _ in range(2)])
            out.append({"model": model, "batch": bs, "context": ctx, "hf_ms_per_step": t,
                        "transformers": transformers.__version__})
            print(f"HF {model:14s} bs={bs:3d} ctx={ctx:5d} {t:7.3f} ms/step", flush=True)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3-8b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)
    import triton
    import transformers

    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    rows, hf_rows = [], []
    for m in args.models:
        rows += bench_model(m, args.batches, args.contexts, copy_gbs)
        if not args.skip_hf:
            hf_rows += bench_hf(m, args.hf_batches, args.contexts)
    for h in hf_rows:
        for r in rows:
            if (r["model"], r["batch"], r["context"]) == (h["model"], h["batch"], h["context"]):
                r["hf_ms_per_step"] = h["hf_ms_per_step"]
                r["speedup_vs_hf"] = h["hf_ms_per_step"] / r["graph_ms"]
    result = {
        "benchmark": "decode", "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "copy_bandwidth_gbs": copy_gbs, "rows": rows, "hf_rows": hf_rows,
    }
    write_result(result, args.out, "decode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
