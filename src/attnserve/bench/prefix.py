"""Prefix caching benchmark. Writes ``<out>/<device>-prefix-<date>.json``.

GPU (dummy weights): ``python -m attnserve.bench.prefix --device cuda --load-format dummy
[--model llama-3-8b]`` times, in one engine, each workload once to warm up and then timed
twice, with the prefix cache emptied before every run (so a shared prefix is computed
once inside the run, not carried over from the warm-up):

* ``shared``: ``--requests`` prompts = one ``--prefix-len`` prefix + ``--unique-len``
  unique tokens each, ``--output-len`` new tokens;
* ``unique``: the same number of unrelated prompts of the same length;
* ``unique`` again with the radix cache swapped for the no-op cache (what
  ``--disable-radix-cache`` runs).

Reported: wall seconds, ``shared / unique`` (target <= 0.20) and ``unique with cache /
unique without`` (target within 3%).

CPU (real weights, default): ``python -m attnserve.bench.prefix [--model smollm2-135m]``
measures the time to first token of turn 2 of a chat whose turn 1 carried a ~1,000-token
history, with the cache on and off (target >= 4x shorter with it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import time

import torch

from attnserve.bench.results import write_result


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(llm, prompts, sp, device: str) -> float:
    llm.engine.scheduler.flush_prefix_cache()
    _sync(device)
    t0 = time.perf_counter()
    llm.generate(prompts, sp)
    _sync(device)
    return time.perf_counter() - t0


def bench_gpu(args) -> dict:
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    n, plen, ulen = args.requests, args.prefix_len, args.unique_len
    llm = LLM(args.model, load_format="dummy", device="cuda", max_running_requests=max(n, 1),
              context_length=plen + ulen + args.output_len + 16)
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def rand(k):
        return torch.randint(1, vocab, (k,), generator=gen).tolist()

    def shared():
        prefix = rand(plen)
        return [prefix + rand(ulen) for _ in range(n)]

    def unique():
        return [rand(plen + ulen) for _ in range(n)]

    sp = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    sched = llm.engine.scheduler
    rows = {}
    for name, make, cache in (("shared", shared, True), ("unique", unique, True), ("unique_no_cache", unique, False)):
        sched.set_prefix_cache(cache)
        _timed(llm, make(), sp, "cuda")  # warm-up
        times = []
        for _ in range(2):
            prompts = make()
            stats0 = sched.stats.cached_prompt_tokens
            times.append(_timed(llm, prompts, sp, "cuda"))
            cached = sched.stats.cached_prompt_tokens - stats0
        rows[name] = {"seconds": times, "best_s": min(times), "cached_prompt_tokens": cached,
                      "prompt_tokens": n * (plen + ulen)}
        print(f"{name:16s} {min(times):.3f} s (runs {', '.join(f'{t:.3f}' for t in times)}), "
              f"cached {cached} of {n * (plen + ulen)} prompt tokens", flush=True)
    ratios = {"shared_over_unique": rows["shared"]["best_s"] / rows["unique"]["best_s"],
              "unique_cache_over_no_cache": rows["unique"]["best_s"] / rows["unique_no_cache"]["best_s"]}
    print(f"shared / unique = {ratios['shared_over_unique']:.3f}; unique with / without cache = "
          f"{ratios['unique_cache_over_no_cache']:.3f}")
    return {"rows": rows, "ratios": ratios}


def bench_cpu_chat(args) -> dict:
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    llm = LLM(args.model, device="cpu")
    tok = llm.tokenizer
    history = " ".join(f"Note {i}: the meeting about topic {i} moved to room {100 + i}." for i in range(70))
    turn1 = [{"role": "user", "content": history + " Which room is the meeting about topic 3 in?"}]
    first = tok.apply_chat_template(turn1, add_generation_prompt=True, tokenize=True)
    first = list(first["input_ids"]) if hasattr(first, "keys") else list(first)
    answer = llm.generate([first], SamplingParams(max_new_tokens=16, temperature=0.0))[0]
    turn2 = turn1 + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "And topic 7?"}]
    second = tok.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True)
    second = list(second["input_ids"]) if hasattr(second, "keys") else list(second)
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    sched = llm.engine.scheduler
    out = {"history_tokens": len(first), "turn2_prompt_tokens": len(second)}
    for cache in (False, True):
        sched.set_prefix_cache(cache)
        ttfts = []
        for _ in range(3):
            sched.flush_prefix_cache()
            llm.generate([first], SamplingParams(max_new_tokens=16, temperature=0.0))  # turn 1 fills the cache
            t0 = time.perf_counter()
            o = llm.generate([second], one)[0]
            ttfts.append(time.perf_counter() - t0)
        out["ttft_cache" if cache else "ttft_no_cache"] = {"seconds": ttfts, "best_s": min(ttfts),
                                                          "cached_tokens": o.cached_tokens}
        print(f"turn-2 TTFT cache={'on ' if cache else 'off'} {min(ttfts) * 1e3:8.1f} ms "
              f"(cached {o.cached_tokens} of {len(second)} tokens)", flush=True)
    out["speedup"] = out["ttft_no_cache"]["best_s"] / out["ttft_cache"]["best_s"]
    print(f"speedup {out['speedup']:.1f}x")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--model", default=None, help="default: llama-3-8b (dummy) or smollm2-135m (CPU)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--unique-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    import transformers

    gpu = args.load_format == "dummy"
    if gpu and (args.device != "cuda" or not torch.cuda.is_available()):
        ap.error("--load-format dummy measures on a GPU: pass --device cuda on a CUDA machine")
    args.model = args.model or ("llama-3-8b" if gpu else "smollm2-135m")
    body = bench_gpu(args) if gpu else bench_cpu_chat(args)
    result = {"benchmark": "prefix", "date": dt.date.today().isoformat(), "model": args.model,
              "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "threads": torch.get_num_threads(),
              "args": {k: v for k, v in vars(args).items() if k != "out"}, **body}
    if gpu:
        import triton

        result["triton"] = triton.__version__
    write_result(result, args.out, "prefix", "cuda" if gpu else "cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
