"""Offline generation throughput: attnserve vs HF ``transformers.generate`` in one run.

``python -m attnserve.bench.offline [--model smollm2-135m] [--max-new-tokens 128]``

Measures generated tokens/s for 1 and 16 concurrent requests (``ignore_eos`` so every
request generates exactly ``max_new_tokens``), then HF ``generate`` on the same prompts
with batch 1 and batch 8 (left-padded), greedy, the same dtype and device. Writes
``benchmarks/results/<device>-offline-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import time

import torch

from attnserve.bench.results import device_slug, write_result

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


def bench_attnserve(llm, prompts, max_new_tokens: int) -> dict:
    from attnserve.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0.0), chat=True)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, chat=True)
    secs = time.perf_counter() - t0
    gen = sum(len(o.token_ids) for o in outs)
    return {"requests": len(prompts), "generated_tokens": gen, "seconds": secs, "tokens_per_s": gen / secs}


def bench_hf(model_dir: str, gguf_file: str, prompts, max_new_tokens: int, batch: int, dtype, device) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=dtype).to(device).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    gen = 0
    t0 = None
    for i in range(-1, len(texts), batch):  # i == -1: warm-up batch
        chunk = texts[max(i, 0): max(i, 0) + batch]
        enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        n_new = 4 if i < 0 else max_new_tokens
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        if i < 0:
            t0 = time.perf_counter()
            continue
        gen += (out.shape[1] - enc["input_ids"].shape[1]) * len(chunk)
    secs = time.perf_counter() - t0
    return {"requests": len(texts), "batch": batch, "generated_tokens": gen, "seconds": secs,
            "tokens_per_s": gen / secs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)

    from attnserve.engine.llm import LLM
    import transformers

    llm = LLM(args.model, device=args.device, attention_backend=args.attention_backend)
    device = str(llm.engine.model_runner.device.type)
    dtype = llm.engine.model_runner.dtype
    rows = {}
    for n in (1, 16):
        rows[f"attnserve_concurrency_{n}"] = r = bench_attnserve(llm, PROMPTS[:n], args.max_new_tokens)
        print(f"attnserve  concurrency {n:2d}: {r['tokens_per_s']:8.1f} tok/s ({r['seconds']:.1f} s)")
    if not args.skip_hf:
        from attnserve.model_loader.loader import resolve_model

        res = resolve_model(args.model)
        model_dir, gguf_file = os.path.dirname(res.gguf_path), os.path.basename(res.gguf_path)
        for b in (1, 8):
            prompts = PROMPTS[:1] if b == 1 else PROMPTS[:16]
            rows[f"hf_generate_batch_{b}"] = r = bench_hf(model_dir, gguf_file, prompts, args.max_new_tokens, b,
                                                          dtype, device)
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
        "rows": rows,
    }
    write_result(result, args.out, "offline", device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
