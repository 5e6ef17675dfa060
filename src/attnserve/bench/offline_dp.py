"""``bench.offline --dataset random --dp-size N ...``: the random workload over N replicas.

``python -m attnserve.bench.offline --dataset random --load-format dummy --device cuda
--models llama-3-8b --num-prompts 1024 --random-input-len 1024 --random-output-len 1024
--random-range-ratio 0.098 --dp-size 1 2``

Each ``--dp-size`` value is a row: 1 is `attnserve.bench.offline_random.bench_random` (one
engine in this process, with its roofline); N > 1 is `bench_random_dp`: N engine processes
(`attnserve.server.data_parallel_llm.DataParallelLLM`, replica i on GPUs [i*tp, (i+1)*tp)),
the same workload, warm-up and timing (prefix caches flushed before each timed pass, a
prefill-only pass with one output token, then the whole workload). A dp row reports
``output_tokens_per_s``, ``total_tokens_per_s``, the requests each replica took, and
``speedup_vs_dp1`` when a dp 1 row of the same model and KV dtype ran in the same run.
Its floor is the slowest replica's: the replicas run at once on GPUs of one kind, so
``roofline_s`` is the largest `attnserve.bench.roofline.workload_roofline` over the request
subsets the replicas took (from replica 0's model facts and the rates measured in this
process, on GPU 0); null without rates. The balancer weighs requests by their share of
that floor at the rates measured here (`attnserve.distributed.dp_request_cost.RequestCost`;
nominal H100 rates without them); ``replica_wall_s`` is when each replica's last request
ended, from the start of the timed pass.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

from attnserve.bench.offline_random import _prompts
from attnserve.bench.roofline import RooflineModel, random_lengths, workload_roofline
from attnserve.distributed.dp_request_cost import RequestCost


def replicas_roofline(rm: RooflineModel, input_lens: Sequence[int], output_lens: Sequence[int],
                      dp_ranks: Sequence[int], dp_size: int, rates: Dict[str, float]) -> Optional[dict]:
    """The floor of replicas that run at once: each replica's `workload_roofline` of the
    requests it took (``dp_ranks[i]``: request i's replica), and the largest of them.

    Returns:
        ``roofline_s`` (the largest), ``roofline_prefill_s`` / ``roofline_decode_s`` (of that
        replica), ``replica_roofline_s`` (each) and ``roofline_serial_s`` (the largest serial
        floor, `attnserve.bench.roofline`), or None without ``rates``.
    """
    if not rates:
        return None
    floors = []
    for r in range(dp_size):
        idx = [i for i, d in enumerate(dp_ranks) if d == r]
        if not idx:
            floors.append(None)
            continue
        floors.append(workload_roofline(rm, [input_lens[i] for i in idx], [output_lens[i] for i in idx],
                                        rates["copy_bytes_per_s"], rates["matmul_flops_per_s"],
                                        rates.get("fp8_matmul_flops_per_s")))
    done = [f for f in floors if f is not None]
    worst = max(done, key=lambda f: f.roofline_s)
    return {"roofline_s": worst.roofline_s, "roofline_prefill_s": worst.prefill_s,
            "roofline_decode_s": worst.decode_s,
            "replica_roofline_s": [None if f is None else f.roofline_s for f in floors],
            "roofline_serial_s": max(f.roofline_serial_s for f in done)}


def bench_random_dp(model: str, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    dp_size: int, kv_cache_dtype: str = "auto", load_format: str = "dummy", device: str = "cuda",
                    warmup_output_len: int = 32, rates: Optional[Dict[str, float]] = None,
                    **engine_flags) -> dict:
    """One dp row (see the module doc); ``engine_flags`` are `ServerArgs` fields (None: default);
    ``rates``: `attnserve.bench.offline_random.measure_device_rates` (None: no floor).

    Raises:
        RuntimeError: a replica failed, or fewer tokens than asked came back.
    """
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.server.data_parallel_llm import DataParallelLLM

    isl, osl = random_lengths(num_prompts, input_len, output_len, range_ratio, seed)
    flags = {k: v for k, v in engine_flags.items() if v is not None}
    with DataParallelLLM(model, load_format=load_format, device=device, kv_cache_dtype=kv_cache_dtype,
                         dp_size=dp_size, **flags) as llm:
        vocab = llm.engine.vocab_size
        if rates:  # weigh requests at this device's rates, not the nominal ones
            llm.controller.request_cost = RequestCost.from_roofline_facts(
                llm.engine.info.get("roofline_model"), rates["copy_bytes_per_s"], rates["matmul_flops_per_s"])
        warm = [SamplingParams(max_new_tokens=min(n, warmup_output_len), temperature=0.0, ignore_eos=True)
                for n in osl]
        llm.generate(_prompts(vocab, isl, seed + 1), warm)
        prompts = _prompts(vocab, isl, seed)
        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in osl]

        def timed(sp) -> tuple:
            llm.flush_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            return time.perf_counter() - t0, outs, t0

        prefill_wall, _, _ = timed(SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        wall, outs, t0 = timed(params)
        generated = sum(o.completion_tokens for o in outs)
        if generated != sum(osl):
            raise RuntimeError(f"generated {generated} tokens, expected {sum(osl)} (ignore_eos)")
        per_replica: List[int] = [0] * dp_size
        replica_wall: List[float] = [0.0] * dp_size
        for o in outs:
            per_replica[o.dp_rank] += 1
            replica_wall[o.dp_rank] = max(replica_wall[o.dp_rank], o.finished_at - t0)
        limits = llm.engine.info
        facts = limits.get("roofline_model")
        floor = None if facts is None else replicas_roofline(
            RooflineModel(**facts), isl, osl, [o.dp_rank for o in outs], dp_size, rates or {})
        row = {
            "model": model, "kv_cache_dtype": llm.controller.state().get("kv_cache_dtype", kv_cache_dtype),
            "flags": flags, "dp_size": dp_size,
            "num_prompts": num_prompts, "random_input_len": input_len, "random_output_len": output_len,
            "random_range_ratio": range_ratio, "seed": seed, "max_total_tokens": llm.engine.max_total_tokens,
            "replica_devices": limits.get("replica_devices"), "requests_per_replica": per_replica,
            "replica_wall_s": replica_wall,
            "wall_s": wall, "prefill_wall_s": prefill_wall, "input_tokens": sum(isl), "output_tokens": generated,
            "output_tokens_per_s": generated / wall, "total_tokens_per_s": (sum(isl) + generated) / wall,
            "roofline_s": None, "roofline_share": None,
        }
        if floor is not None:
            row.update(floor, roofline_share=floor["roofline_s"] / wall, serial_share=floor["roofline_serial_s"] / wall)
        return row


def add_speedups(rows: List[dict]) -> None:
    """``speedup_vs_dp1`` (output tok/s over the dp 1 row of the same model and KV dtype)
    on every dp > 1 row that has one, and, where both rows have floors,
    ``floor_speedup_vs_dp1`` / ``serial_floor_speedup_vs_dp1``: the dp 1 row's
    ``roofline_s`` / ``roofline_serial_s`` over this row's, the speed-up at equal shares of
    the floor / of the serial floor (`attnserve.bench.roofline`).

    The two differ because one engine with all the requests decodes a batch ``dp_size``
    times larger: each step reads the weights once for more tokens, and at such batches the
    linears turn compute-bound, which the floor hides under the attention's memory time and
    the serial floor does not. E.g. 1,024 random Llama-3-8B requests on four H200s: dp 1
    floor 33.25 s (serial 42.38 s), the slowest of 4 replicas 11.10 s (serial ~11.7 s):
    3.0x at equal floor shares, ~3.6x at equal serial shares (benchmarks/NOTES.md,
    2026-11-27 seventh)."""
    base = {(r["model"], r["kv_cache_dtype"]): r for r in rows if r.get("dp_size", 1) == 1}
    for r in rows:
        ref = base.get((r["model"], r["kv_cache_dtype"]))
        if r.get("dp_size", 1) > 1 and ref is not None:
            r["speedup_vs_dp1"] = r["output_tokens_per_s"] / ref["output_tokens_per_s"]
            for key, out in (("roofline_s", "floor_speedup_vs_dp1"),
                             ("roofline_serial_s", "serial_floor_speedup_vs_dp1")):
                if ref.get(key) and r.get(key):
                    r[out] = ref[key] / r[key]


def speedup_note(row: dict) -> str:
    """``"3.38x dp 1; the floors allow 3.00x, the serial floors 3.63x"`` (the parts `add_speedups`
    set on ``row``), or "" on a row without ``speedup_vs_dp1``."""
    if "speedup_vs_dp1" not in row:
        return ""
    floor, serial = row.get("floor_speedup_vs_dp1"), row.get("serial_floor_speedup_vs_dp1")
    return (f"{row['speedup_vs_dp1']:.2f}x dp 1" + (f"; the floors allow {floor:.2f}x" if floor else "")
            + (f", the serial floors {serial:.2f}x" if serial else ""))


def format_dp_row(row: dict) -> str:
    note = speedup_note(row)
    speed = f" ({note})" if note else ""
    return (f"{row['model']:12s} {row['kv_cache_dtype']:13s} dp={row['dp_size']} n={row['num_prompts']:4d} "
            f"in<={row['random_input_len']} out<={row['random_output_len']} R={row['random_range_ratio']} "
            f"flags={row['flags'] or '-'}: {row['output_tokens_per_s']:9.0f} out tok/s{speed} "
            f"{row['total_tokens_per_s']:9.0f} total tok/s wall {row['wall_s']:.2f} s "
            f"(prefill {row['prefill_wall_s']:.2f} s) requests per replica {row['requests_per_replica']}, "
            f"replica walls {[round(t, 2) for t in row.get('replica_wall_s') or []]} s, "
            f"replica floors {[None if t is None else round(t, 2) for t in row.get('replica_roofline_s') or []]} s, "
            f"share {'n/a' if row['roofline_share'] is None else format(row['roofline_share'], '.2f')}"
            + (f" (serial floor {row['serial_share']:.2f})" if row.get("serial_share") else ""))
