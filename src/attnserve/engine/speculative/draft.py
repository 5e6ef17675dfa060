"""STANDALONE drafting: the draft model grows a tree of candidates for every request.

Before a verify step each request gets ``M = 1 + num_steps * topk`` KV slots (fewer near
its limits) at positions ``kv_len .. kv_len + M - 1`` of its ``req_to_token`` row; the draft
model's own pool (same slots, `ModelRunner` with ``draft_of``) holds its K/V there while it
drafts. Drafting index order (root, the ``topk`` nodes of depth 1, of depth 2, ...) is
topological, and node ``j``'s draft K/V sits at position ``kv_len + j``.

1. **Catch-up + root** (DRAFT_EXTEND, causal): the tokens whose draft K/V are missing --
   everything from the request's ``draft_len`` (0 for a new request; after a verify, the
   old root's position + 1) through the root -- in one forward; the root's logits give
   the depth-1 candidates. This is SGLang's draft extend over the accepted tokens.
2. **One forward per further depth** (``num_steps - 1`` of them): the ``topk`` nodes of the
   depth just chosen, each seeing the prefix and its own ancestors. A chain (``topk`` 1)
   runs them as DECODE steps in one `DraftChainRunner` call (argmax on the device, the
   attention metadata of all steps built once, one CUDA graph per batch size on a GPU); a
   tree runs one custom-mask forward (TARGET_VERIFY mode on the draft backend) per depth. Each node proposes its ``topk`` best children; the ``topk`` children of highest
   cumulative log-probability form the next depth (EAGLE-2's dynamic tree, Li et al.,
   arXiv:2406.16858; here with the draft model's own probabilities).
3. The ``num_draft_tokens - 1`` nodes of highest cumulative log-probability whose parents
   are kept form the `DraftTree` the target verifies.

Drafts are argmax / top-k choices, deterministic given the context, so the verification in
`verify` keeps the target's distribution for any sampling settings.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from attnserve.engine.sampler import argmax_last
from attnserve.engine.request import Req
from attnserve.engine.speculative.tree import DraftTree, VerifyInput
from attnserve.forward_batch import ForwardBatch, ForwardMode
from attnserve.speculative_config import SpeculativeConfig


class DraftWorker:
    """Drafts with a draft `ModelRunner` (built with ``draft_of`` the target's runner).

    Args:
        config: the checked flags (``num_steps``, ``topk``, ``num_draft_tokens``).
        runner: the draft model's runner.
    """

    def __init__(self, config: SpeculativeConfig, runner, capture_bs: Sequence[int] = ()):
        self.config = config
        self.runner = runner
        self.device = torch.device(runner.device)
        self._draft_len: Dict[str, int] = {}
        self.chain = None  # topk 1: the decode steps after the root as one unit (graphs on CUDA)
        if config.topk == 1 and config.num_steps > 1:
            from attnserve.engine.speculative.draft_chain import DraftChainRunner

            self.chain = DraftChainRunner(runner, config.num_steps - 1, capture_bs)

    def extent(self, limit: int) -> int:
        """Slots a request reserves for drafting, given the most nodes it may verify."""
        return max(1, min(1 + self.config.num_steps * self.config.topk, limit))

    def forget(self, req: Req) -> None:
        """The request's draft K/V are gone (finished, aborted or retracted)."""
        self._draft_len.pop(req.rid, None)

    def after_verify(self, reqs: Sequence[Req], roots: Sequence[int]) -> None:
        """After a verify: draft K/V stay valid up to each old root (position ``roots[i]``)."""
        for r, p in zip(reqs, roots):
            self._draft_len[r.rid] = p + 1

    # ---- drafting ----------------------------------------------------------------------
    def draft(self, reqs: Sequence[Req], prefix: Sequence[int], extents: Sequence[int],
              limits: Sequence[int]) -> List[DraftTree]:
        """Draft trees for ``reqs`` (``prefix[i]`` = ``kv_len``; slots for positions
        ``prefix[i] .. prefix[i] + extents[i] - 1`` already in their rows; at most
        ``limits[i]`` nodes each)."""
        cfg = self.config
        topk = cfg.topk
        if topk == 1:
            return self._draft_chain(reqs, prefix, extents, limits)
        r2t = self.runner.req_to_token_pool
        bs = len(reqs)
        # per request: drafted nodes as (token, parent, depth, score)
        nodes: List[List[tuple]] = [[(r.output_ids[-1], -1, 0, 0.0)] for r in reqs]
        depths = [(e - 1) // topk for e in extents]  # depths each request can draft
        lp = torch.log_softmax(self._catch_up(reqs, prefix).float(), dim=-1)
        logprobs = {i: lp[i: i + 1] for i in range(bs)}
        frontier = [[0] for _ in range(bs)]  # node indices at the current depth
        for depth in range(1, max(depths, default=0) + 1):
            active = [i for i in range(bs) if depths[i] >= depth]
            # children of every frontier node, best topk by cumulative score
            for i in active:
                parent_lp = logprobs[i]  # [len(frontier[i]), V]
                base = torch.tensor([nodes[i][f][3] for f in frontier[i]], dtype=torch.float32)
                top_lp, top_tok = torch.topk(parent_lp.float().cpu(), topk, dim=-1)
                cand = (base[:, None] + top_lp).flatten()
                best = torch.topk(cand, topk).indices.tolist()
                new = []
                for c in sorted(best, key=lambda c: -float(cand[c])):
                    f = frontier[i][c // topk]
                    nodes[i].append((int(top_tok.flatten()[c]), f, depth, float(cand[c])))
                    new.append(len(nodes[i]) - 1)
                frontier[i] = new
            if depth == max(depths):
                break
            nxt = [i for i in active if depths[i] > depth]
            if not nxt:
                break
            logprobs = dict(zip(nxt, self._expand(
                [reqs[i] for i in nxt], [prefix[i] for i in nxt], [nodes[i] for i in nxt],
                [frontier[i] for i in nxt], r2t)))
        return [self._select(n, min(cfg.num_draft_tokens, lim)) for n, lim in zip(nodes, limits)]

    def _draft_chain(self, reqs, prefix, extents, limits) -> List[DraftTree]:
        """Chains (topk 1): the root's argmax, then `DraftChainRunner` for the deeper
        tokens, one host read at the end."""
        bs = len(reqs)
        first = argmax_last(self._catch_up(reqs, prefix))  # depth-1 tokens [bs]
        # drafted tokens each request keeps: its reserved depth and its tree size bound
        keep = [max(0, min(e - 1, min(self.config.num_draft_tokens, lim) - 1)) for e, lim in zip(extents, limits)]
        tokens = first.view(-1, 1)
        if self.chain is not None and max(keep) > 1:
            s = self.chain.num_steps
            steps = [min(k - 1, s) if k > 1 else 0 for k in keep]
            host = torch.zeros(3 + s, bs, dtype=torch.int64)  # rows, seq_lens, step_limits, then slots
            r2t = self.runner.req_to_token_pool.req_to_token_host
            for i, (r, p, n) in enumerate(zip(reqs, prefix, steps)):
                host[0, i] = r.req_pool_idx
                host[1, i] = p + 2
                host[2, i] = n - 1
                if n:
                    host[3: 3 + n, i] = r2t[r.req_pool_idx, p + 1: p + 1 + n]
            dev = host.to(self.device)
            rest = self.chain.run(dev[0], dev[1].to(torch.int32), dev[2].to(torch.int32), first, dev[3:])
            tokens = torch.cat([tokens, rest], dim=1)
        rows = tokens.tolist()
        trees = []
        for r, row, k in zip(reqs, rows, keep):
            toks = (r.output_ids[-1],) + tuple(row[:k])
            trees.append(DraftTree(toks, tuple(range(-1, len(toks) - 1))))
        return trees

    def _catch_up(self, reqs, prefix) -> torch.Tensor:
        """DRAFT_EXTEND over each request's tokens without draft K/V, through the root;
        returns the root's logits ``[bs, V]``."""
        r2t = self.runner.req_to_token_pool
        starts = [min(self._draft_len.get(r.rid, 0), p) for r, p in zip(reqs, prefix)]
        ids, pos, slots, ext = [], [], [], []
        for r, s, p in zip(reqs, starts, prefix):
            ids.extend(r.fill_ids[s: p + 1])
            pos.extend(range(s, p + 1))
            slots.append(r2t.req_to_token_host[r.req_pool_idx, s: p + 1])
            ext.append(p + 1 - s)
        fb = self._batch(ForwardMode.DRAFT_EXTEND, reqs, starts, ext, ids, pos, torch.cat(slots))
        return self.runner.forward(fb)

    def _expand(self, reqs, prefix, nodes, frontier, r2t) -> List[torch.Tensor]:
        """One draft forward over the frontier nodes (chain: DECODE; tree: masked)."""
        topk = self.config.topk
        ids, pos, slots, pre, ext = [], [], [], [], []
        masks, indptr = [], [0]
        for r, p, nd, fr in zip(reqs, prefix, nodes, frontier):
            s = fr[0]
            for j in fr:
                ids.append(nd[j][0])
                pos.append(p + nd[j][2])
            slots.append(r2t.req_to_token_host[r.req_pool_idx, p + s: p + s + len(fr)])
            pre.append(p + s)
            ext.append(len(fr))
            if topk > 1:
                block = torch.zeros(len(fr), p + s + len(fr), dtype=torch.bool)
                block[:, :p] = True
                for q, j in enumerate(fr):
                    a = j
                    while a >= 0:
                        block[q, p + a] = True
                        a = nd[a][1]
                masks.append(block.reshape(-1))
                indptr.append(indptr[-1] + block.numel())
        slots_t = torch.cat(slots)
        if topk == 1:
            fb = self._batch(ForwardMode.DECODE, reqs, pre, ext, ids, pos, slots_t)
            logits = self.runner.forward(fb)
        else:
            spec = VerifyInput(torch.cat(masks).to(self.device), torch.tensor(indptr, dtype=torch.int64).to(self.device),
                               torch.tensor(pos, dtype=torch.int64).to(self.device), ext)
            fb = self._batch(ForwardMode.TARGET_VERIFY, reqs, pre, ext, ids, pos, slots_t, spec)
            logits = self.runner.forward(fb, return_all_logits=True)
        lp = torch.log_softmax(logits.float(), dim=-1)
        out, off = [], 0
        for e in ext:
            out.append(lp[off: off + e])
            off += e
        return out

    def _batch(self, mode, reqs, prefix, ext, ids, pos, slots, spec=None) -> ForwardBatch:
        r = self.runner
        dev = self.device
        seq = [p + e for p, e in zip(prefix, ext)]
        starts = torch.tensor([0] + list(ext[:-1]), dtype=torch.int64).cumsum(0)
        return ForwardBatch(
            forward_mode=mode, batch_size=len(reqs), input_ids=torch.tensor(ids, dtype=torch.int64).to(dev),
            positions=torch.tensor(pos, dtype=torch.int64).to(dev),
            req_pool_indices=torch.tensor([q.req_pool_idx for q in reqs], dtype=torch.int64).to(dev),
            seq_lens=torch.tensor(seq, dtype=torch.int32).to(dev), out_cache_loc=slots.to(torch.int64).to(dev),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32), seq_lens_sum=sum(seq),
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32).to(dev),
            extend_seq_lens=torch.tensor(ext, dtype=torch.int32).to(dev),
            extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=list(ext),
            extend_start_loc=starts.to(torch.int32).to(dev), req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool, attn_backend=r.attn_backend, spec_info=spec,
        )

    @staticmethod
    def _select(nodes: List[tuple], n: int) -> DraftTree:
        """The root and the ``n - 1`` best-scored nodes whose parents are kept, in drafting
        (topological) order."""
        order = sorted(range(1, len(nodes)), key=lambda j: (-nodes[j][3], nodes[j][2], j))
        keep = {0}
        for j in order:
            if len(keep) >= n:
                break
            if nodes[j][1] in keep:
                keep.add(j)
        kept = sorted(keep)
        index = {j: k for k, j in enumerate(kept)}
        return DraftTree(tuple(nodes[j][0] for j in kept), tuple(-1 if j == 0 else index[nodes[j][1]] for j in kept))
