"""FP8 linears (issue 37) against bf16 on one GPU, dummy weights, both in the same run.

``PYTHONPATH=src python benchmarks/fp8_bench.py [--out FILE.json] [--model llama-3-8b]``

Per weight format (bf16, ``--quantization fp8``), one engine each (CUDA graphs on):

* ``decode_step_ms``: the captured decode graph at batch 1, context 512 (target for FP8 on
  an H100: <= 3.5 ms);
* ``prefill_8192_s``: one prompt of 8192 tokens, one output token (wall, after a warm-up);
* ``throughput``: 64 prompts of 512 tokens -> 256 output tokens, output tokens/s.

Also per-projection GEMM times (CUDA events, median) at M = 1, 16, 64 and 8192 on the
model's shapes: bf16 ``F.linear``/skinny vs each FP8 path. Writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.nn.functional as F


def _ms(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def gemm_rows():
    from attnserve.models.layers.quantization.fp8_kernels import quantize_activation, scaled_fp8_gemm
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_block, quantize_per_row
    from attnserve.models.layers.skinny_gemm import skinny_linear, skinny_linear_fp8

    rows = []
    for name, n, k in [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_per_row(w)
        bq, bs = quantize_per_block(w)
        for m in (1, 16, 64, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = {"proj": name, "n": n, "k": k, "m": m}
            r["bf16_ms"] = _ms(lambda: skinny_linear(x, w) if m <= 16 else F.linear(x, w))
            if m <= 16:
                r["fp8_skinny_w8a16_ms"] = _ms(lambda: skinny_linear_fp8(x, wq, ws))
            r["fp8_act_quant_ms"] = _ms(lambda: quantize_activation(x))

            def smm():
                q, s = quantize_activation(x)
                return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)

            r["fp8_scaled_mm_ms"] = _ms(smm)
            r["fp8_triton_channel_ms"] = _ms(lambda: scaled_fp8_gemm(*quantize_activation(x), wq, ws, torch.bfloat16))
            r["fp8_triton_block_ms"] = _ms(lambda: scaled_fp8_gemm(*quantize_activation(x, 128), bq, bs,
                                                                   torch.bfloat16))
            rows.append(r)
            print(json.dumps(r), flush=True)
        del w, wq, bq
    return rows


def engine_rows(model, quantization):
    from attnserve.bench.offline import _timed_generate, graph_step_ms
    from attnserve.engine.llm import LLM
    from attnserve.engine.sampling_params import SamplingParams

    t0 = time.time()
    llm = LLM(model, load_format="dummy", device="cuda", context_length=8192 + 64, max_running_requests=64,
              quantization=quantization)
    runner = llm.engine.model_runner
    row = {"model": model, "quantization": quantization or "bf16", "load_s": time.time() - t0,
           "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
           "peak_gib_after_load": torch.cuda.max_memory_allocated() / 2**30}
    row["decode_step_ms"] = graph_step_ms(runner, 1, 512)
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    long = [torch.randint(1, vocab, (8192,), generator=gen).tolist()]
    llm.generate(long, one)
    row["prefill_8192_s"] = min(_timed_generate(llm, long, one)[0] for _ in range(2))
    prompts = [torch.randint(1, vocab, (512,), generator=gen).tolist() for _ in range(64)]
    sp = SamplingParams(max_new_tokens=256, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    wall, _ = _timed_generate(llm, prompts, sp)
    row["throughput_64x512_256_tok_s"] = 64 * 256 / wall
    print(json.dumps(row), flush=True)
    llm.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--out", default="fp8_bench.json")
    ap.add_argument("--skip-gemm", action="store_true")
    args = ap.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "engine": []}
    for q in (None, "fp8"):
        result["engine"].append(engine_rows(args.model, q))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    bf, f8 = result["engine"]
    result["fp8_over_bf16"] = {"decode_step": bf["decode_step_ms"] / f8["decode_step_ms"],
                               "prefill_8192": bf["prefill_8192_s"] / f8["prefill_8192_s"],
                               "throughput": f8["throughput_64x512_256_tok_s"] / bf["throughput_64x512_256_tok_s"]}
    print(json.dumps(result["fp8_over_bf16"]), flush=True)
    if not args.skip_gemm:
        result["gemm"] = gemm_rows()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
