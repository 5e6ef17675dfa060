"""`CudaGraphRunner`: capture the decode forward once per batch-size bucket, replay it.

At start-up it captures embedding -> all layers -> logits for each bucket (default 1, 2,
4, 8, then steps of 8 up to ``--cuda-graph-max-bs``; ``--cuda-graph-bs`` overrides),
largest first, all graphs sharing one memory pool. Static inputs (``input_ids``,
``positions``, ``req_pool_indices``, ``seq_lens``, ``out_cache_loc``) live here; the
attention metadata lives in the backend's fixed buffers (DESIGN.md §4 hooks).

Replay picks the smallest bucket >= the batch (or the faster larger bucket it was mapped to
at start-up, `replay_sizes_by_time`), copies the real rows in, pads the rest
with ``seq_len = backend.get_cuda_graph_seq_len_fill_value()``, request row 0 and
``out_cache_loc`` 0 (the reserved dummy slot, so padded rows never write into a real
request's KV), refills the backend metadata in place and replays. When the backend declares its replay
hook capturable (``replay_hook_is_capturable``: device work on fixed buffers only, like the
triton backend's index kernels), the hook is recorded at the head of each graph instead of
being launched from the host at every step.

Bucket choice by measured time: cuBLAS picks its GEMM kernels per row count, and the times
it gets are not monotonic in the rows. One H200, Llama-3-8B shape, bf16 ``F.linear`` in a
CUDA graph (`benchmarks/gemm_rows_sweep.py`, 2026-11-29): the four projections of a layer
take 442 µs at 448 rows and 345 µs at 464 (``gate_up`` alone 283 / 191 µs), 327 at 400 and
316 at 416, 266 at 336 and 261 at 352. So after capture every graph is replayed a few times
on its padding inputs, and a bucket whose larger neighbour replayed faster by more than
`REPLAY_MARGIN` runs the larger graph (its extra rows are padding, as for any bucket):
`fastest_bucket_at_or_above`. Off with ``ATTNSERVE_GRAPH_BUCKET_BY_TIME=0``, in
deterministic mode (a batch must meet the same kernels whatever else runs) and under tensor
parallelism (every rank must replay the same graph, so rank 0's choice would have to be
shared; not run on several GPUs yet). Timing costs ~2.9 s of start-up for Llama-3-8B's 67
graphs. Measured on one H200 (2026-11-29, `bench.offline`, Llama-3-8B shape): 8-9 of 67
buckets move (448 -> 480: 15.74 -> 12.26 ms a replay); 448 x 512 -> 256 (a steady batch of
448) 11.55 -> 10.85 s, +6.4% output tok/s; the random workloads pass through each bucket for
a few dozen steps and did not move (256 prompts 14.03 / 14.03 s, 1,024 prompts 47.28 / 47.36 s).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from attnserve.engine.graph_output import SharedGraphOutput
from attnserve.env_options import env_flag
from attnserve.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

#: a larger bucket's graph replaces a bucket's own only when it replayed this much faster
#: (relative): run-to-run spread of a replay timed at start-up is ~1-2%
REPLAY_MARGIN = 0.03
#: timed replays per graph at start-up (after one untimed), their median is kept
TIMED_REPLAYS = 3
BUCKET_BY_TIME_ENV = "ATTNSERVE_GRAPH_BUCKET_BY_TIME"


def fastest_bucket_at_or_above(sizes: Sequence[int], replay_ms: Mapping[int, float],
                               margin: float = REPLAY_MARGIN) -> Dict[int, int]:
    """For each captured batch size ``b`` of ``sizes`` (ascending), the size whose graph a batch
    of bucket ``b`` replays: the size ``b' >= b`` of smallest ``replay_ms[b']`` when that is below
    ``replay_ms[b] * (1 - margin)``, else ``b`` itself.

    Args:
        sizes: captured batch sizes, ascending, each a key of ``replay_ms``.
        replay_ms: ms of one replay of each size's graph.
        margin: relative gain a larger graph must show (``0 <= margin < 1``).
    """
    choice: Dict[int, int] = {}
    best = None  # the fastest size seen so far, scanning from the largest down
    for b in reversed(list(sizes)):
        if best is None or replay_ms[b] <= replay_ms[best]:
            best = b
        choice[b] = best if replay_ms[best] < replay_ms[b] * (1.0 - margin) else b
    return choice


def default_capture_batch_sizes(max_bs: int) -> List[int]:
    """1, 2, 4, 8, then every 8 up to 256, every 16 up to 512 and every 32 above, up to
    ``max_bs`` (``max_bs`` itself included): a padded batch wastes under 1/16 of its rows above
    256 while 1024 needs 67 graphs, not 132."""
    sizes = ([b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, min(max_bs, 256) + 1, 8))
             + list(range(272, min(max_bs, 512) + 1, 16)) + list(range(544, max_bs + 1, 32)))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def capture_stream() -> "torch.cuda.Stream":
    """The side stream that graphs are warmed up and captured on: torch's process-wide
    default capture stream (``torch.cuda.graph.default_capture_stream``, created by the
    first ``torch.cuda.graph``), shared by every engine and graph runner of the process.

    cuBLAS keeps a workspace per (handle, stream) until the process ends (32 MiB each on
    an H100, torch's ``CUBLAS_WORKSPACE_CONFIG`` default for sm_90): with a fresh stream
    per capture, every engine built and shut down left 32 MiB allocated behind it.
    """
    if torch.cuda.graph.default_capture_stream is None:
        torch.cuda.graph(torch.cuda.CUDAGraph())  # the constructor creates the shared stream
    stream = torch.cuda.graph.default_capture_stream
    if stream.device != torch.device("cuda", torch.cuda.current_device()):  # made for another GPU
        return torch.cuda.Stream()
    return stream


class CudaGraphRunner:
    """Captured decode graphs of one `ModelRunner`.

    Attributes:
        capture_bs: captured batch sizes, ascending.
        capture_seconds / graph_memory_bytes: start-up cost (also logged).
    """

    def __init__(self, model_runner):
        self.runner = model_runner
        args = model_runner.server_args
        limits = model_runner.serving_limits
        max_bs = max(1, min(limits.cuda_graph_max_bs, limits.max_running_requests))
        sizes = sorted(set(args.cuda_graph_bs)) if args.cuda_graph_bs else default_capture_batch_sizes(max_bs)
        self.capture_bs = sizes
        self.max_bs = sizes[-1]
        dev = model_runner.device
        self.backend = model_runner.attn_backend
        self.fill_value = self.backend.get_cuda_graph_seq_len_fill_value()
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((self.max_bs,), self.fill_value, dtype=torch.int32, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        # A backend whose replay hook only launches device work on the fixed buffers (no host
        # reads, no allocation) can have that hook captured too: replay is then input copies
        # plus one graph launch.
        self.metadata_in_graph = self.backend.replay_hook_is_capturable
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.capture()
        #: bucket -> the captured size whose graph it replays (`replay_sizes_by_time`)
        self.replay_bs: Dict[int, int] = {b: b for b in self.capture_bs}
        #: ms of one replay of each graph at start-up (empty when not timed)
        self.replay_ms: Dict[int, float] = {}
        tp = getattr(model_runner, "tp", None)
        if (env_flag(BUCKET_BY_TIME_ENV) and not args.enable_deterministic_inference and len(sizes) > 1
                and (tp is None or tp.size == 1)):
            self.replay_sizes_by_time()

    def _batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], seq_lens_sum=bs * self.fill_value,
            req_to_token_pool=r.req_to_token_pool, token_to_kv_pool=r.token_to_kv_pool, attn_backend=self.backend,
        )

    def _run_model(self, fb: ForwardBatch, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        model = self.runner.model
        return model.compute_logits(model(fb.input_ids, fb.positions, fb), out=out)

    @torch.inference_mode()
    def capture(self) -> None:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream()
        # Every graph writes its logits into the largest graph's output (captured first), so the
        # graphs share one [max_bs, vocab] float32 buffer (`SharedGraphOutput`). Kept per graph, the
        # outputs summed to ~5.5 GB for Llama-3-8B's 51 sizes up to 512 (6.3 GB of graph memory for
        # Qwen3-0.6B, against 2.6 GB for the 35 sizes up to 256, on an H100). The copy costs
        # bs x vocab x 8 bytes of traffic a step (~22 us at 64 Llama-3-8B rows, 7.9 ms steps;
        # 63 us at 144 Qwen3-0.6B rows, 6.2 ms), so the smaller graphs hand the buffer's rows to
        # compute_logits, whose LM head GEMM writes them in place (`SharedGraphOutput.target`).
        # Replays run in stream order and each step's logits are consumed before the next
        # replay (as they were for two steps of one size), so sharing is safe.
        shared = SharedGraphOutput()
        for bs in reversed(self.capture_bs):
            fb = self._batch(bs)
            self.backend.init_forward_metadata_capture_cuda_graph(
                bs, bs, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE, None
            )
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: compile kernels, settle the allocator
                    self._run_model(fb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                if self.metadata_in_graph:
                    self._refill_metadata(bs, fb.seq_lens_sum)
                out = self._run_model(fb, out=shared.target(bs))
                self.outputs[bs] = shared.bind(out)
            self.graphs[bs] = graph
            del out
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.warning(
            "captured %d CUDA graphs (bs %s) in %.2f s using %.1f MiB",
            len(self.capture_bs), self.capture_bs, self.capture_seconds, self.graph_memory_bytes / 2**20,
        )

    @torch.inference_mode()
    def replay_sizes_by_time(self) -> None:
        """Time every graph on its padding inputs (`TIMED_REPLAYS` replays after one untimed;
        median) and map each bucket to `fastest_bucket_at_or_above`. Logs the buckets that moved."""
        t0 = time.perf_counter()
        for bs in self.capture_bs:
            if not self.metadata_in_graph:
                self._refill_metadata(bs, bs * self.fill_value)
            self.graphs[bs].replay()
            times = []
            for _ in range(TIMED_REPLAYS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.graphs[bs].replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            self.replay_ms[bs] = sorted(times)[len(times) // 2]
        choice = fastest_bucket_at_or_above(self.capture_bs, self.replay_ms)
        self.replay_bs = choice
        moved = [f"{b}->{c} ({self.replay_ms[b]:.2f}->{self.replay_ms[c]:.2f} ms)" for b, c in sorted(choice.items())
                 if c != b]
        logger.warning("decode graphs timed in %.2f s: %d of %d buckets replay a larger, faster graph%s",
                       time.perf_counter() - t0, len(moved), len(choice), (": " + ", ".join(moved)) if moved else "")

    def _refill_metadata(self, bs: int, seq_lens_sum: int) -> None:
        self.backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices, self.seq_lens, seq_lens_sum, None, ForwardMode.DECODE, None, None
        )

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs and bool(self.graphs)

    def release(self) -> None:
        """Destroy the captured graphs and drop their outputs; `can_run` is False afterwards.

        A graph that captured NCCL collectives holds a reference on the communicator, and
        NCCL's communicator abort/destroy waits until every such graph is destroyed (NCCL's
        ``commDestroySync`` waits for ``localPersistentRefs`` to reach 0, as analysed in
        vLLM PR #39846): a tensor-parallel engine releases its graphs before its process
        groups. Call it only once the device has finished the graphs' last replays.
        """
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Run ``fb`` (a DECODE batch of ``<= max_bs`` rows) through its bucket's graph.

        Returns:
            float32 logits ``[fb.batch_size, V]`` (a view of the graph's output buffer,
            valid until the next replay).
        """
        raw = fb.batch_size
        bs = self.replay_bs[self.capture_bs[bisect.bisect_left(self.capture_bs, raw)]]
        self.input_ids[:raw].copy_(fb.input_ids)
        self.positions[:raw].copy_(fb.positions)
        self.req_pool_indices[:raw].copy_(fb.req_pool_indices)
        self.seq_lens[:raw].copy_(fb.seq_lens)
        self.out_cache_loc[:raw].copy_(fb.out_cache_loc)
        if bs > raw:
            self.input_ids[raw:bs].zero_()
            self.positions[raw:bs].zero_()
            self.req_pool_indices[raw:bs].zero_()
            self.seq_lens[raw:bs].fill_(self.fill_value)
            self.out_cache_loc[raw:bs].zero_()
        if not self.metadata_in_graph:
            self._refill_metadata(bs, fb.seq_lens_sum + (bs - raw) * self.fill_value)
        self.graphs[bs].replay()
        return self.outputs[bs][:raw]
