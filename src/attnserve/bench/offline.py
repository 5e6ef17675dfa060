"""Offline generation throughput, two modes. Writes ``<out>/<device>-offline-<date>.json``.

Real weights (default; CPU or GPU):
``python -m attnserve.bench.offline [--model smollm2-135m] [--max-new-tokens 128]``
measures generated tokens/s for 1 and 16 concurrent requests (``ignore_eos`` so every
request generates exactly ``max_new_tokens``), then HF ``generate`` on the same prompts
with batch 1 and batch 8 (left-padded), greedy, the same dtype and device; every row is
the median of ``--repeat`` timed passes (default 3) after a warm-up of the same batch.

Random workload against its roofline (`attnserve.bench.offline_random`):
``python -m attnserve.bench.offline --dataset random --load-format dummy --models llama-3-8b
--num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.098``.

Engine loop on a GPU (dummy weights, any shape):
``python -m attnserve.bench.offline --device cuda --load-format dummy
[--models smollm2-135m llama-3-8b] [--requests 1 64] [--input-len 512] [--output-len 256]
[--kv-cache-dtypes auto fp8_e4m3] [--overlap both|on|off] [--warmup-output-len N]``
runs, per KV cache dtype, model shape and request count, with overlap scheduling on and off
(``--overlap both``, the default) in the same run, each workload once to warm up (with
``--warmup-output-len`` output tokens, default ``--output-len``) and then timed:

* ``output_tokens_per_s``: generated tokens / wall time of the whole workload;
* ``prefill_s``: the same prompts with one new token (prefill alone);
* ``graph_step_ms``: the engine's captured decode step replayed at that batch and the
  workload's mean context (CUDA events, median);
* ``decode_efficiency`` = decode steps x ``graph_step_ms`` / (wall - ``prefill_s``): the
  share of the decode wall time the GPU would need anyway (1.0: the host never stalls it);
* ``host_ms_per_step``: the scheduler's own count of host time per decode step (time in
  ``Scheduler.step`` minus time blocked on the GPU's results);
* ``pool_tokens``: the KV pool's size in tokens (an fp8 cache holds twice a bf16 one's at the
  same ``--mem-fraction-static``); ``mean_decode_batch``: decode tokens / decode steps, below
  the request count when the pool cannot hold every request at once; ``retractions``.

``graph_step_ms`` and ``decode_efficiency`` are null when the pool cannot hold the batch at
its mean context (the workload then runs in waves, so prefill and decode interleave).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import time
from typing import Optional

import torch

from attnserve.bench.results import device_slug, write_result
from attnserve.mem_cache.kv_quant import KV_CACHE_DTYPES

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain how a hash table works.",
    "Give three tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Describe the water cycle in simple terms.",
    "Why is the sky blue?",
    "List some uses of the Python programming language.",
    "How do vaccines train the immune system?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "Explain recursion to a ten-year-old.",
    "What are the benefits of regular exercise?",
    "How does a bicycle stay upright?",
    "Name the planets of the solar system.",
    "What is photosynthesis?",
]


def _timed(passes) -> dict:
    """``passes``: callables returning generated tokens. Runs each once, timed; the row's
    ``seconds`` is the median (``seconds_all`` lists every pass)."""
    secs, gen = [], 0
    for run_pass in passes:
        t0 = time.perf_counter()
        gen = run_pass()
        secs.append(time.perf_counter() - t0)
    med = statistics.median(secs)
    return {"generated_tokens": gen, "seconds": med, "seconds_all": secs, "tokens_per_s": gen / med}


def bench_attnserve(llm, prompts, max_new_tokens: int, repeat: int = 1) -> dict:
    """Generated tokens/s of ``prompts`` run concurrently, median of ``repeat`` timed passes
    (each after emptying the prefix cache) that follow one warm-up pass of the same batch."""
    from attnserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0), chat=True)  # warm-up, same batch

    def one_pass():
        llm.engine.scheduler.flush_prefix_cache()
        return sum(len(o.token_ids) for o in llm.generate(prompts, sp, chat=True))

    return {"requests": len(prompts), **_timed([one_pass] * repeat)}


def bench_hf(model_dir: str, gguf_file: str, prompts, max_new_tokens: int, batch: int, dtype, device,
             repeat: int = 1) -> dict:
    """HF ``generate`` tokens/s over every prompt in batches of ``batch`` (left-padded, greedy,
    exactly ``max_new_tokens`` each), median of ``repeat`` timed passes after a warm-up batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=dtype).to(device).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    def run(chunk, n_new):
        enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(chunk)

    run(texts[:batch], 4)  # warm-up

    def one_pass():
        return sum(run(texts[i:i + batch], max_new_tokens) for i in range(0, len(texts), batch))

    return {"requests": len(texts), "batch": batch, **_timed([one_pass] * repeat)}


