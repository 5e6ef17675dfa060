"""Fused all-reduce + residual add + RMSNorm: pull vs push ("Lamport") vs two-shot kernel, µs per call, on N GPUs.

``PYTHONPATH=src python benchmarks/fused_allreduce_bench.py [--world-size 4 [2 ...]] [--out DIR]``

Spawns one process per GPU (NCCL device group, gloo CPU group, NVLink multicast off) with
``ATTNSERVE_ALLREDUCE_FUSION_MODE=push``, so `CustomAllReduce` holds both kernels' regions
(the pull kernel runs on the same buffers with its own counters), and a second one with
``twoshot`` for the two-shot kernel. For bfloat16 rows of hidden 4096 (Llama-3-8B) and 8192
(Llama-3-70B) x ``--rows`` (default 1, 8, 64, 128, 256), on rank 0:

* ``pull_us`` / ``push_us`` / ``twoshot_us``: median µs per call of a captured CUDA graph of
  ``--calls`` fused launches (`fused_all_reduce` / `fused_all_reduce_push` /
  `fused_all_reduce_two_shot`, the last called directly at every size, whatever its
  threshold), over ``--replays`` replays, each queued behind an untimed replay
  (``allreduce_bench._time_graph``);
* ``unfused_us``: PyTorch's one-shot all-reduce then ``fused_add_rmsnorm`` (two launches), the
  path without fusion;
* ``push_s<k>_us`` for each ``--push-splits k``: the push kernel with rows cut into at most
  ``k`` programs (``ATTNSERVE_PUSH_ROW_SPLITS=k``; ``push_s1`` is one program a row), with
  ``push_s<k>_splits`` the programs a row it used and ``push_s<k>_equals_pull`` its bits check
  (at two ranks the kernel keeps one program a row whatever ``k``: `fused_all_reduce_push.row_splits`);
* ``push_equals_pull`` / ``twoshot_equals_pull``: one eager call of each on the same inputs
  gave the pull kernel's bits (push: up to the sign of zeros; two-shot: exactly), on every rank;
* ``twoshot_speedup``: ``pull_us / twoshot_us`` (above 1: two-shot is faster; the size where it
  passes 1 is the ``ATTNSERVE_TWO_SHOT_FUSED_MIN_KB`` to use).

Prints a table per world size and writes ``<out>/<device>-fused-allreduce-<date>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_bench import _time_graph  # noqa: E402
from common import run_ranks  # noqa: E402

HIDDENS = (4096, 8192)
MODES = ("pull", "push", "twoshot", "unfused")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ["ATTNSERVE_ALLREDUCE_FUSION_MODE"] = "push"
    import torch.distributed as dist

    from common import init_rank
    from attnserve.distributed.custom_all_reduce import CustomAllReduceConfig, init_custom_all_reduce
    from attnserve.distributed.fused_all_reduce import fused_all_reduce_add_rmsnorm
    from attnserve.distributed.fused_all_reduce_push import row_splits
    from attnserve.distributed.fused_all_reduce_two_shot import fused_all_reduce_add_rmsnorm_two_shot
    from attnserve.models.layers.fused_kernels import fused_add_rmsnorm

    device, group, cpu_group = init_rank(rank, world_size, port)
    biggest = max(args.rows) * max(HIDDENS) * 2
    custom = init_custom_all_reduce(rank, world_size, group, cpu_group, device,
                                    config=CustomAllReduceConfig(biggest, biggest))
    if custom is None or custom.fusion is None or custom.fusion.mode != "push":
        raise SystemExit("custom all-reduce / push fusion unavailable here (see the log)")
    f = custom.fusion
    os.environ["ATTNSERVE_ALLREDUCE_FUSION_MODE"] = "twoshot"  # a second buffer (every rank: one more rendezvous)
    custom2 = init_custom_all_reduce(rank, world_size, group, cpu_group, device,
                                     config=CustomAllReduceConfig(biggest, biggest))
    if custom2 is None or custom2.fusion is None or custom2.fusion.mode != "twoshot":
        raise SystemExit("two-shot fusion unavailable here (see the log)")
    f2 = custom2.fusion
    pull_counters = torch.zeros(2, dtype=torch.int64, device=device)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    shared = torch.Generator(device=device).manual_seed(99)
    eps = 1e-5
    rows_out = []
    for hidden in HIDDENS:
        w = torch.randn(hidden, generator=shared, device=device).to(torch.bfloat16)
        for rows in args.rows:
            # tiny partial sums: 2 * calls + 1 in-place all-reduces (unfused) stay finite
            src = (torch.randn(rows, hidden, generator=gen, device=device) * 2.0 ** -100).to(torch.bfloat16)
            res_src = torch.randn(rows, hidden, generator=shared, device=device).to(torch.bfloat16)
            x, res = src.clone(), res_src.clone()

            def refill():
                x.copy_(src)
                res.copy_(res_src)

            fns = {
                "pull": lambda: fused_all_reduce_add_rmsnorm(x, res, w, eps, 0.0, f.buffer_ptrs, pull_counters,
                                                             rank, f.region),
                "push": lambda: custom.fused_all_reduce_add_rmsnorm(x, res, w, eps, 0.0),
                "twoshot": lambda: fused_all_reduce_add_rmsnorm_two_shot(x, res, w, eps, 0.0, f2.buffer_ptrs,
                                                                         f2.counters[2:], rank, f2.two_shot),
                "unfused": lambda: (custom.all_reduce(x), fused_add_rmsnorm(x, res, w, eps, 0.0)),
            }
            capped = {f"push_s{k}": dataclasses.replace(f.lamport, max_row_splits=k) for k in args.push_splits}
            for name, lam in capped.items():
                fns[name] = (lambda lam: lambda: fused_all_reduce_add_rmsnorm(
                    x, res, w, eps, 0.0, f.buffer_ptrs, f.counters, rank, f.region, lamport=lam))(lam)
            row = {"hidden": hidden, "rows": rows, "bytes": rows * hidden * 2}
            for name, lam in capped.items():
                row[f"{name}_splits"] = row_splits(rows, hidden, lam.max_row_splits, world_size)[0]
            for mode in MODES + tuple(capped):
                dist.barrier(group=cpu_group)
                torch.cuda.synchronize()
                row[f"{mode}_us"] = _time_graph(fns[mode], refill, args.calls, args.replays)
            # one eager call of each kernel on the same (non-tiny) inputs: the same bits?
            xe = torch.randn(rows, hidden, generator=gen, device=device).to(torch.bfloat16)
            r_pull, r_push, r_two = res_src.clone(), res_src.clone(), res_src.clone()
            o_pull = fused_all_reduce_add_rmsnorm(xe, r_pull, w, eps, 0.0, f.buffer_ptrs, pull_counters, rank,
                                                  f.region)
            o_push = custom.fused_all_reduce_add_rmsnorm(xe, r_push, w, eps, 0.0)
            o_two = fused_all_reduce_add_rmsnorm_two_shot(xe, r_two, w, eps, 0.0, f2.buffer_ptrs, f2.counters[2:],
                                                          rank, f2.two_shot)
            nz = o_pull != 0
            ok = bool(torch.equal(o_pull, o_push) and torch.equal(r_pull, r_push)
                      and torch.equal(_bits(o_pull)[nz], _bits(o_push)[nz]))
            ok2 = bool(torch.equal(_bits(o_pull), _bits(o_two)) and torch.equal(_bits(r_pull), _bits(r_two)))
            for name, lam in capped.items():
                r_k = res_src.clone()
                o_k = fused_all_reduce_add_rmsnorm(xe, r_k, w, eps, 0.0, f.buffer_ptrs, f.counters, rank, f.region,
                                                   lamport=lam)
                ok_k = bool(torch.equal(o_pull, o_k) and torch.equal(r_pull, r_k)
                            and torch.equal(_bits(o_pull)[nz], _bits(o_k)[nz]))
                every = [None] * world_size
                dist.all_gather_object(every, ok_k, group=cpu_group)
                row[f"{name}_equals_pull"] = all(every)
            flags = [None] * world_size
            dist.all_gather_object(flags, (ok, ok2), group=cpu_group)
            row["push_equals_pull"] = all(a for a, _ in flags)
            row["twoshot_equals_pull"] = all(b for _, b in flags)
            row["push_speedup"] = row["pull_us"] / row["push_us"]
            row["twoshot_speedup"] = row["pull_us"] / row["twoshot_us"]
            rows_out.append(row)
            if rank == 0:
                print(f"W {world_size} hidden {hidden:5d} rows {rows:4d}: pull {row['pull_us']:7.2f} us  push "
                      f"{row['push_us']:7.2f} us  twoshot {row['twoshot_us']:7.2f} us  unfused "
                      f"{row['unfused_us']:7.2f} us  equal {row['push_equals_pull']} {row['twoshot_equals_pull']}"
                      + "".join(f"  {n} ({row[n + '_splits']}) {row[n + '_us']:.2f}"
                                f"{'' if row[n + '_equals_pull'] else ' DIFF'}" for n in capped),
                      flush=True)
    if rank == 0:
        queue.put(rows_out)
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def _run_world(world_size: int, args) -> list:
    return run_ranks(_rank_main, world_size, args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, nargs="+", default=[torch.cuda.device_count()])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128, 256])
    p.add_argument("--calls", type=int, default=48, help="fused launches per timed graph")
    p.add_argument("--push-splits", type=int, nargs="*", default=[1, 2, 4, 8, 16],
                   help="caps on the programs a row of the push kernel (one column each)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    for w in args.world_size:
        if w < 2 or torch.cuda.device_count() < w:
            raise SystemExit(f"world size {w}: needs 2 <= it <= GPUs ({torch.cuda.device_count()})")
    t0 = time.perf_counter()
    from attnserve.bench.results import cuda_run_metadata, write_result

    result = {"dtype": "bfloat16", "calls": args.calls, "replays": args.replays, "worlds": {}}
    for w in args.world_size:
        result["worlds"][str(w)] = _run_world(w, args)
    result.update(cuda_run_metadata("fused-allreduce", t0))
    result["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"{'W':>2} {'hidden':>6} {'rows':>5} {'bytes':>8} {'pull us':>8} {'push us':>8} {'2shot us':>8} "
          f"{'unfused':>8} {'pull/push':>9} {'pull/2shot':>10} {'equal':>11}")
    for w, rows in result["worlds"].items():
        for r in rows:
            print(f"{w:>2} {r['hidden']:>6} {r['rows']:>5} {r['bytes']:>8} {r['pull_us']:8.2f} {r['push_us']:8.2f} "
                  f"{r['twoshot_us']:8.2f} {r['unfused_us']:8.2f} {r['push_speedup']:9.2f} "
                  f"{r['twoshot_speedup']:10.2f} {str(r['push_equals_pull']):>5} {str(r['twoshot_equals_pull']):>5}")
    write_result(result, args.out, "fused-allreduce")
    ok = all(r["push_equals_pull"] and all(r[f"push_s{k}_equals_pull"] for k in args.push_splits)
             for rows in result["worlds"].values() for r in rows)
    ok2 = all(r["twoshot_equals_pull"] for rows in result["worlds"].values() for r in rows)
    print("push == pull (bits, up to zero signs):", "PASS" if ok else "FAIL")
    print("twoshot == pull (bits):", "PASS" if ok2 else "FAIL")
    return 0 if ok and ok2 else 1


if __name__ == "__main__":
    sys.exit(main())
