"""Timing and ceiling helpers shared by the kernel benchmarks in this directory.

Scripts here run as ``PYTHONPATH=src python benchmarks/<name>.py`` (this directory is then
on ``sys.path``, so they ``from common import ...``) and use only attnserve's public API.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from typing import Callable, Dict, Iterator, Optional, Sequence

import torch


def bench_eager(fns: Sequence[Callable[[], object]]) -> float:
    """Median µs of one call (do_bench: L2 flushed before every call), rotating ``fns``."""
    import triton.testing

    state = [0]

    def run():
        fns[state[0] % len(fns)]()
        state[0] += 1

    return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3


def bench_graph(fns: Sequence[Callable[[], object]], min_calls: int = 24, replays: int = 15) -> float:
    """Median µs per call of a CUDA graph holding >= min_calls calls that cycle through ``fns``
    (one graph replay, so no per-call CPU launch cost)."""
    calls = len(fns) * max(1, math.ceil(min_calls / len(fns)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def try_run(fn, *args):
    """``(fn(*args), None)``, or ``(None, "Error: message")`` when it raises."""
    try:
        return fn(*args), None
    except Exception as e:  # a peer that cannot run here is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


# ----------------------------------------------------------------------------- ceilings
def measure_ceilings() -> Dict[str, float]:
    """Device-to-device copy TB/s (bytes read + written) and bf16 8192^3 matmul TFLOPS
    (`attnserve.bench.offline_random.measure_device_rates`, the rates the roofline uses)."""
    from attnserve.bench.offline_random import measure_device_rates

    r = measure_device_rates()
    copy_tbps = r["copy_bytes_per_s"] / 1e12
    return {"copy_tbps": copy_tbps, "copy_us_1GiB": 2 * (1 << 30) / r["copy_bytes_per_s"] * 1e6,
            "matmul_bf16_tflops": r["matmul_flops_per_s"] / 1e12}


def copy_bandwidth_gbs(n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s counting bytes read + written (median)."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n_bytes / statistics.median(times[2:]) / 1e9


def time_ms(fn, iters: int = 30) -> float:
    """Median ms of ``fn()`` between CUDA events (3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def make_runner(model: str, max_bs: int, max_ctx: int, graphs: bool):
    """A `ModelRunner` of the dummy bf16 shape ``model`` on CUDA for ``max_bs`` x ``max_ctx``."""
    from attnserve.engine.model_runner import ModelRunner
    from attnserve.model_loader.loader import load_model
    from attnserve.server_args import ServerArgs

    args = ServerArgs(model=model, load_format="dummy", dtype="bfloat16", device="cuda",
                      max_running_requests=max_bs, max_total_tokens=max_bs * (max_ctx + 16),
                      context_length=max_ctx + 16, disable_cuda_graph=not graphs)
    loaded = load_model(model, load_format="dummy", dtype=torch.bfloat16, device="cuda", load_tokenizer=False)
    return ModelRunner(args, loaded)


def fill_requests(runner, bs: int, ctx: int, extra: int = 0):
    """``bs`` rows of ``runner``'s pools holding ``ctx + extra`` allocated slots each (written to
    ``req_to_token``, host and device); returns the rows and the slots ``[bs, ctx + extra]``."""
    r2t, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    rows = r2t.alloc(bs)
    loc = alloc.alloc_extend([0] * bs, [ctx + extra] * bs, [0] * bs)
    n = ctx + extra
    token_rows = torch.tensor(rows, dtype=torch.int64).repeat_interleave(n)
    cols = torch.arange(n, dtype=torch.int64).repeat(bs)
    r2t.write_host(token_rows, cols, loc.to(torch.int32))
    r2t.write_device(token_rows, cols, loc.to(torch.int32))
    return rows, loc.view(bs, n)


def init_rank(rank: int, world_size: int, port: int):
    """One spawned rank of a multi-GPU benchmark: NVLink multicast off (NCCL and symmetric
    memory; the lent machines forbid it), this rank's GPU, the NCCL world group (warmed
    with one all-reduce) and a gloo group of the same ranks. Returns ``(device, group,
    cpu_group)``."""
    import os

    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank,
                            device_id=device)
    group = dist.group.WORLD
    cpu_group = dist.new_group(list(range(world_size)), backend="gloo")
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    return device, group, cpu_group


def multi_gpu_parser(doc: str, default_world_size: int):
    """The multi-GPU benchmarks' argument parser: ``doc`` as its description, ``--world-size``
    (default: ``default_world_size`` or the GPUs seen, whichever is fewer) and ``--out`` (default
    ``benchmarks/results``); each benchmark adds its own arguments."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=min(default_world_size, torch.cuda.device_count()))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    return p


def multi_gpu_result(benchmark: str, t0: float, world_size: int) -> dict:
    """The head of a multi-GPU benchmark's JSON: `cuda_run_metadata` (device, versions, ``total_s``
    since ``t0``) with ``world_size``, ``date`` and the NCCL version."""
    import datetime as dt

    from attnserve.bench.results import cuda_run_metadata

    result = cuda_run_metadata(benchmark, t0)
    result.update({"world_size": world_size, "date": dt.date.today().isoformat(),
                   "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    return result


def check_world_size(world_size: int) -> None:
    """Exit with a message unless ``world_size`` is at least 2 and that many GPUs are visible
    (the multi-GPU benchmarks' first check)."""
    if world_size < 2 or torch.cuda.device_count() < world_size:
        raise SystemExit(f"needs {max(2, world_size)} GPUs, found {torch.cuda.device_count()}")


def run_ranks(rank_main: Callable, world_size: int, args) -> object:
    """Spawn ``world_size`` processes running ``rank_main(rank, world_size, port, args,
    queue)`` (each calls `init_rank` with the port), and return the one object a rank puts
    on the queue (rank 0's results).

    Raises:
        SystemExit: a rank exited with an error (seen while waiting, so a dead rank does not
            leave the others' result pending forever), or after the result.
    """
    import time

    import torch.multiprocessing as mp

    from attnserve.engine.tp.launch import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for pr in procs:
        pr.start()
    while queue.empty():
        if any(pr.exitcode not in (None, 0) for pr in procs):
            raise SystemExit(f"a rank failed: exit codes {[pr.exitcode for pr in procs]}")
        time.sleep(0.2)
    result = queue.get()
    for pr in procs:
        pr.join(60)
    bad = [pr.exitcode for pr in procs if pr.exitcode != 0]
    if bad:
        raise SystemExit(f"a rank failed: exit codes {bad}")
    return result


@contextlib.contextmanager
def env_set(name: str, value: Optional[str]) -> Iterator[None]:
    """Environment variable ``name`` set to ``value`` (None: unset) inside the block, restored
    (or removed again) after it: for switches the kernels read at every launch."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old

