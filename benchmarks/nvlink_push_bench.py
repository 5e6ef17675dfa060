"""Raw NVLink push bandwidth: how fast one GPU's programs store a message into every peer's
symmetric buffer, by program count (issue 38: what bounds the push all-reduce at 64 rows).

``PYTHONPATH=src python benchmarks/nvlink_push_bench.py [--world-size 4] [--kb 16 512 1024]
[--programs 8 32 64 128 256 512] [--out DIR]``

The push all-reduce + add + RMSNorm (`fused_all_reduce_push`) at 64 rows of 4,096 bf16 (512 KB a
rank) takes ~11 µs on four H200s against ~5 µs for 1 row, and its time grows by ~6.5 µs per 1.5 MB
a rank pushes (64 rows of 8,192: 17.6 µs), i.e. ~230 GB/s, half of NV18's ~450 GB/s a direction.
This bench takes the protocol away: each rank's ``P`` programs copy the rank's message (16-byte
vectors, a contiguous share per program) into its slot of every peer's symmetric buffer, nothing
else (no sentinel, no poll, no reduction), in a CUDA graph of ``--calls`` launches timed with
events on every rank at once (`allreduce_bench._time_graph`). Reported per (message, programs):
µs per launch on rank 0 and GB/s of stores leaving the GPU (``(W - 1) * bytes / time``). If 128
programs already reach ~400 GB/s, the all-reduce's time is its protocol (the poll, the norm's
row flags) and more programs would not help; if bandwidth grows with programs past 128, a push
kernel with more resident programs per row would. One process per GPU, NVLink multicast off.
Writes ``<out>/<device>-nvlink-push-<date>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_bench import _time_graph  # noqa: E402
from common import run_ranks  # noqa: E402


@triton.jit
def _push_kernel(src_ptr, buf_table_ptr, rank, n_vec, vec_per_prog, msg_bytes, W: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program ``p`` stores 16-byte vectors ``[p * vec_per_prog, ...)`` of ``src`` (int32 words,
    four a vector) into slot ``rank`` (``msg_bytes`` apart) of every peer's buffer."""
    pid = tl.program_id(0)
    lo = pid * vec_per_prog
    hi = tl.minimum(lo + vec_per_prog, n_vec)
    offs = tl.arange(0, BLOCK)
    for start in range(lo * 4, hi * 4, BLOCK):
        w = start + offs
        m = w < hi * 4
        v = tl.load(src_ptr + w, mask=m, other=0)
        for i in tl.static_range(1, W):
            peer = (rank + i) % W
            base = tl.load(buf_table_ptr + peer)
            dst = tl.multiple_of((base + rank * msg_bytes).to(tl.pointer_type(tl.int32)), 16)
            tl.store(dst + w, v, mask=m)


def _rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from attnserve.distributed.custom_all_reduce import _peer_addresses
    from attnserve.distributed.symm_mem_rendezvous import aligned_rendezvous
    from common import init_rank

    device, group, cpu_group = init_rank(rank, world_size, port)
    max_bytes = max(args.kb) * 1024
    buffer = symm_mem.empty(world_size * max_bytes, dtype=torch.uint8, device=device)
    handle = aligned_rendezvous(buffer, group, cpu_group)
    table = torch.tensor(_peer_addresses(handle, buffer, rank, world_size), dtype=torch.int64, device=device)
    rows = []
    for kb in args.kb:
        nbytes = kb * 1024
        src = torch.arange(nbytes // 4, dtype=torch.int32, device=device) + rank * (1 << 24)
        n_vec = nbytes // 16
        for programs in args.programs:
            per = -(-n_vec // programs)
            grid = (-(-n_vec // per),)

            def launch():
                _push_kernel[grid](src, table, rank, n_vec, per, nbytes, W=world_size, BLOCK=args.block,
                                   num_warps=args.warps)

            dist.barrier(group=cpu_group)
            torch.cuda.synchronize()
            us = _time_graph(launch, lambda: None, args.calls, args.replays)
            torch.cuda.synchronize()
            dist.barrier(group=cpu_group)
            # every peer's slot of this rank's buffer holds that peer's message
            ok = all(bool(torch.equal(buffer[r * nbytes:(r + 1) * nbytes].view(torch.int32),
                                      torch.arange(nbytes // 4, dtype=torch.int32, device=device) + r * (1 << 24)))
                     for r in range(world_size) if r != rank)
            out_gbs = (world_size - 1) * nbytes / (us * 1e-6) / 1e9
            rows.append({"kb": kb, "programs": grid[0], "us": us, "out_gbs": out_gbs, "delivered": ok})
            if rank == 0:
                print(f"W={world_size} {kb:5d} KB x {grid[0]:4d} programs: {us:7.2f} us, {out_gbs:6.1f} GB/s out, "
                      f"delivered {ok}", flush=True)
    all_ok = [None] * world_size
    dist.all_gather_object(all_ok, all(r["delivered"] for r in rows), group=cpu_group)
    if rank == 0:
        queue.put({"rows": rows, "delivered_on_every_rank": all(all_ok)})
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--kb", type=int, nargs="+", default=[16, 128, 512, 1024], help="message per rank, KB")
    p.add_argument("--programs", type=int, nargs="+", default=[8, 32, 64, 128, 256, 512])
    p.add_argument("--block", type=int, default=1024, help="int32 words a program moves per iteration")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--calls", type=int, default=48)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    if args.world_size < 2 or torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"world size {args.world_size}: needs 2 <= it <= GPUs ({torch.cuda.device_count()})")
    t0 = time.perf_counter()
    from attnserve.bench.results import cuda_run_metadata, write_result

    result = run_ranks(_rank_main, args.world_size, args)
    result.update(world_size=args.world_size, block=args.block, warps=args.warps, calls=args.calls,
                  **cuda_run_metadata("nvlink-push", t0))
    write_result(result, args.out, "nvlink-push")
    return 0 if result["delivered_on_every_rank"] else 1


if __name__ == "__main__":
    sys.exit(main())
