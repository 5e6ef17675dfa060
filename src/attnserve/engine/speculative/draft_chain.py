"""The draft model's decode steps of a chain draft (``--speculative-eagle-topk 1``), run as
one unit: eagerly, or as one CUDA graph per batch size covering every step.

After the catch-up extend has given each request its depth-1 token (at position
``P + 1``, ``P`` the root's position), step ``j`` (``0 <= j < S``) feeds the depth
``j + 1`` token at position ``P + 1 + j``, writes its draft K/V at that position's slot and
takes the argmax as the depth ``j + 2`` token, all on the device: no host round trip
between steps. A request allowed fewer steps (``steps_i < S``, near its length limits)
keeps running with its position and length frozen and its K/V written to the dummy slot
0; its extra tokens are discarded by the caller.

Attention metadata: with the Triton backend, one `TritonMultiStepDraftBackend` computes
every step's metadata in one launch (seed 003) and, in a graph, that launch is recorded
at the graph's head; with any other backend each step builds its own (``runner.forward``).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Dict, List, Optional, Sequence

import torch

from attnserve.engine.cuda_graph_runner import capture_stream
from attnserve.engine.sampler import argmax_last
from attnserve.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


class DraftChainRunner:
    """``S`` chained draft decode steps for a draft `ModelRunner`.

    Args:
        runner: the draft model's runner (``draft_of`` set).
        num_steps: ``S`` (>= 1).
        capture_bs: batch sizes to capture graphs for (CUDA only), or None / empty for
            eager only.
    """

    def __init__(self, runner, num_steps: int, capture_bs: Optional[Sequence[int]] = None):
        self.runner = runner
        self.num_steps = int(num_steps)
        self.device = torch.device(runner.device)
        self.multi = None
        backend = runner.attn_backend
        from attnserve.attention.triton_backend import TritonAttnBackend

        if type(backend) is TritonAttnBackend:
            from attnserve.attention.multi_step_draft import TritonMultiStepDraftBackend

            # eager rounds may run batches above the largest graph (max_running_requests)
            max_bs = max([runner.serving_limits.max_running_requests, *(capture_bs or [])])
            self.multi = TritonMultiStepDraftBackend(runner.attn_backend_config, self.num_steps, max_bs)
        self.graphs: Dict[int, "torch.cuda.CUDAGraph"] = {}
        self.capture_bs: List[int] = []
        if capture_bs and self.device.type == "cuda" and self.multi is not None:
            self._capture(sorted(set(capture_bs)))

    # ---- one drafting round ------------------------------------------------------------
    def run(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, step_limits: torch.Tensor,
            first_tokens: torch.Tensor, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """Run the ``S`` steps.

        Args (device tensors, ``bs`` rows):
            req_pool_indices: int64 ``[bs]``.
            seq_lens: int32 ``[bs]`` = ``P + 2`` (keys of step 0, its new token included).
            step_limits: int32 ``[bs]`` = ``steps_i - 1`` (step ``j`` attends to
                ``seq_lens + min(j, step_limits)`` keys; may be -1).
            first_tokens: int64 ``[bs]`` depth-1 tokens.
            out_cache_loc: int64 ``[S, bs]`` slot of each step's K/V (0 past ``steps_i``).

        Returns:
            int64 ``[bs, S]``: the depth ``2 .. S + 1`` tokens (argmax).
        """
        bs = int(req_pool_indices.shape[0])
        if self.graphs and bs <= self.capture_bs[-1]:
            return self._replay(bs, req_pool_indices, seq_lens, step_limits, first_tokens, out_cache_loc)
        return self._steps(bs, req_pool_indices, seq_lens, step_limits, first_tokens, out_cache_loc)

    def _steps(self, bs, rows, seq_lens, step_limits, tokens, out_cache_loc) -> torch.Tensor:
        runner = self.runner
        model = runner.model
        if self.multi is not None:  # every step's metadata, and its lengths [S, bs], at once
            lens = self.multi.init_forward_metadata(bs, rows, seq_lens, step_limits)
        else:
            from attnserve.attention.multi_step_draft import draft_step_lens

            steps = torch.arange(self.num_steps, dtype=torch.int32, device=self.device).view(-1, 1)
            lens = draft_step_lens(seq_lens, step_limits, steps)
        out = []
        for j in range(self.num_steps):
            backend = self.multi.backends[j] if self.multi is not None else runner.attn_backend
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=tokens, positions=(lens[j] - 1).long(),
                req_pool_indices=rows, seq_lens=lens[j], out_cache_loc=out_cache_loc[j],
                req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool,
                attn_backend=backend,
            )
            if self.multi is None:
                fb.seq_lens_cpu = lens[j].cpu()
                fb.seq_lens_sum = int(fb.seq_lens_cpu.sum())
                fb.extend_seq_lens_cpu = [1] * bs
                fb.extend_prefix_lens_cpu = (fb.seq_lens_cpu - 1).tolist()
                backend.init_forward_metadata(fb)
            logits = model.compute_logits(model(fb.input_ids, fb.positions, fb))
            tokens = argmax_last(logits)
            out.append(tokens)
        return torch.stack(out, dim=1)

    # ---- CUDA graphs -------------------------------------------------------------------
    def _capture(self, sizes: List[int]) -> None:
        dev, s = self.device, self.num_steps
        max_bs = sizes[-1]
        self.rows = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.step_limits = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(s, max_bs, dtype=torch.int64, device=dev)
        self.outputs: Dict[int, torch.Tensor] = {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream()  # one per process (cuda_graph_runner.capture_stream)
        with torch.inference_mode():
            for bs in reversed(sizes):
                args = (bs, self.rows[:bs], self.seq_lens[:bs], self.step_limits[:bs], self.tokens[:bs],
                        self.out_cache_loc[:, :bs])
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._steps(*args)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = self._steps(*args)
                self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_bs = sizes
        logger.warning("captured %d draft CUDA graphs (%d steps each, bs %s) in %.2f s", len(sizes), s, sizes,
                       time.perf_counter() - t0)

    def _replay(self, raw, rows, seq_lens, step_limits, tokens, out_cache_loc) -> torch.Tensor:
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw)]
        self.rows[:raw].copy_(rows)
        self.seq_lens[:raw].copy_(seq_lens)
        self.step_limits[:raw].copy_(step_limits)
        self.tokens[:raw].copy_(tokens)
        self.out_cache_loc[:, :raw].copy_(out_cache_loc)
        if bs > raw:  # padded rows: row 0, one key, no growth, K/V to the dummy slot
            self.rows[raw:bs].zero_()
            self.seq_lens[raw:bs].fill_(1)
            self.step_limits[raw:bs].zero_()
            self.tokens[raw:bs].zero_()
            self.out_cache_loc[:, raw:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:raw]
