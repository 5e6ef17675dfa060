"""`PrefixCacheManager`: how requests take KV from, and give KV to, the tree cache.

The tree (`attnserve.mem_cache.radix_cache.RadixCache`, or `ChunkCache` when
``--disable-radix-cache``) owns the slots of every cached prefix. A request owns the
slots of the tokens it computed itself. The rules (SGLang's ``cache_unfinished_req`` /
``cache_finished_req``, ``mem_cache/radix_cache.py``):

* Admission (`match` + `attach`): the longest cached prefix of ``fill_ids[:-1]`` (at least
  one token is always computed, so the step has logits) is locked in the tree and its slots
  written into the request's ``req_to_token`` row; ``kv_len`` starts there.
* After each prefill chunk (`cache_unfinished`): the request's page-aligned computed
  tokens are inserted, so requests that arrive later share them at once; tokens another
  request inserted meanwhile are deduplicated (the request's copies freed, its row pointed
  at the tree's slots) and the lock moves to the new deepest node.
* Finish, abort and retraction (`release`): prompt + output with K/V are inserted (the
  unaligned tail and duplicates freed), the lock is dropped, the row returned. A request
  whose K/V were never computed (its step failed) gives its own slots back uncached.

Every slot is therefore free, or held by exactly one of the tree and a running request.
The pending overlap step may still be writing a slot when it enters the tree or is freed;
every later reader or writer of it is a later launch on the same stream, so it sees the
finished write.
"""

from __future__ import annotations

import torch

from attnserve.engine.request import Req
from attnserve.mem_cache.radix_cache import MatchResult


class PrefixCacheManager:
    """Args:
        tree_cache: a `RadixCache` or `ChunkCache`.
        allocator: the `TokenToKVPoolAllocator` the tree frees into.
        req_to_token_pool: the `ReqToTokenPool` whose rows the requests own.
    """

    def __init__(self, tree_cache, allocator, req_to_token_pool):
        self.tree = tree_cache
        self.allocator = allocator
        self.r2t = req_to_token_pool
        self.page_size = allocator.page_size

    # ---- sizes -------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Slots that can be handed out: free in the allocator or evictable from the tree."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def available_tokens_after_attach(self, match: MatchResult) -> int:
        """`available_tokens` once ``match`` is locked by an admitted request: its cached
        prefix is no longer evictable (SGLang's ``PrefillAdder`` checks the budget again
        with the prefix locked). Without this, a retracted request whose own K/V went to
        the tree counts them as free space, is re-admitted at once and retracted again."""
        return self.available_tokens() - self.tree.evictable_on_path(match.last_node)

    def make_room(self, num_pages: int) -> bool:
        """Evict least recently used cached prefixes until ``num_pages`` pages are free;
        True when they are."""
        short = num_pages - self.allocator.num_free_pages()
        if short > 0:
            self.tree.evict(short * self.page_size)
        return self.allocator.num_free_pages() >= num_pages

    # ---- admission ---------------------------------------------------------------------
    def match(self, req: Req) -> MatchResult:
        """Longest cached prefix of ``req.fill_ids`` that leaves one token to compute."""
        return self.tree.match_prefix(req.fill_ids[:-1])

    def attach(self, req: Req, match: MatchResult) -> None:
        """Lock ``match`` for ``req`` (which has a ``req_to_token`` row) and start its
        ``kv_len`` after the cached prefix."""
        n = int(match.slots.numel())
        self.tree.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.cache_own_len = n
        req.kv_len = n
        req.kv_committed = True
        if n:
            self.r2t.write(req.req_pool_idx, 0, match.slots)
        req.cached_tokens = max(req.cached_tokens, min(n, len(req.prompt_ids)))

    # ---- after a prefill chunk ---------------------------------------------------------
    def cache_unfinished(self, req: Req) -> None:
        """Insert ``req``'s page-aligned computed tokens and move its lock to them."""
        aligned = req.kv_len // self.page_size * self.page_size
        own = req.cache_own_len
        if aligned <= own:
            return
        key = req.fill_ids[:aligned]
        slots = self.r2t.slots_of(req.req_pool_idx, aligned).to(torch.int64)
        present = self.tree.insert(key, slots)
        match = self.tree.match_prefix(key)
        if match.slots.numel() < aligned:  # no cache (ChunkCache): nothing was kept
            return
        if present > own:  # tokens another request cached meanwhile: use the tree's slots
            self.allocator.free(slots[own:present])
            self.r2t.write(req.req_pool_idx, own, match.slots[own:present])
        self.tree.dec_lock_ref(req.last_node)
        self.tree.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.cache_own_len = aligned

    # ---- finish / abort / retract ------------------------------------------------------
    def release(self, req: Req, cache: bool = True) -> None:
        """Give ``req``'s K/V to the tree (``cache``, when they were computed) or back to
        the allocator, drop its lock and free its row."""
        row = req.req_pool_idx
        if row is None:
            return
        own = req.cache_own_len
        if req.kv_len > own:
            slots = self.r2t.slots_of(row, req.kv_len).to(torch.int64)
            keep_from = own
            if cache and req.kv_committed:
                valid = min(req.kv_len, len(req.fill_ids))  # an overlap extra step may exceed it by one
                aligned = valid // self.page_size * self.page_size
                if aligned > own:
                    # the tree keeps slots[present:aligned]; slots[own:present] duplicate
                    # tokens it already had (present >= own: our prefix is locked there)
                    present = self.tree.insert(req.fill_ids[:aligned], slots[:aligned])
                    if present > own:
                        self.allocator.free(slots[own:present])
                    keep_from = aligned
            if req.kv_len > keep_from:
                self.allocator.free(slots[keep_from:])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = None
        req.cache_own_len = 0
        self.r2t.free(row)
        req.req_pool_idx = None
        req.kv_len = 0
