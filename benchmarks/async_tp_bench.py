"""A prefill layer's linears under tensor parallelism: all-reduces against async TP (sequence-parallel
all-gather / reduce-scatter fused into the GEMMs).

``PYTHONPATH=src:benchmarks python benchmarks/async_tp_bench.py [--world-size 4] [--tokens 16384]``

Question (issue 38, the tp prefill): NCCL's all-reduces are a third of a tp 4 prefill of Llama-3-8B
on four H200s (99 of 284 ms of rank 0's kernels, 128 MiB messages), and the token-halves overlap
(`tp_prefill_overlap`) hides little of them because NCCL's CTAs compete with cuBLAS's for SMs.
Async tensor parallelism (PyTorch's ``torch.ops.symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``; the micro-pipelining of Wang et al., "Overlap Communication with
Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS 2023) keeps the
residual stream split by tokens over the ranks and moves each GEMM's input shards / output
partials between ranks with copy-engine copies from symmetric memory while the GEMM works on
the shards already there, so the communication takes no SMs.

One process per GPU. Per ``--tokens`` the Llama-3-8B linears of one layer at ``tp = world``
(``[T, 4096] @ qkv``, the first ``Hq * D / tp`` columns as the attention output, ``@ o``, ``@ gate_up``,
SiLU-and-mul, ``@ down``; no attention kernel, no norms) run three ways, timed in turns (ms,
median of ``--reps``):

* ``allreduce``: full-token GEMMs, an NCCL all-reduce after ``o`` and after ``down`` (today's path);
* ``nccl_sp``: sequence parallel with plain NCCL collectives (all-gather before ``qkv`` and
  ``gate_up``, reduce-scatter after ``o`` and ``down``): the same bytes, no overlap;
* ``async_tp``: sequence parallel with the fused symmetric-memory ops.

Rank 0 also checks that the three give the same ``down`` output rows (bf16; max |diff| against
the largest |value|). Writes ``<out>/<device>-x<world>-async-tp-<date>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    import torch.nn.functional as F

    from common import init_rank

    device, group, cpu_group = init_rank(rank, world_size, port)
    group_name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)
    tp = world_size
    h, inter, hq_d, kv_d = args.hidden, args.intermediate, args.q_dim, args.kv_dim
    gen = torch.Generator(device=device).manual_seed(11 + rank)

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k ** -0.5

    w_qkv = weight((hq_d + 2 * kv_d) // tp, h)
    w_o = weight(h, hq_d // tp)
    w_gu = weight(2 * inter // tp, h)
    w_d = weight(h, inter // tp)
    shared = torch.Generator(device=device).manual_seed(5)
    t = args.tokens
    x_full = torch.randn(t, h, generator=shared, device=device, dtype=torch.bfloat16)
    x_shard = x_full.chunk(tp)[rank].contiguous()
    q_cols = hq_d // tp

    def act(gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    def allreduce_path():
        qkv = x_full @ w_qkv.t()
        o = qkv[:, :q_cols].contiguous() @ w_o.t()
        dist.all_reduce(o, group=group)
        d = act(o @ w_gu.t()) @ w_d.t()
        dist.all_reduce(d, group=group)
        return d.chunk(tp)[rank]

    def nccl_sp_path():
        xg = torch.empty(t, h, device=device, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(xg, x_shard, group=group)
        qkv = xg @ w_qkv.t()
        o = qkv[:, :q_cols].contiguous() @ w_o.t()
        o_sh = torch.empty(t // tp, h, device=device, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(o_sh, o, group=group)
        og = torch.empty(t, h, device=device, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(og, o_sh, group=group)
        d = act(og @ w_gu.t()) @ w_d.t()
        d_sh = torch.empty(t // tp, h, device=device, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(d_sh, d, group=group)
        return d_sh

    def async_tp_path():
        _, (qkv,) = torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [w_qkv.t()], 0, group_name, return_A=False)
        o_sh = torch.ops.symm_mem.fused_matmul_reduce_scatter(qkv[:, :q_cols].contiguous(), w_o.t(), "sum", 0,
                                                              group_name)
        _, (gu,) = torch.ops.symm_mem.fused_all_gather_matmul(o_sh, [w_gu.t()], 0, group_name, return_A=False)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(act(gu), w_d.t(), "sum", 0, group_name)

    paths = {"allreduce": allreduce_path, "nccl_sp": nccl_sp_path, "async_tp": async_tp_path}
    outs = {name: fn().float() for name, fn in paths.items()}
    ref = outs["allreduce"]
    scale = ref.abs().max().item()
    check = {name: (out - ref).abs().max().item() / scale for name, out in outs.items()}
    times = {name: [] for name in paths}
    for _ in range(args.reps):
        for name, fn in paths.items():
            dist.barrier(group=cpu_group)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.layers):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3 / args.layers)
    row = {"tokens": t, "check_rel_max_diff": check}
    row.update({f"{name}_ms": statistics.median(v) for name, v in times.items()})
    row.update({f"{name}_runs_ms": v for name, v in times.items()})
    if rank == 0:
        print(f"tokens {t}: " + "  ".join(f"{n} {row[n + '_ms']:.3f} ms" for n in paths)
              + f"  rel diff vs allreduce {check}", flush=True)
        queue.put(row)
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def main() -> None:
    from common import check_world_size, multi_gpu_parser, multi_gpu_result, run_ranks

    p = multi_gpu_parser(__doc__, 4)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 8192])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--q-dim", type=int, default=4096, help="query heads x head size (all ranks)")
    p.add_argument("--kv-dim", type=int, default=1024, help="KV heads x head size (all ranks)")
    p.add_argument("--layers", type=int, default=4, help="layer calls per timed run")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    check_world_size(args.world_size)
    t0 = time.perf_counter()
    from attnserve.bench.results import write_result

    rows = []
    for tokens in args.tokens:
        if tokens % args.world_size:
            raise SystemExit(f"--tokens {tokens} is not a multiple of the world size {args.world_size}")
        sub = argparse.Namespace(**{**vars(args), "tokens": tokens})
        rows.append(run_ranks(_rank_main, args.world_size, sub))
    result = multi_gpu_result("async_tp_bench", t0, args.world_size)
    result.update({"hidden": args.hidden,
                   "intermediate": args.intermediate, "q_dim": args.q_dim, "kv_dim": args.kv_dim,
                   "layers": args.layers, "rows": rows})
    write_result(result, args.out, f"x{args.world_size}-async-tp")


if __name__ == "__main__":
    sys.exit(main())
