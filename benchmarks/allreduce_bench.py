"""All-reduce latency per message size: custom one-shot / two-shot vs NCCL, on N GPUs of one host.

``PYTHONPATH=src python benchmarks/allreduce_bench.py [--world-size 2] [--out benchmarks/results]``

Spawns one process per GPU (NCCL device group, gloo CPU group, NVLink multicast off), builds
`CustomAllReduce` with a buffer as large as the largest message, and for each bfloat16
message size from 1 KB to 64 MB times, on rank 0:

* ``*_graph_us``: median µs per call of a captured CUDA graph of ``--calls`` in-place
  all-reduces (how decode steps run them; the launch cost is gone), over ``--replays``
  replays, each queued behind an untimed replay (the ranks' host skew stays out);
* ``*_eager_us``: the same calls launched from Python (prefill, warm-up), after one untimed call.

``suggested`` picks the thresholds of `default_config` from the graph times: one-shot up to
the largest size below which it is never more than 5% slower than the fastest, two-shot up to
the largest size below which the custom paths beat NCCL. Writes
``<out>/<device>-allreduce-<date>.json`` (date, device, torch / NCCL / CUDA versions).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

SIZES = [1024 << i for i in range(17)]  # 1 KB .. 64 MB
ALGOS = ("nccl", "one_shot", "two_shot")
#: environment variables recorded with the result (NCCL's transport and algorithm choices)
ENV_KEYS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_P2P_LEVEL", "NCCL_CUMEM_ENABLE",
            "NCCL_PROTO", "NCCL_ALGO", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_MIN_NCHANNELS")


def _time_graph(fn, refill, calls: int, replays: int) -> float:
    """Median µs per call of a graph of ``calls`` calls of ``fn``. Each timed replay is queued
    right behind an untimed one, so its start event fires when that replay's last collective
    has completed on every rank: the ranks' host skew stays out of the timing."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for i in range(replays + 2):
        refill()
        graph.replay()  # aligns the ranks
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def _time_eager(fn, refill, calls: int, replays: int) -> float:
    times = []
    for i in range(replays + 2):
        refill()
        fn()  # aligns the ranks on the device
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    from common import init_rank
    from attnserve.distributed.custom_all_reduce import CustomAllReduceConfig, init_custom_all_reduce

    device, group, cpu_group = init_rank(rank, world_size, port)
    biggest = max(SIZES)
    custom = init_custom_all_reduce(rank, world_size, group, cpu_group, device,
                                    config=CustomAllReduceConfig(biggest, biggest))
    if custom is None:
        raise SystemExit("custom all-reduce unavailable here (see the log)")
    configs = {"one_shot": CustomAllReduceConfig(biggest, biggest), "two_shot": CustomAllReduceConfig(0, biggest)}
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    rows = []
    for nbytes in [b for b in SIZES if b >= args.min_bytes]:
        n = nbytes // 2
        # tiny values: 2 * calls + 1 in-place doublings per timing stay finite (and normal)
        src = (torch.randn(n, generator=gen, device=device, dtype=torch.float32) * 2.0 ** -100).to(torch.bfloat16)
        x = src.clone()

        def refill():
            x.copy_(src)

        row = {"bytes": nbytes}
        for algo in ALGOS:
            if algo == "nccl":
                def fn():
                    dist.all_reduce(x, group=group)
            else:
                custom.config = configs[algo]
                assert custom.select(x) == algo, (algo, custom.select(x))

                def fn():
                    custom.all_reduce(x)
            dist.barrier(group=cpu_group)
            torch.cuda.synchronize()
            row[f"{algo}_graph_us"] = _time_graph(fn, refill, args.calls, args.replays)
            dist.barrier(group=cpu_group)
            row[f"{algo}_eager_us"] = _time_eager(fn, refill, args.calls, args.replays)
        rows.append(row)
        if rank == 0:
            print(f"{nbytes:>10} B  " + "  ".join(f"{a} {row[f'{a}_graph_us']:8.2f}" for a in ALGOS), flush=True)
    if rank == 0:
        queue.put(rows)
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def suggest(rows, slack: float = 1.05) -> dict:
    """Thresholds from the graph times (rows in ascending size; see the module docstring)."""
    one_max = 0
    for r in rows:
        if r["one_shot_graph_us"] > min(r[f"{a}_graph_us"] for a in ALGOS) * slack:
            break
        one_max = r["bytes"]
    two_max = one_max
    for r in rows:
        if r["bytes"] <= one_max:
            continue
        if r["two_shot_graph_us"] >= r["nccl_graph_us"]:
            break
        two_max = r["bytes"]
    return {"one_shot_max_bytes": one_max, "two_shot_max_bytes": two_max}


def main() -> None:
    from common import check_world_size, multi_gpu_parser, multi_gpu_result, run_ranks

    p = multi_gpu_parser(__doc__, 2)
    p.add_argument("--calls", type=int, default=48, help="all-reduces per timed graph / eager loop")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--min-bytes", type=int, default=0, help="time only the sizes from this many bytes up")
    p.add_argument("--tag", default="", help="appended to the JSON's name (e.g. an NCCL environment variant)")
    args = p.parse_args()
    check_world_size(args.world_size)
    t0 = time.perf_counter()
    from attnserve.bench.results import write_result

    rows = run_ranks(_rank_main, args.world_size, args)
    result = multi_gpu_result("allreduce", t0, args.world_size)
    result.update({"dtype": "bfloat16", "calls": args.calls, "replays": args.replays,
                   "env": {k: os.environ.get(k) for k in ENV_KEYS},
                   "rows": rows, "suggested": suggest(rows)})
    print(f"{'bytes':>10}  " + "  ".join(f"{a + ' graph':>15}" for a in ALGOS) + "  " +
          "  ".join(f"{a + ' eager':>15}" for a in ALGOS))
    for r in rows:
        print(f"{r['bytes']:>10}  " + "  ".join(f"{r[f'{a}_graph_us']:15.2f}" for a in ALGOS) + "  " +
              "  ".join(f"{r[f'{a}_eager_us']:15.2f}" for a in ALGOS))
    print("suggested:", result["suggested"])
    write_result(result, args.out, "allreduce" + (f"-{args.tag}" if args.tag else ""))


if __name__ == "__main__":
    sys.exit(main())