def fill_decode_kv(runner, bs: int, ctx: int):
    """Give ``bs`` new requests ``ctx`` cached tokens of random K/V (every layer's buffers
    filled with N(0, 1), rounded to the pool's dtype, fp8 included) and one decode slot each.

    Args:
        runner: a `ModelRunner` whose pools are free enough for ``bs * (ctx + 1)`` slots.

    Returns:
        ``(rows, slots, out_loc, fb)``: request rows, int64 ``[bs * ctx]`` cached slots,
        int64 ``[bs]`` decode slots and the DECODE `ForwardBatch` (caller frees rows and slots).
    """
    from attnserve.forward_batch import ForwardMode

    rows = runner.req_to_token_pool.alloc(bs)
    alloc = runner.token_to_kv_pool_allocator
    slots = alloc.alloc_extend([0] * bs, [ctx] * bs, [0] * bs)
    for i, r in enumerate(rows):
        runner.req_to_token_pool.write(r, 0, slots[i * ctx:(i + 1) * ctx])
    last = [int(slots[(i + 1) * ctx - 1]) for i in range(bs)]
    out_loc = alloc.alloc_extend([ctx] * bs, [ctx + 1] * bs, last)
    for i, r in enumerate(rows):
        runner.req_to_token_pool.write(r, ctx, out_loc[i:i + 1])
    for buf in runner.token_to_kv_pool.buffers():  # each storage once (an MLA value buffer is a view)
        for chunk in torch.split(buf, 1 << 16):  # N(0, 1) in chunks: no normal_ for fp8, bounded temporaries
            chunk.copy_(torch.randn(chunk.shape, device=chunk.device))
    fb = runner.build_forward_batch(ForwardMode.DECODE, [1] * bs, rows, [ctx] * bs, [1] * bs, out_loc)
    return rows, slots, out_loc, fb


def graph_step_ms(runner, bs: int, ctx: int, iters: int = 50) -> float:
    """GPU time of one replay of the engine's captured decode graph for ``bs`` requests of
    ``ctx`` cached tokens: ``iters`` replays back to back between two CUDA events (so the
    host's launch work overlaps the GPU's, as in a running engine), divided by ``iters``.
    ``runner``: the engine's `ModelRunner`, whose pool must be free; it is free again
    afterwards."""
    rows, slots, out_loc, fb = fill_decode_kv(runner, bs, ctx)
    try:
        with torch.inference_mode():
            for _ in range(5):
                runner.cuda_graph_runner.replay(fb)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                runner.cuda_graph_runner.replay(fb)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / iters
    finally:
        runner.token_to_kv_pool_allocator.free(torch.cat([slots, out_loc]))
        runner.req_to_token_pool.free(rows)


def timed_generate(llm, prompts, sp) -> tuple:
    """(wall seconds, scheduler stats, outputs) of one ``generate`` call, stats reset before it."""
    from attnserve.engine.scheduler import SchedulerStats

    sched = llm.engine.scheduler
    sched.flush_prefix_cache()  # the warm-up ran the same prompts: no cached prefill in a timed run
    sched.stats = SchedulerStats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    assert all(len(o.token_ids) == sp.max_new_tokens for o in outs)
    return wall, sched.stats, outs


