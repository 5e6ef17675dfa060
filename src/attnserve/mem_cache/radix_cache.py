"""`RadixCache`: KV slots of token-id prefixes in a radix tree (SGLang's RadixAttention,
Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs",
arXiv:2312.07104, section 3; SGLang ``mem_cache/radix_cache.py``), and `ChunkCache`, the
no-op cache behind the same interface when prefix caching is off.

Each node holds a key (token ids) and the KV slots of those tokens (an int64 host tensor of
the same length). With ``page_size`` > 1 every key length is a multiple of the page size:
only whole pages are shared, and children are keyed by their first page of tokens.
``lock_ref`` counts the running requests whose prefix ends at or below a node; a locked
node is never evicted. `evict` frees least recently used unlocked leaves first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the tree: ``key`` token ids and their ``value`` slots (int64 host)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: Optional["TreeNode"] = None, key: Optional[List[int]] = None,
                 value: Optional[torch.Tensor] = None):
        self.children: Dict[object, TreeNode] = {}
        self.parent = parent
        self.key: List[int] = key or []
        self.value: torch.Tensor = _EMPTY if value is None else value
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


@dataclass
class MatchResult:
    """``slots``: int64 host ``[n]`` (n a multiple of the page size), the KV slots of the
    first n tokens of the key; ``last_node``: the deepest node covering them."""

    slots: torch.Tensor
    last_node: TreeNode


class RadixCache:
    """Args:
        allocator: the `TokenToKVPoolAllocator` evicted slots go back to (None: a key-only
            tree whose evictions just drop nodes).
        page_size: tokens per page (>= 1).
    """

    def __init__(self, allocator, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget every node (their slots are NOT freed: `evict` first)."""
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # ---- helpers -----------------------------------------------------------------------
    def _child_key(self, key: Sequence[int], pos: int = 0) -> object:
        """The children-dict key of ``key[pos:]``: its first token, or its first page."""
        return key[pos] if self.page_size == 1 else tuple(key[pos: pos + self.page_size])

    def _match_len(self, a: List[int], b: List[int], pos: int = 0) -> int:
        """Whole pages of the common prefix of ``a`` and ``b[pos:]`` (both lists). Compared
        with slice equality (C speed), not token by token: a waiting request's 8K-token
        prompt is matched on every scheduling step."""
        n = min(len(a), len(b) - pos)
        if a[:n] != b[pos: pos + n]:
            lo, step = 0, 256
            while lo + step <= n and a[lo: lo + step] == b[pos + lo: pos + lo + step]:
                lo += step
            while lo < n and a[lo] == b[pos + lo]:
                lo += 1
            n = lo
        return n // self.page_size * self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens; returns the new upper part (its parent's child)."""
        upper = TreeNode(node.parent, node.key[:at], node.value[:at])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.children[self._child_key(node.key[at:])] = node
        node.parent.children[self._child_key(node.key)] = upper
        node.parent = upper
        node.key = node.key[at:]
        node.value = node.value[at:]
        return upper

    # ---- API ---------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """The longest cached prefix of ``key`` in whole pages (splitting a node where the
        match ends inside it); refreshes the access time of the path."""
        if not isinstance(key, list):
            key = list(key)
        end = len(key) // self.page_size * self.page_size
        node = self.root
        parts: List[torch.Tensor] = []
        now = next(self._clock)
        node.last_access = now
        pos = 0
        while pos < end:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = min(self._match_len(child.key, key, pos), end - pos)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.value)
            node = child
            pos += n
        slots = torch.cat(parts) if parts else _EMPTY
        return MatchResult(slots, node)

    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int:
        """Insert ``key[:aligned]`` with ``slots[:aligned]`` (aligned: whole pages).

        Returns:
            how many leading tokens of ``key`` the tree already held; the caller still owns
            (and frees) its slots for those, the tree keeps its own.
        """
        if len(key) != slots.numel():
            raise ValueError(f"insert: {len(key)} tokens but {slots.numel()} slots")
        aligned = len(key) // self.page_size * self.page_size
        key = list(key[:aligned])
        slots = slots[:aligned].to("cpu", torch.int64)
        node = self.root
        now = next(self._clock)
        present = 0
        while present < aligned:
            child = node.children.get(self._child_key(key, present))
            if child is None:
                break
            n = self._match_len(child.key, key, present)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            present += n
            node = child
        if present < aligned:
            leaf = TreeNode(node, key[present:], slots[present:].clone())
            leaf.last_access = now
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable += len(leaf.key)
        return present

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors (a running request's prefix)."""
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo `inc_lock_ref`. Raises RuntimeError when a lock would go negative."""
        while node is not self.root and node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("RadixCache.dec_lock_ref: lock_ref would go negative")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free least recently used unlocked leaves until ``num_tokens`` tokens are evicted
        or nothing evictable is left; returns the tokens evicted."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        evicted = 0
        if self.allocator is not None:
            self.allocator.free_group_begin()
        try:
            while heap and evicted < num_tokens:
                node = heapq.heappop(heap)
                if self.allocator is not None and node.value.numel():
                    self.allocator.free(node.value)
                evicted += len(node.key)
                self._evictable -= len(node.key)
                parent = node.parent
                del parent.children[self._child_key(node.key)]
                if parent is not self.root and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, parent)
        finally:
            if self.allocator is not None:
                self.allocator.free_group_end()
        return evicted

    def evictable_size(self) -> int:
        return self._evictable

    def evictable_on_path(self, node: TreeNode) -> int:
        """Tokens of ``node`` and its ancestors that are evictable now (unlocked): what
        `evictable_size` loses when ``node`` is locked."""
        n = 0
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                n += len(node.key)
            node = node.parent
        return n

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (int64 host)."""
        vals = [n.value for n in self._nodes()]
        return torch.cat(vals) if vals else _EMPTY

    def _nodes(self) -> List[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out


class ChunkCache:
    """The no-op cache (``--disable-radix-cache``): nothing is matched or kept.

    `insert` returns ``len(key)`` ("all already present"), so a caller that frees its
    duplicate slots frees everything it passed."""

    def __init__(self, allocator=None, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode()

    def reset(self) -> None:
        pass

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        return MatchResult(_EMPTY, self.root)

    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int:
        return len(key)

    def inc_lock_ref(self, node) -> None:
        pass

    def dec_lock_ref(self, node) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def evictable_on_path(self, node) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_slots(self) -> torch.Tensor:
        return _EMPTY
