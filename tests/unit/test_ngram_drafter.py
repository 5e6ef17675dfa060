"""NGRAM drafter (`attnserve.engine.speculative.ngram`): chains from repeats, the longest
window first, incremental indexing equal to a fresh build, valid bounded trees whose every
path really follows an occurrence of a suffix window, and exact agreement with a
brute-force reference of the documented rule."""

import random

import pytest

from attnserve.engine.speculative.ngram import NgramDrafter, NgramIndex
from attnserve.engine.speculative.tree import DraftTree


def _propose(tokens, max_nodes=None, **kw):
    d = NgramDrafter(**kw)
    return d.propose(NgramIndex(d, tokens), max_nodes=max_nodes)


def _occurrences(toks, w):
    """Brute force: positions p < len where toks[p-w:p] is the last w tokens."""
    n = len(toks)
    return [p for p in range(w, n) if toks[p - w:p] == toks[n - w:]]


def _reference(toks, lo, hi, n, breadth, max_nodes=None):
    """The documented rule, by brute force (no index, prefix-tuple trie)."""
    budget = n if max_nodes is None else max(1, min(n, max_nodes))
    if budget == 1:
        return DraftTree((toks[-1],), (-1,))
    cap, span, seen, stats = breadth * max(1, n - 1), budget - 1, set(), {}
    for w in range(hi, lo - 1, -1):
        for p in reversed(_occurrences(toks, w)):
            if len(seen) >= cap:
                break
            if p in seen:
                continue
            seen.add(p)
            for k in range(1, min(span, len(toks) - p) + 1):
                bw, c, r = stats.get(tuple(toks[p:p + k]), (0, 0, -1))
                stats[tuple(toks[p:p + k])] = (max(bw, w), c + 1, max(r, p))
    tokens, parents, level = [toks[-1]], [-1], [((), 0)]
    while level and len(tokens) < budget:
        cands = [(path, i) for prev, i in level for path in stats if len(path) == len(prev) + 1 and path[:-1] == prev]
        cands.sort(key=lambda pi: tuple(-x for x in stats[pi[0]]))
        level = []
        for path, parent in cands[:min(breadth, budget - len(tokens))]:
            level.append((path, len(tokens)))
            tokens.append(path[-1])
            parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def _paths(tree):
    out = [()]
    for i in range(1, tree.size):
        out.append(out[tree.parents[i]] + (tree.tokens[i],))
    return out


def _check_tree(tree, toks, lo, hi, n, breadth, max_nodes):
    DraftTree(tree.tokens, tree.parents)  # validates
    assert tree.tokens[0] == toks[-1]
    assert tree.size <= n and (max_nodes is None or tree.size <= max(1, max_nodes))
    depths = tree.depths()
    for d in set(depths):
        assert depths.count(d) <= breadth
    assert depths == sorted(depths)  # BFS order
    for kids in tree.children():
        assert len({tree.tokens[c] for c in kids}) == len(kids)  # a trie: siblings differ
    occ = {w: _occurrences(toks, w) for w in range(lo, hi + 1)}
    for path in _paths(tree)[1:]:
        assert any(toks[p:p + len(path)] == list(path) for w in occ for p in occ[w]), path
    windows = [w for w in occ if occ[w]]
    if not windows or min(n, n if max_nodes is None else max_nodes) <= 1:
        assert tree.size == 1
    else:
        assert tree.size > 1
        assert tree.tokens[1] in {toks[p] for p in occ[max(windows)]}  # the longest window ranks first


def test_repeat_drafts_its_continuation_as_a_chain():
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert _propose(toks) == DraftTree.chain(3, [4, 5, 9, 1, 2, 3])
    assert _propose(toks, num_draft_tokens=4) == DraftTree.chain(3, [4, 5, 9])
    assert _propose(toks, max_nodes=3) == DraftTree.chain(3, [4, 5])
    assert _propose(toks, min_match_window=2, max_match_window=3) == DraftTree.chain(3, [4, 5, 9, 1, 2, 3])
    # a run overlapping itself: each occurrence's continuation stops at the end
    assert _propose([7, 7, 7, 7]) == DraftTree.chain(7, [7, 7, 7])


