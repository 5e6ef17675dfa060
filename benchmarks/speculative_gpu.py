"""Speculative decoding on a GPU (dummy weights): verify cost, multi-step draft metadata,
and end to end at batch 1. Writes ``<out>/<device>-speculative-<date>.json``.

``PYTHONPATH=src python benchmarks/speculative_gpu.py [--model llama-3-8b] [--ctx 512]``

1. ``verify_vs_decode``: the target's captured TARGET_VERIFY step (``n`` = 8 nodes per
   request, a random tree) against its captured DECODE step, same batch and context
   (CUDA events over 50 replays each, inputs copied in as the engine does).
2. ``draft_metadata``: the attention metadata of ``N`` = 1, 4, 8 draft decode steps, built
   per step (``N`` x `TritonAttnBackend.init_forward_metadata`, "before") and once for
   all steps (`TritonMultiStepDraftBackend`, "after"): eager wall per round (synchronised,
   median of 200) and inside a CUDA graph (replay time of a graph holding only the
   metadata work).
3. ``end_to_end``: one request (a 512-token prompt with repeated text) decoding 256 tokens,
   plain vs NGRAM (8 draft tokens, breadth 1 and 10) vs STANDALONE self-draft (first 4
   layers, 4 steps), graphs on; tokens/s, accept length (completion tokens /
   ``spec_verify_ct``) and whether the tokens equal the plain run's. Dummy weights: the
   accept lengths say how often a random model repeats itself, not how a real one drafts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import fill_requests, time_ms  # noqa: E402
from kernel_timings import graph_us  # noqa: E402

from attnserve.bench.results import device_slug, write_result  # noqa: E402
from attnserve.engine.engine import Engine  # noqa: E402
from attnserve.engine.sampling_params import SamplingParams  # noqa: E402
from attnserve.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from attnserve.server_args import ServerArgs  # noqa: E402


def _engine(model, **kw):
    base = dict(model=model, load_format="dummy", device="cuda", dtype="bfloat16", max_running_requests=64,
                context_length=4096 + 64, cuda_graph_max_bs=32)
    base.update(kw)
    return Engine(ServerArgs(**base))


def verify_vs_decode(engine, ctx, sizes, n=8):
    from attnserve.engine.speculative.tree import DraftTree
    from attnserve.engine.speculative.verify_graph import pack_verify_inputs

    runner, spec = engine.model_runner, engine.scheduler.spec
    out = []
    rnd = random.Random(0)
    for bs in sizes:
        rows, loc = fill_requests(runner, bs, ctx, n)
        dec = runner.build_forward_batch(ForwardMode.DECODE, [5] * bs, rows, [ctx] * bs, [1] * bs,
                                         loc[:, ctx].contiguous().to(runner.device))
        t_dec = time_ms(lambda: runner.forward(dec))
        trees = [DraftTree(tuple(rnd.randrange(1000) for _ in range(n)),
                           (-1,) + tuple(rnd.randrange(i) for i in range(1, n))) for _ in range(bs)]
        packed = pack_verify_inputs(trees, [ctx] * bs, rows, [loc[i, ctx: ctx + n] for i in range(bs)], n)
        dev = packed.to(runner.device)
        t_ver = time_ms(lambda: spec.verify_graph.replay(dev, bs))
        out.append({"bs": bs, "ctx": ctx, "num_draft_tokens": n, "decode_graph_ms": t_dec, "verify_graph_ms": t_ver,
                    "verify_over_decode": t_ver / t_dec})
        print(f"bs {bs:3d} ctx {ctx}: decode {t_dec:.3f} ms  verify({n}) {t_ver:.3f} ms  ratio {t_ver / t_dec:.3f}",
              flush=True)
        runner.token_to_kv_pool_allocator.free(loc.view(-1))
        runner.req_to_token_pool.free(rows)
    return out


def draft_metadata(engine, cases):
    from attnserve.attention.multi_step_draft import TritonMultiStepDraftBackend
    from attnserve.attention.triton_backend import TritonAttnBackend

    runner = engine.model_runner
    cfg = runner.attn_backend_config
    out = []
    for bs, ctx in cases:
        rows, loc = fill_requests(runner, bs, ctx, 8)
        rows_d = torch.tensor(rows, dtype=torch.int64, device=runner.device)
        base = torch.full((bs,), ctx, dtype=torch.int32, device=runner.device)
        for steps in (1, 4, 8):
            singles = [TritonAttnBackend(cfg) for _ in range(steps)]
            fbs = []
            for j in range(steps):
                lens = [ctx + j] * bs
                fbs.append(ForwardBatch(
                    forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=rows_d, positions=rows_d,
                    req_pool_indices=rows_d, seq_lens=base + j, out_cache_loc=rows_d,
                    seq_lens_cpu=torch.tensor(lens, dtype=torch.int32), seq_lens_sum=sum(lens),
                    req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool))
            multi = TritonMultiStepDraftBackend(cfg, steps, max_bs=max(bs, 1))

            def before():
                for b, fb in zip(singles, fbs):
                    b.init_forward_metadata(fb)

            def after():
                multi.init_forward_metadata(bs, rows_d, base)

            for b in singles:
                b.init_cuda_graph_state(bs, bs)

            def before_graph():
                for b, fb in zip(singles, fbs):
                    b.init_forward_metadata_replay_cuda_graph(bs, rows_d, fb.seq_lens, fb.seq_lens_sum, None,
                                                              ForwardMode.DECODE, None, None)

            row = {"bs": bs, "ctx": ctx, "steps": steps,
                   "eager_before_us": _wall(before), "eager_after_us": _wall(after),
                   "graph_before_us": graph_us(before_graph, calls=1, replays=100),
                   "graph_after_us": graph_us(after, calls=1, replays=100)}
            out.append(row)
            print(f"metadata bs {bs} ctx {ctx} N={steps}: eager {row['eager_before_us']:.1f} -> "
                  f"{row['eager_after_us']:.1f} us, in graph {row['graph_before_us']:.1f} -> "
                  f"{row['graph_after_us']:.1f} us", flush=True)
        runner.token_to_kv_pool_allocator.free(loc.view(-1))
        runner.req_to_token_pool.free(rows)
    return out


def _wall(fn, iters=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def end_to_end(model, prompt_len, new_tokens, cases):
    rnd = random.Random(1)
    phrase = [rnd.randrange(100, 20000) for _ in range(64)]
    prompt = (phrase * (prompt_len // 64 + 1))[:prompt_len]
    rows, base = [], None
    for name, kw in cases:
        engine = _engine(model, cuda_graph_max_bs=8, max_running_requests=8, **kw)
        sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        walls = []
        for rep in range(3):  # the first run warms up
            engine.scheduler.flush_prefix_cache()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            req = engine.add_request(list(prompt), sp)
            while engine.has_work():
                engine.step()
            torch.cuda.synchronize()
            if rep:
                walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        toks = list(req.output_ids)
        if base is None:
            base = (wall, toks)
        row = {"case": name, **{k: v for k, v in kw.items()}, "wall_s": wall,
               "output_tokens_per_s": len(toks) / wall, "spec_verify_ct": req.spec_verify_ct,
               "accept_length": len(toks) / req.spec_verify_ct if req.spec_verify_ct else None,
               "speedup": base[0] / wall, "identical_to_plain": toks == base[1]}
        rows.append(row)
        print(f"e2e {name:22s} {row['output_tokens_per_s']:8.1f} tok/s  accept {row['accept_length']}  "
              f"speedup {row['speedup']:.2f}x  identical {row['identical_to_plain']}", flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    engine = _engine(args.model, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    result = {"verify_vs_decode": verify_vs_decode(engine, args.ctx, [1, 8, 32])}
    result["draft_metadata"] = draft_metadata(engine, [(1, args.ctx), (32, 4096)])
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_e2e:
        result["end_to_end"] = end_to_end(args.model, args.ctx, args.new_tokens, [
            ("plain", {}),
            ("ngram n8 breadth1", dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8,
                                       speculative_ngram_max_bfs_breadth=1)),
            ("ngram n8 breadth10", dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)),
            ("standalone self-draft", dict(speculative_algorithm="STANDALONE", speculative_draft_layers=4,
                                           speculative_num_steps=4, speculative_num_draft_tokens=5)),
        ])
    import triton

    result.update({"benchmark": "speculative", "date": dt.date.today().isoformat(), "device": device_slug("cuda"),
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "cuda": torch.version.cuda, "model": args.model, "load_format": "dummy", "dtype": "bfloat16",
                   "total_s": time.perf_counter() - t0})
    write_result(result, args.out, "speculative", "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
