"""How well a prefill GEMM and an NCCL all-reduce overlap on two streams, with and without an SM carveout.

``PYTHONPATH=src:benchmarks python benchmarks/allreduce_gemm_overlap.py [--world-size 2] [--tokens 8192]``

Question (issue 38, the tp prefill): the token-halves overlap of `tp_prefill_overlap` hid only
~3.5% of a tp 4 prefill on four H200s although its all-reduces were a third of it. Hypothesis:
cuBLAS's prefill GEMMs fill every SM with resident CTAs, so NCCL's CTAs (one per channel) are
only scheduled between GEMMs and the two streams run one after the other. PyTorch's
``torch._C._set_sm_carveout_experimental(n)`` asks cuBLAS to leave ``n`` SMs free (PyTorch's
async tensor parallel uses it for the same reason).

One process per GPU (NCCL device group, NVLink multicast off). Per carveout (``--carveouts``;
``none`` = PyTorch's default) rank 0 times, in ms over ``--reps`` repetitions (median):

* ``gemm_ms``: ``--gemms`` prefill GEMMs ``[tokens, hidden] @ [hidden, --gemm-n]`` (bf16,
  ``F.linear``: the engine's bf16 prefill path) on the compute stream;
* ``ar_ms``: ``--ars`` NCCL all-reduces of ``[tokens, hidden]`` bf16 on a side stream;
* ``both_ms``: both at once, each on its stream, as `tp_prefill_overlap` issues them;
* ``hidden_share``: ``(gemm_ms + ar_ms - both_ms) / min(gemm_ms, ar_ms)``: 1 = the shorter
  one fully hidden, 0 = serialised.

Writes ``<out>/<device>-x<world>-allreduce-gemm-overlap-<date>.json``.

Result (two H200s, 2026-11-28, ``results/h200x2-allreduce-gemm-overlap-carveout-*``): the
carveout does not reach these GEMMs: 8 GEMMs of 16,384 x 4,096 x 14,336 took 21.9 ms with none
and 23.1 ms with 66 of 132 SMs "left free" (a compute-bound GEMM on half the SMs would take
twice as long), so the ``both`` times move only with run-to-run noise (hidden share -0.3 to
1.2 between neighbouring rows). PyTorch applies the carveout in its cuBLASLt path only
(``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``), hence ``--blas``: each carveout is timed under
each preferred BLAS library. A tp 2 engine with the carveout around its overlapped prefill
(prototype, not kept) ran its 64 x 512 prefill in 0.474 / 0.472 / 0.485 / 0.474 s (overlap
off / on / on + 16 SMs / on + 32 SMs).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch


def _carveout_value(text: str):
    return None if text == "none" else int(text)


def _timed(fn, reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` runs, each after a device-wide sync (one untimed run first)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from common import init_rank

    device, group, cpu_group = init_rank(rank, world_size, port)
    gen = torch.Generator(device=device).manual_seed(7 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    w = torch.randn(args.gemm_n, args.hidden, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
    y = torch.empty(args.tokens, args.gemm_n, device=device, dtype=torch.bfloat16)
    msg = (torch.randn(args.tokens, args.hidden, generator=gen, device=device) * 2.0 ** -60).to(torch.bfloat16)
    side = torch.cuda.Stream(device=device)
    main = torch.cuda.current_stream(device)

    def gemms():
        for _ in range(args.gemms):
            torch.mm(x, w.t(), out=y) if not args.linear else F.linear(x, w)

    def ars():
        for _ in range(args.ars):
            dist.all_reduce(msg, group=group)

    def ar_side():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ars()
        main.wait_stream(side)

    def both():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ars()
        gemms()
        main.wait_stream(side)

    rows = []
    for blas, text in [(b, c) for b in args.blas for c in args.carveouts]:
        torch.backends.cuda.preferred_blas_library(blas)
        torch._C._set_sm_carveout_experimental(_carveout_value(text))
        row = {"blas": blas, "carveout": text}
        for name, fn in (("gemm_ms", gemms), ("ar_ms", ar_side), ("both_ms", both)):
            dist.barrier(group=cpu_group)
            row[name] = _timed(fn, args.reps)
        row["hidden_share"] = (row["gemm_ms"] + row["ar_ms"] - row["both_ms"]) / min(row["gemm_ms"], row["ar_ms"])
        rows.append(row)
        if rank == 0:
            print(f"{blas:>8} carveout {text:>5}: gemm {row['gemm_ms']:8.3f} ms  all-reduce {row['ar_ms']:8.3f} ms  "
                  f"both {row['both_ms']:8.3f} ms  hidden {row['hidden_share']:.2f}", flush=True)
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("default")
    if rank == 0:
        queue.put(rows)
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def main() -> None:
    from common import check_world_size, multi_gpu_parser, multi_gpu_result, run_ranks

    p = multi_gpu_parser(__doc__, 2)
    p.add_argument("--tokens", type=int, default=8192, help="rows of the GEMM and of the all-reduce message")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--gemm-n", type=int, default=7168, help="GEMM output columns (Llama-3-8B gate_up at tp 4)")
    p.add_argument("--gemms", type=int, default=8)
    p.add_argument("--ars", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--linear", action="store_true", help="F.linear instead of torch.mm(out=)")
    p.add_argument("--blas", nargs="+", default=["cublas", "cublaslt"],
                   help="torch.backends.cuda.preferred_blas_library values to time (the carveout needs cublaslt)")
    p.add_argument("--carveouts", nargs="+", default=["none", "8", "16", "24", "32"])
    args = p.parse_args()
    check_world_size(args.world_size)
    t0 = time.perf_counter()
    from attnserve.bench.results import write_result

    rows = run_ranks(_rank_main, args.world_size, args)
    result = multi_gpu_result("allreduce_gemm_overlap", t0, args.world_size)
    result.update({"tokens": args.tokens, "hidden": args.hidden, "gemm_n": args.gemm_n, "gemms": args.gemms,
                   "ars": args.ars, "message_mib": args.tokens * args.hidden * 2 / 2 ** 20,
                   "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_MIN_NCHANNELS",
                                                          "NCCL_MAX_NCHANNELS", "NCCL_PROTO")},
                   "rows": rows})
    write_result(result, args.out, f"x{args.world_size}-allreduce-gemm-overlap")


if __name__ == "__main__":
    sys.exit(main())
