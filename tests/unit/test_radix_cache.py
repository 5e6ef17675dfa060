"""RadixCache: matching, insertion, locks, LRU eviction, and the slot-ownership invariant
on a random workload with a real allocator and a small pool."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnserve.mem_cache.allocator import TokenToKVPoolAllocator
from attnserve.mem_cache.radix_cache import ChunkCache, RadixCache


def _slots(a, n):
    s = a.alloc(n)
    assert s is not None
    return s


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_match_insert_split_whole_pages(ps):
    a = TokenToKVPoolAllocator(64 * ps, ps)
    tree = RadixCache(a, ps)
    key = list(range(100, 100 + 5 * ps + 1))  # 5 pages and one token
    kept = len(key) // ps * ps  # a token beyond the last whole page is not kept
    slots = _slots(a, len(key))
    assert tree.insert(key, slots) == 0
    assert tree.total_size() == kept and tree.evictable_size() == kept
    m = tree.match_prefix(key)
    assert m.slots.tolist() == slots[:kept].tolist()
    # a key that leaves the tree inside its only node: the node splits at a page boundary
    other = key[: 2 * ps + 1] + [7] * (3 * ps)
    shared = (2 * ps + 1) // ps * ps  # whole pages of the 2 * ps + 1 shared tokens
    m = tree.match_prefix(other)
    assert m.slots.numel() == shared and m.slots.tolist() == slots[:shared].tolist()
    other_slots = _slots(a, len(other))
    assert tree.insert(other, other_slots) == shared  # the shared pages were already there
    assert tree.total_size() == kept + (len(other) // ps * ps - shared)
    assert tree.match_prefix(other).slots[shared:].tolist() == other_slots[shared: len(other) // ps * ps].tolist()
    assert tree.match_prefix([1, 2, 3]).slots.numel() == 0


def test_locks_protect_and_eviction_is_lru():
    a = TokenToKVPoolAllocator(64, 1)
    tree = RadixCache(a, 1)
    keys = [[1, 2, 3, 4], [1, 2, 9, 9], [5, 6, 7]]
    for k in keys:
        s = _slots(a, len(k))
        present = tree.insert(k, s)
        if present:
            a.free(s[:present])  # the caller's copies of tokens the tree already had
    assert tree.total_size() == 2 + 2 + 2 + 3
    locked = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(locked)
    assert tree.protected_size() == 4 and tree.evictable_size() == 5
    tree.match_prefix([5, 6, 7])  # most recently used unlocked leaf
    assert tree.evict(1) == 2  # the least recently used unlocked leaf: [9, 9]
    assert tree.match_prefix([1, 2, 9, 9]).slots.numel() == 2
    assert tree.evict(100) == 3  # [5, 6, 7]; the locked path stays
    assert tree.match_prefix([1, 2, 3, 4]).slots.numel() == 4 and tree.evictable_size() == 0
    tree.dec_lock_ref(locked)
    with pytest.raises(RuntimeError, match="negative"):
        tree.dec_lock_ref(locked)
    assert tree.evict(100) == 4 and tree.total_size() == 0
    assert a.available_size() == a.size  # every evicted slot went back


@pytest.mark.parametrize("ps", [1, 4])
def test_long_keys_diverging_anywhere(ps):
    """Keys of 1,000 tokens that leave a cached one at positions around the 256-token
    steps of the slice comparison: the match is the shared length in whole pages, for
    list and tuple keys alike, and inserting the new key splits at the same place."""
    rnd = random.Random(ps)
    base = [rnd.randrange(1, 50_000) for _ in range(1000)]
    for at in (0, 1, 255, 256, 257, 511, 700, 999, 1000):
        a = TokenToKVPoolAllocator(4096, ps)
        tree = RadixCache(a, ps)
        tree.insert(base, _slots(a, len(base)))
        other = base[:at] + [0] * (1000 - at)
        want = at // ps * ps
        assert tree.match_prefix(other).slots.numel() == want
        assert tree.match_prefix(tuple(other)).slots.numel() == want
        assert tree.match_prefix(other[: at + 3]).slots.numel() == want
        present = tree.insert(other, _slots(a, len(other)))
        assert present == want
        assert tree.match_prefix(other).slots.numel() == len(other) // ps * ps
        assert tree.match_prefix(base).slots.numel() == len(base) // ps * ps


def test_evictable_on_path_is_what_a_lock_takes():
    """`evictable_on_path(node)`: the tokens `evictable_size` loses when ``node`` is locked
    (a path partly locked by another request counts only its unlocked part)."""
    a = TokenToKVPoolAllocator(64, 1)
    tree = RadixCache(a, 1)
    for k in ([1, 2, 3, 4], [1, 2, 9, 9, 9]):
        s = _slots(a, len(k))
        present = tree.insert(k, s)
        a.free(s[:present])
    deep = tree.match_prefix([1, 2, 9, 9, 9]).last_node
    assert tree.evictable_on_path(deep) == 5
    other = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(other)  # locks [1, 2] (shared) and [3, 4]
    before = tree.evictable_size()
    assert tree.evictable_on_path(deep) == 3  # [9, 9, 9]: [1, 2] is locked already
    tree.inc_lock_ref(deep)
    assert before - tree.evictable_size() == 3 and tree.evictable_on_path(deep) == 0
    assert tree.evictable_on_path(tree.root) == 0
    assert ChunkCache(None, 1).evictable_on_path(None) == 0


def test_chunk_cache_contract():
    c = ChunkCache(None, 1)
    assert c.match_prefix([1, 2, 3]).slots.numel() == 0
    assert c.insert([1, 2, 3], torch.tensor([4, 5, 6])) == 3  # "all present": the caller frees its copies
    assert c.evictable_size() == c.protected_size() == c.total_size() == 0 and c.evict(10) == 0


@settings(max_examples=40, deadline=None)
@given(ps=st.sampled_from([1, 2, 4]), seed=st.integers(0, 10_000), steps=st.integers(5, 60))
def test_random_workload_keeps_every_slot_owned_once(ps, seed, steps):
    """Requests sharing prefixes match, lock, allocate (evicting when short), get aborted
    or finish (insert, free duplicates and the unaligned tail, unlock). After every
    operation: every slot is free, in the tree, or held by one running request, never two
    of these; evictable + protected == tokens in the tree; locks never negative."""
    rnd = random.Random(seed)
    a = TokenToKVPoolAllocator(48 * ps, ps)
    tree = RadixCache(a, ps)
    bases = [[rnd.randrange(50) for _ in range(rnd.randrange(4, 20))] for _ in range(3)]
    running = []  # dicts: key, slots (int64), own (tokens from the tree), node

    def check():
        tree_slots = tree.all_slots().tolist()
        req_slots = [s for r in running for s in r["slots"][r["own"]:].tolist()]
        held = tree_slots + req_slots
        assert len(held) == len(set(held)), "a slot is held twice"
        held_pages = {s // ps for s in held}
        assert a.num_free_pages() + len(held_pages) == a.num_pages, "a page is lost or double counted"
        assert tree.evictable_size() + tree.protected_size() == tree.total_size()
        for node in tree._nodes():
            assert node.lock_ref >= 0

    def release(r, cache):
        aligned = len(r["slots"]) // ps * ps
        if cache and aligned > r["own"]:
            present = tree.insert(r["key"][:aligned], r["slots"][:aligned])
            if present > r["own"]:
                a.free(r["slots"][r["own"]:present])
            if len(r["slots"]) > aligned:
                a.free(r["slots"][aligned:])
        elif len(r["slots"]) > r["own"]:
            a.free(r["slots"][r["own"]:])
        tree.dec_lock_ref(r["node"])
        running[:] = [x for x in running if x is not r]  # by identity: == on dicts compares tensors

    for _ in range(steps):
        op = rnd.random()
        if op < 0.5 or not running:
            key = rnd.choice(bases) + [rnd.randrange(50) for _ in range(rnd.randrange(1, 12))]
            m = tree.match_prefix(key[:-1])
            tree.inc_lock_ref(m.last_node)
            own = m.slots.numel()
            need = len(key) - own
            pages = -(-need // ps)
            if a.num_free_pages() < pages:
                tree.evict((pages - a.num_free_pages()) * ps)
            new = a.alloc(need) if a.num_free_pages() >= pages else None
            if new is None:
                tree.dec_lock_ref(m.last_node)
            else:
                running.append({"key": key, "slots": torch.cat([m.slots, new]), "own": own, "node": m.last_node})
        else:
            r = rnd.choice(running)
            release(r, cache=op < 0.9)  # 10%: a failed request, nothing cached
        check()
    for r in list(running):
        release(r, cache=True)
    check()
    assert tree.protected_size() == 0
    assert a.available_size() + tree.evictable_size() == a.size
