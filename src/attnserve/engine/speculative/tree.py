"""Draft trees and the verify inputs built from them.

A draft for one request is a tree of ``n`` nodes in topological order: node 0 is the
*root*, the request's last sampled token (its K/V not yet computed, exactly the input of a
plain decode step); every other node ``i`` holds a drafted token and a parent
``parents[i] < i``. A chain (``topk`` 1) has ``parents = [-1, 0, 1, ...]``.

For the target's TARGET_VERIFY forward the ``n`` nodes are laid at positions ``kv_len +
i`` of the request's ``req_to_token`` row (so their K/V slots come from an ordinary extend
allocation) while their RoPE positions are ``kv_len + depth(i)``; a node sees the cached
prefix and its own ancestors (itself included). After verification the accepted path
``0 = p_0, p_1, ..., p_a`` is moved to positions ``kv_len .. kv_len + a``
(`compact_accepted_kv`), as SGLang does for tree drafts (seed 004, "Tree Mask").

Mask layout (the one `TritonAttnBackend` and `TorchNativeAttnBackend` read from
``spec_info.custom_mask``): per request a row-major bool block ``[n_i, kv_len_i + n_i]``
(query node, key position) starting at ``mask_indptr[i]``, requests concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from attnserve.forward_batch import VerifyInput  # noqa: F401 (re-export)


@dataclass(frozen=True)
class DraftTree:
    """One request's draft: ``tokens[i]`` at node ``i``, ``parents[i]`` its parent (-1 for
    the root). ``tokens[0]`` is the root (last sampled token).

    Raises ValueError (at construction) when the lists differ in length, are empty, node 0
    is not the only root, or a parent does not precede its child.
    """

    tokens: tuple
    parents: tuple

    def __post_init__(self):
        n = len(self.tokens)
        if n == 0 or len(self.parents) != n:
            raise ValueError(f"a draft tree needs as many parents as tokens (>= 1), got {n} and {len(self.parents)}")
        if self.parents[0] != -1:
            raise ValueError("node 0 is the root: parents[0] must be -1")
        for i in range(1, n):
            if not 0 <= self.parents[i] < i:
                raise ValueError(f"node {i} has parent {self.parents[i]}: parents must precede their children")

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> "DraftTree":
        """A linear draft: ``root`` followed by ``drafts``."""
        return cls((int(root), *map(int, drafts)), tuple(range(-1, len(drafts))))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def depths(self) -> List[int]:
        """Depth of every node (root 0)."""
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self) -> List[List[int]]:
        """Children of every node, in node order."""
        out: List[List[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            out[self.parents[i]].append(i)
        return out

    def truncated(self, n: int) -> "DraftTree":
        """The first ``n`` nodes (a valid tree: parents precede children)."""
        n = max(1, min(int(n), self.size))
        return DraftTree(self.tokens[:n], self.parents[:n])

    def ancestor_mask(self) -> torch.Tensor:
        """bool ``[n, n]``: ``mask[i, j]`` when node ``j`` is ``i`` or an ancestor of ``i``."""
        return torch.tensor(self.ancestor_rows(), dtype=torch.bool)

    def ancestor_rows(self) -> List[List[bool]]:
        """`ancestor_mask` as nested lists (built in Python, no per-element tensor writes)."""
        n = self.size
        rows = []
        for i in range(n):
            row = [False] * n
            j = i
            while j >= 0:
                row[j] = True
                j = self.parents[j]
            rows.append(row)
        return rows


def build_verify_input(trees: Sequence[DraftTree], prefix_lens: Sequence[int],
                       device: Optional[torch.device] = None, covers_prefix: bool = True) -> VerifyInput:
    """Masks and positions of a verify step: request ``i`` has ``prefix_lens[i]`` cached
    tokens and the nodes of ``trees[i]`` at the positions after them (module doc). With
    ``covers_prefix=False`` each block is ``[n_i, n_i]`` over the nodes only (the prefix is
    fully visible). Built on the host, copied once."""
    blocks, positions, indptr = [], [], [0]
    for tree, p in zip(trees, prefix_lens):
        n = tree.size
        if covers_prefix:
            block = torch.ones(n, p + n, dtype=torch.bool)
            block[:, p:] = tree.ancestor_mask()
        else:
            block = tree.ancestor_mask()
        blocks.append(block.reshape(-1))
        indptr.append(indptr[-1] + block.numel())
        positions.extend(p + d for d in tree.depths())
    dev = device if device is not None else torch.device("cpu")
    return VerifyInput(
        custom_mask=torch.cat(blocks).to(dev),
        mask_indptr=torch.tensor(indptr, dtype=torch.int64).to(dev),
        positions=torch.tensor(positions, dtype=torch.int64).to(dev),
        draft_token_num=[t.size for t in trees],
        mask_covers_prefix=covers_prefix,
    )


def accept_path(tree: DraftTree, target_tokens: Sequence[int]) -> tuple:
    """Walk ``tree`` with the target's token at every node (``target_tokens[i]``: argmax or
    a sample of the target's distribution after node ``i``'s prefix).

    From the root, move to the child whose drafted token equals the target's token at the
    current node, while one does. Returns ``(path, bonus)``: the accepted node indices
    (``path[0] == 0``; ``len(path) - 1`` drafted tokens accepted) and the target's token at
    the last node (the next root). With a sample at each node this is per-level rejection
    sampling for a draft that proposes tokens deterministically (its proposal is a point
    mass, so child ``c`` is accepted with probability ``p(c)`` of what remains; Leviathan
    et al., arXiv:2211.17192; Miao et al., SpecInfer, arXiv:2305.09781): the emitted tokens
    are distributed exactly as the target's.
    """
    kids = tree.children()
    path = [0]
    node = 0
    while True:
        want = int(target_tokens[node])
        nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt
