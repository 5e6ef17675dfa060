"""TARGET_VERIFY forwards captured in CUDA graphs, one per batch size at a fixed node count.

Every request of a captured verify step has exactly ``n`` = ``--speculative-num-draft-tokens``
query tokens: its tree's nodes, then padding nodes (token 0 at the request's first new
position, K/V written to the dummy slot 0, seeing the prefix and itself only) whose logits
the caller drops. Masks use the node-only layout (`VerifyInput.mask_covers_prefix` False:
request ``i``'s block is ``[n, n]`` at ``i * n * n``, every cached key visible), so all
shapes are fixed and only values change between replays. The backend's metadata for the
mode (prefix indices from ``req_to_token``, ``qo_indptr = n * arange``) is refilled by its
replay hook, recorded at the head of the graph when the hook is capturable.

Inputs travel as one packed host->device copy (`pack_verify_inputs`). Every graph writes its
logits into one ``[max_bs * n, V]`` float32 buffer (`attnserve.engine.graph_output`): kept per
graph, the outputs of 8-node trees over the 51 sizes up to 512 would take 43 GB for
Llama-3-8B's vocabulary, against 2.1 GB shared.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Dict, List, Sequence

import torch

from attnserve.engine.cuda_graph_runner import capture_stream
from attnserve.engine.graph_output import SharedGraphOutput
from attnserve.engine.speculative.tree import DraftTree
from attnserve.forward_batch import ForwardBatch, ForwardMode, VerifyInput

logger = logging.getLogger(__name__)


def pack_verify_inputs(trees: Sequence[DraftTree], prefix_lens: Sequence[int], rows: Sequence[int],
                       slots: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """Host int64 tensor ``[bs * (4 + 3 n + n * n)]`` = rows, prefix lengths, then per node
    token ids, positions, slots (``[bs, n]`` each, padded) and the ``[bs, n, n]`` masks
    (tree ancestors; a padding node sees itself)."""
    ids, pos, locs, mask = [], [], [], []
    for t, p, sl in zip(trees, prefix_lens, slots):
        pad = n - t.size
        ids += list(t.tokens) + [0] * pad
        pos += [p + d for d in t.depths()] + [p] * pad
        locs += sl.tolist() + [0] * pad
        anc = t.ancestor_rows()
        for i in range(n):  # row i: tree ancestors, or (padding) the node itself
            mask += anc[i] + [False] * pad if i < t.size else [j == i for j in range(n)]
    return torch.tensor(list(rows) + list(prefix_lens) + ids + pos + locs + mask, dtype=torch.int64)


class VerifyGraphRunner:
    """Captured TARGET_VERIFY graphs of the target `ModelRunner` (its decode graphs must
    exist: they set up the backend's graph buffers).

    Args:
        runner: the target's runner.
        num_nodes: ``n``, query tokens per request.
        capture_bs: batch sizes to capture (at most the decode graphs' largest).

    Attributes:
        outputs: per captured size, its logits ``[bs * n, V]``: views of one shared buffer.
        logits_buffer_bytes: that buffer's size; graph_memory_bytes: the capture's device
            memory (both logged).
    """

    def __init__(self, runner, num_nodes: int, capture_bs: Sequence[int]):
        self.runner = runner
        self.n = int(num_nodes)
        self.capture_bs: List[int] = sorted(set(capture_bs))
        self.max_bs = self.capture_bs[-1]
        self.backend = runner.attn_backend
        self.metadata_in_graph = self.backend.replay_hook_is_capturable
        fill = self.backend.get_cuda_graph_seq_len_fill_value()
        dev, n, mb = runner.device, self.n, self.max_bs
        self.fill_value = fill
        self.req_pool_indices = torch.zeros(mb, dtype=torch.int64, device=dev)
        self.prefix_lens = torch.full((mb,), fill, dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(mb * n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(mb * n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(mb * n, dtype=torch.int64, device=dev)
        self.custom_mask = torch.eye(n, dtype=torch.bool, device=dev).repeat(mb, 1, 1).view(-1)
        self.mask_indptr = torch.arange(mb + 1, dtype=torch.int64, device=dev) * (n * n)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self._capture()

    def _spec(self, bs: int) -> VerifyInput:
        n = self.n
        return VerifyInput(self.custom_mask[: bs * n * n], self.mask_indptr[: bs + 1], self.positions[: bs * n],
                           [n] * bs, mask_covers_prefix=False)

    def _batch(self, bs: int) -> ForwardBatch:
        r, n = self.runner, self.n
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=self.input_ids[: bs * n],
            positions=self.positions[: bs * n], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.prefix_lens[:bs], out_cache_loc=self.out_cache_loc[: bs * n],
            extend_seq_lens_cpu=[n] * bs, req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool, attn_backend=self.backend, spec_info=self._spec(bs),
        )

    def _refill(self, bs: int) -> None:
        self.backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices, self.prefix_lens, None, None, ForwardMode.TARGET_VERIFY, self._spec(bs), None)

    @torch.inference_mode()
    def _capture(self) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream()  # one per process (cuda_graph_runner.capture_stream)
        free_before = torch.cuda.mem_get_info()[0]
        model = self.runner.model
        shared = SharedGraphOutput()  # largest graph first: its logits are every graph's buffer
        for bs in reversed(self.capture_bs):
            fb = self._batch(bs)
            self.backend.init_forward_metadata_capture_cuda_graph(
                bs, bs * self.n, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.TARGET_VERIFY, fb.spec_info)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    model.compute_logits(model(fb.input_ids, fb.positions, fb))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                if self.metadata_in_graph:
                    self._refill(bs)
                out = model.compute_logits(model(fb.input_ids, fb.positions, fb), out=shared.target(bs * self.n))
                self.outputs[bs] = shared.bind(out)
            self.graphs[bs] = graph
            del out  # a smaller graph's own logits: freed, their pool blocks serve the next capture
        torch.cuda.synchronize()
        self.logits_buffer_bytes = shared.nbytes
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.warning("captured %d verify CUDA graphs (%d nodes per request, bs %s) in %.2f s using %.1f MiB "
                       "(%.1f MiB of it one shared logits buffer)", len(self.capture_bs), self.n, self.capture_bs,
                       time.perf_counter() - t0, self.graph_memory_bytes / 2**20, self.logits_buffer_bytes / 2**20)

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def replay(self, packed: torch.Tensor, raw: int) -> torch.Tensor:
        """Run a verify step of ``raw`` requests from `pack_verify_inputs` (on the device).

        Returns:
            float32 logits ``[raw * n, V]`` (node ``j`` of request ``i`` at ``i * n + j``; a
            view of the buffer every verify graph writes, valid until the next replay of any
            size: `SpecDecoder.verify` gathers the tree nodes' rows into a new tensor
            and samples from them before its next step).
        """
        n = self.n
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw)]
        t = raw * n
        parts = torch.split(packed, [raw, raw, t, t, t, t * n])
        self.req_pool_indices[:raw].copy_(parts[0])
        self.prefix_lens[:raw].copy_(parts[1])
        self.input_ids[:t].copy_(parts[2])
        self.positions[:t].copy_(parts[3])
        self.out_cache_loc[:t].copy_(parts[4])
        self.custom_mask[: t * n].copy_(parts[5])
        if bs > raw:  # padded requests: row 0, prefix fill, dummy slot (any earlier mask
            # left in the buffer is valid: every row of a tree mask sees its own node)
            self.req_pool_indices[raw:bs].zero_()
            self.prefix_lens[raw:bs].fill_(self.fill_value)
            self.input_ids[t: bs * n].zero_()
            self.positions[t: bs * n].zero_()
            self.out_cache_loc[t: bs * n].zero_()
        if not self.metadata_in_graph:
            self._refill(bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:t]
