"""``bench.offline --dataset random``: SGLang's random workload, timed against its roofline.

``python -m attnserve.bench.offline --dataset random --load-format dummy --device cuda
--models llama-3-8b qwen3-0.6b --num-prompts 256 --random-input-len 1024
--random-output-len 1024 --random-range-ratio 0.098 [--kv-cache-dtypes auto fp8_e4m3]
[--max-running-requests N] [--cuda-graph-max-bs N]``

Per model shape and KV cache dtype, one engine with the default limits (unless flags are
given): the workload (random token ids, input lengths uniform in ``[R * N, N]``, output
lengths in ``[R * M, M]``, ``ignore_eos``, greedy, seeded) runs once with other prompts of
the same lengths as a warm-up (outputs capped at ``--warmup-output-len``, default 32), the
prefix cache is flushed, then the workload is timed, first with one output token each
(``prefill_wall_s``; ``prefill_share`` is the prefill floor over it, ``decode_share`` the
decode floor over the rest of the wall time), then whole. Each row reports
``output_tokens_per_s``, ``total_tokens_per_s`` (prompt + output tokens / wall),
``roofline_s`` (the floor of `attnserve.bench.roofline`, from the copy and matmul rates
measured at the start of the same run), ``roofline_share = roofline_s / wall_s``, the
limits the engine chose, and the scheduler's counters (decode steps, mean decode batch,
host ms per decode step, retractions).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from attnserve.bench.roofline import RooflineModel, random_lengths, workload_roofline
from attnserve.bench.roofline_capacity import capacity_decode_s


def measure_device_rates() -> Dict[str, float]:
    """``copy_bytes_per_s`` (device-to-device copy of 1 GiB, bytes read + written) and
    ``matmul_flops_per_s`` (bf16 8192^3 ``torch.matmul``), and on sm 89+ ``fp8_matmul_flops_per_s``
    (e4m3 8192^3 ``torch._scaled_mm``, bf16 out), medians of ``triton.testing.do_bench``."""
    import triton.testing

    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    copy_ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    copy = 2 * a.numel() * a.element_size() / (copy_ms * 1e-3)
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: torch.matmul(x, y), warmup=25, rep=200, return_mode="median")
    rates = {"copy_bytes_per_s": copy, "matmul_flops_per_s": 2 * m**3 / (mm_ms * 1e-3)}
    if torch.cuda.get_device_capability() >= (8, 9):  # e4m3 tensor cores (sm 89+)
        x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda")
        mm8_ms = triton.testing.do_bench(lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16),
                                         warmup=25, rep=200, return_mode="median")
        rates["fp8_matmul_flops_per_s"] = 2 * m**3 / (mm8_ms * 1e-3)
        del x8, y8
    del x, y
    torch.cuda.empty_cache()
    return rates


def _prompts(vocab: int, lens: List[int], seed: int) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lens]


def run_random_workload(llm, input_lens: List[int], output_lens: List[int], seed: int,
                        warmup_output_len: int = 32) -> dict:
    """Warm up with other prompts of the same lengths, then time the workload.

    Returns:
        ``wall_s``, token counts and the scheduler's counters of the timed pass.
    """
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.engine.scheduler import SchedulerStats

    vocab = llm.engine.model_config.vocab_size
    warm = [SamplingParams(max_new_tokens=min(n, warmup_output_len), temperature=0.0, ignore_eos=True)
            for n in output_lens]
    llm.generate(_prompts(vocab, input_lens, seed + 1), warm)
    prompts = _prompts(vocab, input_lens, seed)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    sched = llm.engine.scheduler
    runner = llm.engine.model_runner
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(sp):
        sched.flush_prefix_cache()
        sched.stats = SchedulerStats()
        sync()
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp)
        sync()
        return time.perf_counter() - t0, res

    prefill_wall, _ = timed(SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    eager0 = runner.eager_decode_steps
    wall, outs = timed(params)
    eager = runner.eager_decode_steps - eager0
    generated = sum(len(o.token_ids) for o in outs)
    if generated != sum(output_lens):
        raise RuntimeError(f"generated {generated} tokens, expected {sum(output_lens)} (ignore_eos)")
    stats = sched.stats
    steps = max(stats.num_decode_steps, 1)
    return {
        "wall_s": wall, "prefill_wall_s": prefill_wall, "input_tokens": sum(input_lens), "output_tokens": generated,
        "decode_steps": stats.num_decode_steps,
        "mean_decode_batch": (generated - len(outs)) / steps,
        "host_ms_per_step": stats.host_ms_per_decode_step, "retractions": stats.num_retractions,
        "eager_decode_steps": eager, "wait_ms_per_step": 1e3 * stats.wait_seconds / max(stats.num_steps, 1),
    }


def bench_random(model: str, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                 seed: int, rates: Dict[str, float], kv_cache_dtype: str = "auto", load_format: str = "dummy",
                 device: str = "cuda", warmup_output_len: int = 32, **engine_flags) -> dict:
    """One row: build the engine (default limits unless ``engine_flags`` set them), run the
    workload, compare with its roofline (``rates`` from `measure_device_rates`; empty: no floor)."""
    from attnserve.engine.llm import LLM

    isl, osl = random_lengths(num_prompts, input_len, output_len, range_ratio, seed)
    flags = {k: v for k, v in engine_flags.items() if v is not None}
    llm = LLM(model, load_format=load_format, device=device, kv_cache_dtype=kv_cache_dtype, **flags)
    try:
        runner = llm.engine.model_runner
        res = run_random_workload(llm, isl, osl, seed, warmup_output_len)
        limits = runner.serving_limits
        row = {
            "model": model, "kv_cache_dtype": str(runner.kv_cache_dtype).replace("torch.", ""),
            "flags": flags, "num_prompts": num_prompts, "random_input_len": input_len,
            "random_output_len": output_len, "random_range_ratio": range_ratio, "seed": seed,
            "max_total_tokens": limits.max_total_tokens, "max_running_requests": limits.max_running_requests,
            "chunked_prefill_size": limits.chunked_prefill_size, "cuda_graph_max_bs": limits.cuda_graph_max_bs,
            **res,
            "output_tokens_per_s": res["output_tokens"] / res["wall_s"],
            "total_tokens_per_s": (res["input_tokens"] + res["output_tokens"]) / res["wall_s"],
            "roofline_s": None, "roofline_share": None,
        }
        if rates:
            rm = RooflineModel.from_runner(runner)
            floor = workload_roofline(rm, isl, osl, rates["copy_bytes_per_s"], rates["matmul_flops_per_s"],
                                      rates.get("fp8_matmul_flops_per_s"))
            cap_decode, _ = capacity_decode_s(rm, isl, osl, rates["copy_bytes_per_s"], rates["matmul_flops_per_s"],
                                              limits.max_total_tokens, limits.max_running_requests,
                                              rates.get("fp8_matmul_flops_per_s"))
            row.update(roofline_s=floor.roofline_s, roofline_prefill_s=floor.prefill_s,
                       roofline_decode_s=floor.decode_s, roofline_share=floor.roofline_s / res["wall_s"],
                       roofline_serial_s=floor.roofline_serial_s,
                       serial_share=floor.roofline_serial_s / res["wall_s"],
                       roofline_capacity_s=floor.prefill_s + cap_decode,
                       capacity_share=(floor.prefill_s + cap_decode) / res["wall_s"],
                       prefill_share=floor.prefill_s / res["prefill_wall_s"],
                       decode_share=floor.decode_s / max(res["wall_s"] - res["prefill_wall_s"], 1e-9),
                       params=rm.params, weight_bytes=rm.weight_bytes)
        return row
    finally:
        llm.shutdown()  # gives back the GPU memory for the next row's engine


#: `format_row` prints the capacity share when the pool's floor is this far above the rule's
#: (a 0.5% difference shows at two decimals of the share)
CAPACITY_SHOWN_ABOVE = 1.005
#: `capacity_note` explains the gap when it is this large (a gap the user should act on)
CAPACITY_NOTE_ABOVE = 1.05


def format_row(row: dict) -> str:
    share = "n/a" if row["roofline_share"] is None else (
        f"{row['roofline_share']:.2f} (prefill {row['prefill_share']:.2f}, decode {row['decode_share']:.2f}; "
        f"serial floor {row['serial_share']:.2f}"
        + (f"; capacity floor {row['capacity_share']:.2f}"
           if row.get("capacity_share") and row["capacity_share"] > CAPACITY_SHOWN_ABOVE * row["roofline_share"]
           else "") + ")")
    floor = "n/a" if row["roofline_s"] is None else f"{row['roofline_s']:.2f}"
    return (f"{row['model']:12s} {row['kv_cache_dtype']:13s} n={row['num_prompts']:4d} "
            f"in<={row['random_input_len']} out<={row['random_output_len']} R={row['random_range_ratio']} "
            f"flags={row['flags'] or '-'}: {row['output_tokens_per_s']:9.0f} out tok/s "
            f"{row['total_tokens_per_s']:9.0f} total tok/s wall {row['wall_s']:.2f} s floor {floor} s "
            f"share {share} (mrr {row['max_running_requests']}, graphs {row['cuda_graph_max_bs']}, "
            f"batch {row['mean_decode_batch']:.1f}, host {row['host_ms_per_step']:.2f} ms/step, "
            f"eager decode steps {row.get('eager_decode_steps', 0)}/{row['decode_steps']}, "
            f"retractions {row['retractions']})")


def capacity_note(row: dict) -> Optional[str]:
    """A hint for a row whose KV pool cannot hold its workload (capacity floor more than
    `CAPACITY_NOTE_ABOVE` times the rule's floor, `attnserve.bench.roofline_capacity`), else None."""
    cap, floor = row.get("roofline_capacity_s"), row.get("roofline_s")
    if not cap or not floor or cap <= CAPACITY_NOTE_ABOVE * floor:
        return None
    tokens = row["input_tokens"] + row["output_tokens"]
    return (f"{row['model']}: the workload's {tokens:,} tokens do not fit the {row['max_total_tokens']:,}-token KV pool, "
            f"so requests decode in smaller batches than the roofline assumes (capacity floor {cap:.2f} s, rule "
            f"{floor:.2f} s); a larger pool (--kv-cache-dtype fp8_e4m3, --quantization fp8, --mem-fraction-static) "
            "raises the batch")


def main_random(args) -> int:
    """``--dataset random`` (see the module docstring); writes ``<out>/<device>-offline-<date>.json``."""
    import datetime as dt

    from attnserve.bench.results import write_result

    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    rates = measure_device_rates() if cuda else {}
    if rates:
        print(f"ceilings: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {rates['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
              + (f", fp8 matmul {rates['fp8_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
                 if "fp8_matmul_flops_per_s" in rates else ""), flush=True)
    models = args.models if args.load_format == "dummy" else [args.model]
    rows = []
    from attnserve.bench.offline_dp import add_speedups, bench_random_dp, format_dp_row, speedup_note

    for kv_dtype in args.kv_cache_dtypes:
        for m in models:
            for dp in getattr(args, "dp_size", None) or [1]:
                common = dict(load_format="dummy" if args.load_format == "dummy" else "auto",
                              device="cuda" if cuda else "cpu", warmup_output_len=args.warmup_output_len or 32,
                              max_running_requests=args.max_running_requests,
                              cuda_graph_max_bs=args.cuda_graph_max_bs,
                              chunked_prefill_size=args.chunked_prefill_size, tp_size=getattr(args, "tp_size", None),
                              quantization=getattr(args, "quantization", None))
                if dp > 1:  # replicas in engine processes (bench/offline_dp.py)
                    row = bench_random_dp(m, args.num_prompts, args.random_input_len, args.random_output_len,
                                          args.random_range_ratio, args.seed, dp, kv_dtype, rates=rates, **common)
                    add_speedups(rows + [row])
                    print(format_dp_row(row), flush=True)
                else:
                    row = dict(bench_random(m, args.num_prompts, args.random_input_len, args.random_output_len,
                                            args.random_range_ratio, args.seed, rates, kv_dtype, **common), dp_size=1)
                    print(format_row(row), flush=True)
                    note = capacity_note(row)
                    if note:
                        print(note, flush=True)
                rows.append(row)
    add_speedups(rows)
    for row in rows:
        if "speedup_vs_dp1" in row:
            print(f"{row['model']} dp {row['dp_size']} output tok/s: {speedup_note(row)}", flush=True)
    result = {"benchmark": "offline", "mode": "random", "date": dt.date.today().isoformat(),
              "torch": torch.__version__, **({k: v for k, v in rates.items()}), "rows": rows}
    if cuda:
        import triton
        import transformers

        result.update(device=torch.cuda.get_device_name(), triton=triton.__version__, cuda=torch.version.cuda,
                      transformers=transformers.__version__)
    kind = "offline-random" + (f"-{args.tag}" if args.tag else "")
    write_result(result, args.out, kind, "cuda" if cuda else "cpu")
    return 0
