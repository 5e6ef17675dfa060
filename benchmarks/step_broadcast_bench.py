"""Step-message broadcast latency: gloo ``broadcast_object`` vs the shared-memory step queue.

``PYTHONPATH=src python benchmarks/step_broadcast_bench.py [--world 2 4] [--iters 300]``
writes ``<out>/<host>-step-broadcast-<date>.json``.

CPU processes only (no GPU needed): ``world`` ranks join a gloo world on loopback, exactly
as `attnserve.engine.tp.launch.init_rank` builds it, and the step queue is set up by the
engine's own `setup_step_queue`. Rank 0 then broadcasts realistic `StepMessage`\\ s, built by
`host_step_layout` as the scheduler builds them:

* ``decode-1``: one request decoding at position 512;
* ``decode-64``: 64 requests decoding;
* ``extend-8k``: one request prefilling 8,192 tokens (a chunked-prefill step).

Each iteration: a gloo barrier, a 0.5 ms pause (the readers are already waiting, as on a
serving engine), then rank 0 sends. ``send_ms``: rank 0's time inside the send (its host
cost per step, what `SchedulerStats.tp_send_seconds` measures in the engine);
``deliver_ms``: from the start of the send until the last reader holds the unpickled
message (``time.perf_counter`` is CLOCK_MONOTONIC, one clock for every process on Linux).
Readers poll as on a GPU host (``--spin-s``; default the engine's CUDA setting).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import time

KINDS = ("decode-1", "decode-64", "extend-8k")


def make_message(kind: str):
    """A `StepMessage` of ``kind`` with the scheduler's host tensors."""
    import torch

    from attnserve.engine.step_inputs import host_step_layout
    from attnserve.engine.tp.step_sync import StepMessage
    from attnserve.forward_batch import ForwardMode

    bs, ext, prefix = {"decode-1": (1, 1, 512), "decode-64": (64, 1, 512), "extend-8k": (1, 8192, 0)}[kind]
    rows = list(range(3, 3 + bs))
    host = host_step_layout(rows, [prefix] * bs, [ext] * bs)
    n = bs * ext
    gen = torch.Generator().manual_seed(bs * ext)
    loc = torch.randperm(1 << 20, generator=gen)[:n] + 1
    ids = torch.full((n,), -1, dtype=torch.int64) if ext == 1 else torch.randint(0, 128000, (n,), generator=gen)
    host.update(input_ids=ids, out_cache_loc=loc, out_cache_loc_i32=loc.to(torch.int32),
                emit_index=torch.arange(bs, dtype=torch.int64))
    mode = ForwardMode.DECODE if ext == 1 else ForwardMode.EXTEND
    return StepMessage(mode, host, [prefix] * bs, [ext] * bs, ext == 1, bs)


def _frame_bytes(msg) -> int:
    import pickle

    oob = []
    head = pickle.dumps(msg, protocol=5, buffer_callback=oob.append)
    return len(head) + sum(b.raw().nbytes for b in oob)


def _rank_main(rank: int, world: int, init_method: str, args, out) -> None:
    import torch
    import torch.distributed as dist

    from attnserve.distributed.group import TPGroup
    from attnserve.engine.tp import step_channel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, world_size=world, rank=rank)
    cpu_group = dist.new_group(list(range(world)), backend="gloo")
    tp = TPGroup(rank=rank, size=world, device_group=dist.group.WORLD, cpu_group=cpu_group)
    queue = step_channel.setup_step_queue(tp, "shm", "cpu", 600.0)
    assert queue is not None, "the shared-memory step queue could not be set up"
    queue.spin_s = args.spin_s  # poll as configured (the engine's CUDA setting by default)
    rows = []
    for mode in args.modes:
        tp.step_queue = queue if mode == "shm" else None
        for kind in KINDS:
            msg = make_message(kind) if rank == 0 else None
            sends, starts, recvs = [], [], []
            for it in range(args.warmup + args.iters):
                dist.barrier(group=cpu_group)
                if rank == 0:
                    time.sleep(5e-4)
                    t0 = time.perf_counter()
                    tp.broadcast_step(msg)
                    t1 = time.perf_counter()
                    if it >= args.warmup:
                        starts.append(t0)
                        sends.append(t1 - t0)
                else:
                    got = tp.broadcast_step(None)
                    t1 = time.perf_counter()
                    if it >= args.warmup:
                        recvs.append(t1)
                    if it == 0:
                        assert got.host["positions"].numel() == got.host["input_ids"].numel()
            every = [None] * world
            dist.all_gather_object(every, recvs if rank else starts, group=cpu_group)
            if rank == 0:
                deliver = [max(every[r][i] for r in range(1, world)) - every[0][i] for i in range(args.iters)]
                rows.append({"world": world, "mode": mode, "message": kind, "frame_bytes": _frame_bytes(msg),
                             **_stats("send_ms", sends), **_stats("deliver_ms", deliver)})
                print(f"world {world} {mode:4s} {kind:9s}: send {rows[-1]['send_ms_median']:.3f} ms, deliver "
                      f"{rows[-1]['deliver_ms_median']:.3f} ms (median of {args.iters})", flush=True)
    tp.step_queue = queue
    tp.close_step_queue()
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def _stats(name: str, seconds) -> dict:
    ms = sorted(1e3 * s for s in seconds)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {f"{name}_median": statistics.median(ms), f"{name}_p10": pick(0.1), f"{name}_p90": pick(0.9),
            f"{name}_mean": statistics.fmean(ms)}


def run_world(world: int, args) -> list:
    import multiprocessing as mp

    from attnserve.engine.tp.launch import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    rows = out.get(timeout=1800)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    return rows


def main(argv=None) -> int:
    from attnserve.engine.tp.step_channel import SPIN_S_CUDA

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--modes", nargs="+", default=["gloo", "shm"], choices=["gloo", "shm"])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--spin-s", type=float, default=SPIN_S_CUDA, help="seconds a reader polls before sleeping")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    import torch

    res = {"benchmark": "step_broadcast", "date": dt.date.today().isoformat(), "host": socket.gethostname(),
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "python": platform.python_version(), "iters": args.iters, "spin_s": args.spin_s, "rows": []}
    t0 = time.perf_counter()
    for world in args.world:
        res["rows"] += run_world(world, args)
    res["total_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"cpu{os.cpu_count()}-step-broadcast-{res['date']}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    raise SystemExit(main())
