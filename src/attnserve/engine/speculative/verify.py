"""One speculative decode step: draft trees in, accepted tokens out.

`SpecDecoder.plan` asks the drafter for a tree per decoding request (bounded by what the
request may still emit and hold); `SpecDecoder.verify` runs the target once over every
tree node in a TARGET_VERIFY forward with the tree masks (`tree.build_verify_input`),
samples the target's token after every node (argmax, or the request's sampling settings
keyed by output position, `attnserve.engine.sampler`), walks each tree
(`tree.accept_path`), moves the accepted path's K/V into place, frees the K/V pages of
rejected nodes and returns the tokens each request gains (the accepted drafts and the
target's own next token, so always at least one).

Slot layout: the ``n`` nodes of a request with ``kv_len`` cached tokens are allocated as an
ordinary extend at positions ``kv_len .. kv_len + n - 1`` of its ``req_to_token`` row
(page-aligned, so any page size works). After acceptance of path ``p_0 .. p_a`` the K/V of
node ``p_d`` is copied to position ``kv_len + d`` (`KVCache.copy_slots`; a chain never
copies), ``kv_len`` becomes ``kv_len + a + 1`` and the whole pages past it go back to the
allocator; the partial page stays with the request and its stale rows are overwritten by
later tokens.

Sampling: drafts are proposed deterministically, so accepting the child whose token equals
a sample of the target at each node is per-level rejection sampling (`tree.accept_path`),
and because the sampler's noise is a function of (seed, output position) the tokens are
the ones the request would have produced without speculation, for any temperature.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from attnserve.engine.request import Req
from attnserve.engine.sampler import SamplingBatchInfo, argmax_last, sample
from attnserve.speculative_config import SpeculativeConfig
from attnserve.engine.speculative.ngram import NgramDrafter, NgramIndex
from attnserve.engine.speculative.tree import DraftTree, accept_path, build_verify_input
from attnserve.engine.step_inputs import StepInputPacker, host_step_layout
from attnserve.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Counters of speculative decoding (``/metrics``): ``num_verify`` request-verifies,
    ``num_emitted`` tokens they produced, ``num_drafted`` draft tokens proposed."""

    num_verify: int = 0
    num_emitted: int = 0
    num_drafted: int = 0

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verify (SGLang's accept length: completion tokens / ``spec_verify_ct``)."""
        return self.num_emitted / self.num_verify if self.num_verify else 0.0


class NgramProposer:
    """NGRAM drafting from each request's own prompt and output (`ngram.NgramDrafter`),
    with an incremental index per request."""

    def __init__(self, config: SpeculativeConfig, max_bfs_breadth: int):
        self.drafter = NgramDrafter(config.ngram_min_window, config.ngram_max_window, config.num_draft_tokens,
                                    max_bfs_breadth)
        self._index: Dict[str, NgramIndex] = {}
        self._indexed: Dict[str, int] = {}

    def propose(self, reqs: Sequence[Req], max_nodes: Sequence[int]) -> List[DraftTree]:
        trees = []
        for r, m in zip(reqs, max_nodes):
            ids = r.fill_ids
            index = self._index.get(r.rid)
            if index is None:
                index = self._index[r.rid] = NgramIndex(self.drafter, ids)
            else:
                index.extend(ids[self._indexed[r.rid]:])
            self._indexed[r.rid] = len(ids)
            trees.append(self.drafter.propose(index, max_nodes=m))
        return trees

    def forget(self, req: Req) -> None:
        self._index.pop(req.rid, None)
        self._indexed.pop(req.rid, None)


@dataclass
class SpecPlan:
    """What a verify step reserves and verifies: ``extents[i]`` KV slots for request ``i``
    (positions ``kv_len ..``), and its draft tree when known before the step (NGRAM), or
    None when the draft model grows it inside the step (STANDALONE, at most ``limits[i]``
    nodes)."""

    extents: List[int]
    trees: Optional[List[DraftTree]] = None
    limits: List[int] = field(default_factory=list)


@dataclass
class VerifyResult:
    """Per request of a verify step: the tokens it gains (``tokens``) and the accepted
    path length (``accepted``: drafted tokens taken)."""

    tokens: List[List[int]] = field(default_factory=list)
    accepted: List[int] = field(default_factory=list)


class SpecDecoder:
    """Drafts and verifies for a scheduler (module doc).

    Args:
        config: the checked flags.
        runner: the target's `ModelRunner`.
        token_map: the scheduler's future-token map (int64 per ``req_to_token`` row): the
            next root of every verified request is written there, so a later plain decode
            step (a MIXED batch) reads the right input.
        packer: the scheduler's `StepInputPacker`.
    """

    def __init__(self, config: SpeculativeConfig, runner, token_map: torch.Tensor, packer: StepInputPacker,
                 draft_runner=None):
        self.config = config
        self.runner = runner
        self.token_map = token_map
        self.packer = packer
        self.device = torch.device(runner.device)
        breadth = config.ngram_max_bfs_breadth
        if runner.attn_backend_config.window_sizes and breadth > 1:
            # The backends place a sliding window by a node's slot (kv_len + index), not its
            # tree depth; on a chain the two agree, so window models draft chains.
            logger.warning("model has sliding-window layers: NGRAM drafts chains (max BFS breadth 1 instead of %d)",
                           breadth)
            breadth = 1
        self.proposer = NgramProposer(config, breadth) if config.algorithm == "NGRAM" else None
        self.drafter = None
        if config.algorithm == "STANDALONE":
            from attnserve.engine.speculative.draft import DraftWorker

            if draft_runner is None:
                raise ValueError("STANDALONE speculative decoding needs a draft model runner")
            if runner.attn_backend_config.window_sizes and config.topk > 1:
                raise ValueError("--speculative-eagle-topk > 1 (tree drafts) is not supported on models with "
                                 "sliding-window layers (the backends place windows by slot); use topk 1")
            self.drafter = DraftWorker(config, draft_runner, self._graph_sizes())
        self.verify_graph = None
        if self._graph_sizes() and runner.attn_backend.supports_verify_cuda_graph:
            from attnserve.engine.speculative.verify_graph import VerifyGraphRunner

            self.verify_graph = VerifyGraphRunner(runner, config.num_draft_tokens, self._graph_sizes())
        self.stats = SpecStats()

    def _graph_sizes(self) -> List[int]:
        """Batch sizes the target's decode graphs cover (none without graphs)."""
        graphs = self.runner.cuda_graph_runner
        return list(graphs.capture_bs) if graphs is not None else []

    # ---- planning ----------------------------------------------------------------------
    def plan(self, reqs: Sequence[Req]) -> SpecPlan:
        """The slots each request reserves and, for NGRAM, its draft tree: at most
        ``num_draft_tokens`` nodes and never more than the request may still emit or hold."""
        limits = []
        for r in reqs:
            if r.kv_len != r.seq_len - 1:
                raise RuntimeError(f"request {r.rid}: speculation needs exactly the last token uncached "
                                   f"(kv_len {r.kv_len}, {r.seq_len} tokens)")
            emit_left = r.sampling_params.max_new_tokens - len(r.output_ids)
            limits.append(max(1, min(self.config.num_draft_tokens, r.max_total_len - r.kv_len, emit_left)))
        if self.drafter is not None:
            room = [max(1, r.max_total_len - r.kv_len) for r in reqs]
            return SpecPlan([self.drafter.extent(m) for m in room], None, limits)
        trees = self.proposer.propose(reqs, limits)
        return SpecPlan([t.size for t in trees], trees)

    def forget(self, req: Req) -> None:
        """Drop the drafter's state of a request whose K/V are gone."""
        (self.proposer or self.drafter).forget(req)

    def release(self) -> None:
        """Drop the verify graphs (`VerifyGraphRunner`: graphs, their memory pool and fixed
        inputs), the drafter (`DraftWorker`: its draft graphs and multi-step buffers), the
        n-gram indexes and the references to the runner, the future-token map and the
        packer; nothing else refers to them, so they are freed now. Engine shutdown only,
        after the device has finished its work; idempotent."""
        self.verify_graph = self.drafter = self.proposer = None
        self.runner = self.token_map = self.packer = None

    # ---- one verify step ---------------------------------------------------------------
    def verify(self, reqs: Sequence[Req], plan: SpecPlan) -> VerifyResult:
        """Reserve ``plan.extents`` slots, draft (STANDALONE), run the target over the
        trees, accept, move K/V, free rejected pages; ``kv_len`` of every request is updated.

        Raises RuntimeError when the pool lacks the pages (the scheduler reserved them).
        """
        runner = self.runner
        r2t, allocator = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
        prefix = [r.kv_len for r in reqs]
        extents = list(plan.extents)
        host = host_step_layout([r.req_pool_idx for r in reqs], prefix, extents)
        last_loc = r2t.req_to_token_host[host["req_pool_indices"], (host["extend_prefix_lens"].long() - 1).clamp_min(0)]
        loc = allocator.alloc_extend(host["extend_prefix_lens"], host["seq_lens"], last_loc)
        if loc is None:
            raise RuntimeError("KV pool exhausted after the schedule reserved pages (scheduler bug)")
        loc_i32 = loc.to(torch.int32)
        r2t.write_host(host["token_rows"], host["positions"], loc_i32)
        for r, p, n in zip(reqs, prefix, extents):
            r.kv_len = p + n  # every slot recorded: a failure from here frees them all
        trees = plan.trees
        if trees is None:  # STANDALONE: the rows must hold the slots before the draft model runs
            r2t.write_device(host["token_rows"], host["positions"], loc_i32, host["token_rows"].to(self.device),
                             host["positions"].to(self.device), loc_i32.to(self.device))
            trees = self.drafter.draft(reqs, prefix, extents, plan.limits)
            sizes = [t.size for t in trees]
            keep = torch.cat([torch.arange(s, s + n) for s, n in zip(host["extend_start_loc"].tolist(), sizes)])
            host = host_step_layout([r.req_pool_idx for r in reqs], prefix, sizes)
            loc, loc_i32 = loc[keep], loc_i32[keep]
        sizes = [t.size for t in trees]
        if self.verify_graph is not None and self.verify_graph.can_run(len(reqs)):
            logits = self._verify_graphed(reqs, trees, prefix, host, loc, loc_i32, write_rows=plan.trees is not None)
        else:
            logits = self._verify_eager(reqs, trees, prefix, sizes, host, loc, loc_i32,
                                        write_rows=plan.trees is not None)
        target = self._sample(logits, reqs, trees).tolist()
        result = self._accept(reqs, trees, prefix, extents, loc, target)
        if self.drafter is not None:
            self.drafter.after_verify(reqs, prefix)
        return result

    def _verify_graphed(self, reqs, trees, prefix, host, loc, loc_i32, write_rows: bool) -> torch.Tensor:
        """The target over the trees through a captured graph (`VerifyGraphRunner`): one
        packed copy carries the graph's inputs and, for NGRAM, the ``req_to_token`` write."""
        from attnserve.engine.speculative.verify_graph import pack_verify_inputs

        graph, bs = self.verify_graph, len(reqs)
        offs = host["extend_start_loc"].tolist()
        slots = [loc[o: o + t.size] for o, t in zip(offs, trees)]
        packed = pack_verify_inputs(trees, prefix, [r.req_pool_idx for r in reqs], slots, graph.n)
        k, t = packed.numel(), loc.numel()
        keep = torch.cat([torch.arange(i * graph.n, i * graph.n + tr.size) for i, tr in enumerate(trees)])
        parts = [packed, keep] + ([host["token_rows"], host["positions"], loc] if write_rows else [])
        dev = torch.cat(parts).to(self.device)
        if write_rows:
            rows_d, pos_d, loc_d = torch.split(dev[k + t:], [t, t, t])
            self.runner.req_to_token_pool.write_device(host["token_rows"], host["positions"], loc_i32, rows_d, pos_d,
                                                       loc_d.to(torch.int32))
        logits = graph.replay(dev[:k], bs)
        return logits[dev[k: k + t]]

    def _verify_eager(self, reqs, trees, prefix, sizes, host, loc, loc_i32, write_rows: bool) -> torch.Tensor:
        runner = self.runner
        r2t = runner.req_to_token_pool
        vi = build_verify_input(trees, prefix, self.device)
        tokens = [tok for t in trees for tok in t.tokens]
        host.update(input_ids=torch.tensor(tokens, dtype=torch.int64), out_cache_loc=loc, out_cache_loc_i32=loc_i32,
                    emit_index=torch.arange(len(tokens), dtype=torch.int64))
        dev = self.packer.pack(host)
        if write_rows:
            r2t.write_device(host["token_rows"], host["positions"], loc_i32, dev.token_rows, dev.positions,
                             dev.out_cache_loc_i32)
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(reqs), input_ids=dev.input_ids,
            positions=vi.positions, req_pool_indices=dev.req_pool_indices, seq_lens=dev.seq_lens,
            out_cache_loc=dev.out_cache_loc, seq_lens_cpu=host["seq_lens"], seq_lens_sum=sum(prefix) + sum(sizes),
            extend_prefix_lens=dev.extend_prefix_lens, extend_seq_lens=dev.extend_seq_lens,
            extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=list(sizes),
            extend_start_loc=dev.extend_start_loc, req_to_token_pool=r2t, token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend, spec_info=vi,
        )
        return runner.forward(fb, return_all_logits=True)

    def _sample(self, logits: torch.Tensor, reqs: Sequence[Req], trees: Sequence[DraftTree]) -> torch.Tensor:
        """The target's token after every node: argmax for greedy requests, else a sample
        with the request's settings at output position ``len(output_ids) + depth``."""
        if all(r.sampling_params.is_greedy for r in reqs):
            return argmax_last(logits)
        params, seeds, positions = [], [], []
        for r, t in zip(reqs, trees):
            for d in t.depths():
                params.append(r.sampling_params)
                seeds.append(r.seed)
                positions.append(len(r.output_ids) + d)
        return sample(logits, SamplingBatchInfo.from_params(params, seeds, positions, self.device))

    def _accept(self, reqs, trees, prefix, extents, loc: torch.Tensor, target: List[int]) -> VerifyResult:
        runner = self.runner
        r2t, allocator = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
        page = allocator.page_size
        out = VerifyResult()
        src, dst, rows, roots = [], [], [], []
        off = 0
        allocator.free_group_begin()
        try:
            for r, t, p, m in zip(reqs, trees, prefix, extents):
                path, bonus = accept_path(t, target[off: off + t.size])
                for d, node in enumerate(path):
                    if node != d:
                        src.append(off + node)
                        dst.append(off + d)
                new_len = p + len(path)
                tail = -(-new_len // page) * page
                if tail < p + m:
                    allocator.free(r2t.req_to_token_host[r.req_pool_idx, tail: p + m].to(torch.int64))
                r.kv_len = new_len
                out.tokens.append([t.tokens[i] for i in path[1:]] + [bonus])
                out.accepted.append(len(path) - 1)
                rows.append(r.req_pool_idx)
                roots.append(bonus)
                off += t.size
                self.stats.num_verify += 1
                self.stats.num_drafted += t.size - 1
        finally:
            allocator.free_group_end()
        if src:
            loc_dev = loc.to(self.device)
            idx = torch.tensor([src, dst], dtype=torch.int64).to(self.device)
            runner.token_to_kv_pool.copy_slots(loc_dev[idx[0]], loc_dev[idx[1]])
        self.token_map[torch.tensor(rows, dtype=torch.int64).to(self.device)] = torch.tensor(
            roots, dtype=torch.int64).to(self.device)
        return out