def bench_engine_loop(model: str, request_counts, input_len: int, output_len: int, kv_cache_dtype: str = "auto",
                      overlaps=(True, False), warmup_output_len: Optional[int] = None) -> list:
    """The GPU engine-loop cases of one model shape and KV cache dtype (see the module doc)."""
    import gc

    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    ctx_len = input_len + output_len + 16
    llm = LLM(model, load_format="dummy", device="cuda", context_length=ctx_len,
              max_running_requests=max(request_counts), kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.model_runner
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    warm = SamplingParams(max_new_tokens=warmup_output_len or output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for n in request_counts:
        prompts = [torch.randint(1, vocab, (input_len,), generator=gen).tolist() for _ in range(n)]
        sp = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        sp1 = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        mean_ctx = input_len + output_len // 2
        fits = n * (mean_ctx + 1) <= runner.token_to_kv_pool_allocator.available_size()
        graph_ms = graph_step_ms(runner, n, mean_ctx) if fits else None
        for overlap in overlaps:
            llm.engine.scheduler.overlap = overlap
            llm.generate(prompts, warm)  # warm-up
            prefill_s, _, _ = timed_generate(llm, prompts, sp1)
            wall, stats, _ = timed_generate(llm, prompts, sp)
            decode_wall = wall - prefill_s
            steps = max(stats.num_decode_steps, 1)
            row = {
                "model": model, "kv_cache_dtype": str(runner.kv_cache_dtype).replace("torch.", ""),
                "pool_tokens": runner.max_total_num_tokens, "requests": n, "input_len": input_len,
                "output_len": output_len, "overlap": overlap, "wall_s": wall,
                "output_tokens_per_s": n * output_len / wall, "prefill_s": prefill_s,
                "decode_steps": stats.num_decode_steps, "mean_decode_batch": n * (output_len - 1) / steps,
                "graph_step_ms": graph_ms, "decode_wall_ms_per_step": 1e3 * decode_wall / steps,
                "decode_efficiency": None if graph_ms is None else stats.num_decode_steps * graph_ms / 1e3 / decode_wall,
                "host_ms_per_step": stats.host_ms_per_decode_step, "retractions": stats.num_retractions,
                "retracted_requests": stats.num_retracted_requests,
            }
            rows.append(row)
            graph = "n/a" if graph_ms is None else f"{graph_ms:.2f}"
            eff = "n/a" if graph_ms is None else f"{row['decode_efficiency']:.2f}"
            print(f"{model:14s} {row['kv_cache_dtype']:13s} n={n:3d} overlap={'on ' if overlap else 'off'} "
                  f"{row['output_tokens_per_s']:9.0f} tok/s wall {wall:.2f} s prefill {prefill_s:.3f} s  "
                  f"step {row['decode_wall_ms_per_step']:.2f} ms (graph {graph}) batch {row['mean_decode_batch']:.1f} "
                  f"eff {eff}  host {row['host_ms_per_step']:.2f} ms  retractions {stats.num_retractions}", flush=True)
    del llm, runner  # every reference to the engine: the next dtype's engine needs its memory
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main_engine_loop(args) -> int:
    import triton
    import transformers

    overlaps = {"both": (True, False), "on": (True,), "off": (False,)}[args.overlap]
    rows = []
    for kv_dtype in args.kv_cache_dtypes:
        for m in args.models:
            rows += bench_engine_loop(m, args.requests, args.input_len, args.output_len, kv_dtype, overlaps,
                                      args.warmup_output_len)
    result = {
        "benchmark": "offline", "mode": "engine_loop", "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__, "dtype": "bfloat16",
        "load_format": "dummy", "kv_cache_dtypes": args.kv_cache_dtypes, "rows": rows,
    }
    write_result(result, args.out, "offline", "cuda")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: the GPU engine-loop cases with random weights")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3-8b"], help="shapes for dummy mode")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 64], help="request counts for dummy mode")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                    help="dummy mode: KV cache dtypes to run, each with its own engine")
    ap.add_argument("--overlap", default="both", choices=["both", "on", "off"],
                    help="dummy mode: overlap scheduling on, off or both (each a row)")
    ap.add_argument("--warmup-output-len", type=int, default=None,
                    help="dummy mode: output tokens of the warm-up pass (default: --output-len)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed passes per row (real-weights mode); rows report the median")
    ap.add_argument("--dataset", default=None, choices=["random"],
                    help="random: SGLang's random workload against its roofline (bench/offline_random.py)")
    ap.add_argument("--num-prompts", type=int, default=256, help="random dataset: requests")
    ap.add_argument("--random-input-len", type=int, default=1024, help="random dataset: most prompt tokens")
    ap.add_argument("--random-output-len", type=int, default=1024, help="random dataset: most output tokens")
    ap.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="random dataset: lengths uniform in [R * len, len]")
    ap.add_argument("--seed", type=int, default=0, help="random dataset: seed of lengths and token ids")
    ap.add_argument("--max-running-requests", type=int, default=None, help="random dataset: engine flag")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, help="random dataset: engine flag")
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="random dataset: engine flag")
    ap.add_argument("--tp-size", type=int, default=None,
                    help="random dataset: engine flag (the floor is then one rank's share of the work)")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="random dataset: FP8 linears (the roofline counts their FP8 bytes)")
    ap.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, nargs="+", default=[1],
                    help="random dataset: data-parallel replicas, one row each (e.g. 1 2; bench/offline_dp.py)")
    ap.add_argument("--tag", default=None, help="random dataset: suffix of the result file's kind")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.dp_size != [1] and args.dataset != "random":
        ap.error("--dp-size is measured on the random workload: add --dataset random")
    if min(args.dp_size) < 1:
        ap.error(f"--dp-size values must be >= 1, got {args.dp_size}")
    if args.dataset == "random":
        from attnserve.bench.offline_random import main_random

        try:
            return main_random(args)
        except ValueError as e:
            ap.error(str(e))
    if args.load_format == "dummy":
        if args.device not in ("cuda", "auto") or not torch.cuda.is_available():
            ap.error("--load-format dummy measures the engine loop on a GPU: needs CUDA (--device cuda)")
        return main_engine_loop(args)

    from attnserve.engine.llm import LLM
    import transformers

    llm = LLM(args.model, device=args.device, attention_backend=args.attention_backend)
    device = str(llm.engine.model_runner.device.type)
    dtype = llm.engine.model_runner.dtype
    rows = {}
    for n in (1, 16):
        rows[f"attnserve_concurrency_{n}"] = r = bench_attnserve(llm, PROMPTS[:n], args.max_new_tokens, args.repeat)
        print(f"attnserve  concurrency {n:2d}: {r['tokens_per_s']:8.1f} tok/s ({r['seconds']:.1f} s)")
    if not args.skip_hf:
        from attnserve.model_loader.loader import resolve_model

        res = resolve_model(args.model)
        model_dir, gguf_file = os.path.dirname(res.gguf_path), os.path.basename(res.gguf_path)
        for b in (1, 8):
            prompts = PROMPTS[:1] if b == 1 else PROMPTS[:16]
            rows[f"hf_generate_batch_{b}"] = r = bench_hf(model_dir, gguf_file, prompts, args.max_new_tokens, b,
                                                          dtype, device, args.repeat)
            print(f"HF generate batch {b:2d}:      {r['tokens_per_s']:8.1f} tok/s ({r['seconds']:.1f} s)")
    result = {
        "benchmark": "offline",
        "date": dt.date.today().isoformat(),
        "device": device_slug(device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.model,
        "dtype": str(dtype),
        "attention_backend": llm.engine.model_runner.backend_choice.decode,
        "max_new_tokens": args.max_new_tokens,
        "repeat": args.repeat,
        "rows": rows,
    }
    write_result(result, args.out, "offline", device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