def test_longest_window_wins_then_count_then_recency():
    # "1 2 3" -> 4 once (3-gram); "3" -> 6 twice, more recently (1-gram only)
    toks = [1, 2, 3, 4, 0, 5, 3, 6, 5, 3, 6, 0, 1, 2, 3]
    chain = _propose(toks, max_bfs_breadth=1)
    assert chain == DraftTree.chain(3, toks[3:10])
    tree = _propose(toks, max_bfs_breadth=2)
    assert tree.tokens[:3] == (3, 4, 6) and tree.parents[:3] == (-1, 0, 0)
    # with 1-grams only the more frequent continuation ranks first
    assert _propose(toks, max_match_window=1, max_bfs_breadth=1).tokens[1] == 6
    # equal windows and counts: the most recent occurrence first
    assert _propose([5, 1, 5, 2, 5], max_match_window=1).tokens[:3] == (5, 2, 1)


def test_no_match_gives_the_root_alone():
    assert _propose([1, 2, 3]) == DraftTree((3,), (-1,))
    assert _propose([4]) == DraftTree((4,), (-1,))
    # the 2-gram (1, 2) recurs but min window 3 is required
    assert _propose([1, 2, 9, 1, 2], min_match_window=3, max_match_window=4).size == 1
    assert _propose([1, 2, 3, 1, 2], num_draft_tokens=1).size == 1
    assert _propose([1, 2, 3, 1, 2], max_nodes=0).size == 1


def test_bad_flags_raise_naming_the_flag():
    with pytest.raises(ValueError, match="--speculative-ngram-min-match-window-size"):
        NgramDrafter(min_match_window=0)
    with pytest.raises(ValueError, match="--speculative-ngram-max-match-window-size"):
        NgramDrafter(min_match_window=3, max_match_window=2)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        NgramDrafter(num_draft_tokens=0)
    with pytest.raises(ValueError, match="--speculative-ngram-max-bfs-breadth"):
        NgramDrafter(max_bfs_breadth=0)
    d = NgramDrafter()
    with pytest.raises(ValueError, match="empty"):
        d.propose(NgramIndex(d))
    with pytest.raises(ValueError, match="windows"):
        d.propose(NgramIndex(NgramDrafter(2, 4), [1, 2, 3]))


@pytest.mark.parametrize("seed", range(60))
def test_incremental_extend_equals_fresh_build(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    d = NgramDrafter(lo, rng.randint(lo, 6), rng.randint(1, 9), rng.randint(1, 4))
    vocab = rng.randint(2, 5)
    toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
    index = NgramIndex(d, toks)
    while len(toks) < 40:
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        toks += new
        index.extend(new)
        fresh = NgramIndex(d, toks)
        assert index.tokens == toks and len(index) == len(toks)
        m = rng.choice([None, 1, 2, 3, 5, 100])
        assert d.propose(index, m) == d.propose(fresh, m)
        for w in range(d.min_match_window, d.max_match_window + 1):
            assert index.occurrences(w) == fresh.occurrences(w) == _occurrences(toks, w)


@pytest.mark.parametrize("seed", range(80))
def test_trees_are_valid_bounded_and_match_the_brute_force_rule(seed):
    rng = random.Random(1000 + seed)
    lo = rng.randint(1, 3)
    hi, n, breadth = rng.randint(lo, 8), rng.randint(1, 12), rng.randint(1, 5)
    d = NgramDrafter(lo, hi, n, breadth)
    vocab = rng.randint(2, 6)
    toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
    index = NgramIndex(d, toks)
    full = d.propose(index)
    assert d.propose(NgramIndex(d, list(toks))) == full  # deterministic
    for m in (None, 0, 1, 2, 4, 7, 50):
        tree = d.propose(index, m)
        _check_tree(tree, toks, lo, hi, n, breadth, m)
        assert tree == _reference(toks, lo, hi, n, breadth, m)
        assert tree == full.truncated(m if m is not None else n)
        if breadth == 1:
            assert tree.parents == tuple(range(-1, tree.size - 1))  # a chain
