"""Speculative sampling keeps the target's distribution (statistical test on the host).

A toy target "model" over a vocabulary of ``V`` tokens gives logits that are a fixed,
seeded function of the *whole* context, so the exact distribution of the ``L`` tokens
generated after a prompt is computable by enumeration (``V ** L`` sequences), with the
filters applied exactly as `attnserve.engine.sampler` defines them, in float64.

A toy drafter (a second seeded function, correlated with the target so drafts are sometimes
right and sometimes wrong) proposes deterministic trees: a chain of its two most likely
continuations, a breadth-2 tree, or a per-context mix of shapes (root only, chain of 3,
branching tree) limited to what the request may still emit, as `SpecDecoder.plan` does.

The speculative loop is simulated as `SpecDecoder.verify` runs it: context -> tree (root =
last token) -> target logits at every node (the model on the context plus the path to the
node) -> one batched `sample` over every node of every request, the node at depth ``d`` of
a request with ``len(output)`` tokens sampled at position ``len(output) + d`` with the
request's seed -> `accept_path` -> accepted drafts + bonus appended, until ``L`` tokens
(extra ones cut). Checked, for many seeds:

* the outputs are identical, token for token, to plain sampling with the same seeds (one
  token per step at position ``len(output)``), the property the design claims;
* every output lies in the support of the exact distribution, and a chi-square goodness of
  fit of the outputs against the exact distribution does not reject (p > 1e-3), while the
  same statistic against a wrong distribution (another temperature) rejects (p < 1e-6);
* drafts are really both accepted and rejected (the test is not vacuous);
* greedy requests (temperature 0, and top_k 1) decode exactly the argmax sequence;
* a loop that forgets the depth in the noise position is caught by the identity check.

The chi-square p-value is the regularized upper incomplete gamma function, computed here
(scipy is not a dependency) and checked against closed forms.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections import Counter
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch

from attnserve.engine.sampler import SamplingBatchInfo, sample
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.speculative.tree import DraftTree, accept_path

V = 5  # vocabulary
L = 3  # generated tokens per sequence (V ** L = 125 outcomes)
PROMPT = (2, 0)
N_SEQ = 20_000  # sequences (seeds) per sampled case
SEEDS = tuple(range(10_000, 10_000 + N_SEQ))
TARGET_SALT, DRAFT_SALT, SHAPE_SALT = 11, 23, 37
LOGIT_SCALE = 1.5
DRAFT_NOISE = 1.2  # drafter logits = target logits + DRAFT_NOISE * independent noise
FILTER_MARGIN = 1e-4  # min distance of any top-p / min-p decision from its threshold

CASES = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7-top_p0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "top_k2": SamplingParams(temperature=1.0, top_k=2),
    "t1.3-min_p0.15": SamplingParams(temperature=1.3, min_p=0.15),
}
# the deliberately wrong distribution: same filters, another temperature
WRONG = {
    "t1.0": SamplingParams(temperature=1.3),
    "t0.7-top_p0.8": SamplingParams(temperature=0.9, top_p=0.8),
    "top_k2": SamplingParams(temperature=1.4, top_k=2),
    "t1.3-min_p0.15": SamplingParams(temperature=1.7, min_p=0.15),
}
SHAPES = ["chain", "tree", "mixed"]


# ---- toy models -------------------------------------------------------------------------

def _crc(salt: int, ctx: Sequence[int]) -> int:
    return zlib.crc32(bytes([salt, len(ctx), *ctx]))


@lru_cache(maxsize=None)
def _noise(salt: int, ctx: Tuple[int, ...]) -> Tuple[float, ...]:
    g = torch.Generator().manual_seed(_crc(salt, ctx))
    return tuple(torch.randn(V, generator=g, dtype=torch.float32).tolist())


def target_logits(ctx: Tuple[int, ...]) -> np.ndarray:
    """float32 ``[V]``: a fixed function of the whole context."""
    return (np.asarray(_noise(TARGET_SALT, ctx), dtype=np.float32) * np.float32(LOGIT_SCALE)).astype(np.float32)


def draft_logits(ctx: Tuple[int, ...]) -> np.ndarray:
    """The drafter's (different but correlated) logits."""
    return target_logits(ctx).astype(np.float64) + DRAFT_NOISE * np.asarray(_noise(DRAFT_SALT, ctx))


def _top(ctx: Tuple[int, ...], k: int) -> List[int]:
    return [int(t) for t in np.argsort(-draft_logits(ctx), kind="stable")[:k]]


@lru_cache(maxsize=None)
def propose(ctx: Tuple[int, ...], shape: str) -> DraftTree:
    """A deterministic draft tree for ``ctx`` (root = its last token)."""
    root = ctx[-1]
    if shape == "mixed":
        shape = ("root", "chain3", "wide")[_crc(SHAPE_SALT, ctx) % 3]
    if shape == "root":
        return DraftTree((root,), (-1,))
    if shape in ("chain", "chain3"):
        drafts: List[int] = []
        for _ in range(2 if shape == "chain" else 3):
            drafts.append(_top(ctx + tuple(drafts), 1)[0])
        return DraftTree.chain(root, drafts)
    c1, c2 = _top(ctx, 2)
    if shape == "tree":  # breadth 2, each child extended by the drafter's best token
        (g1,), (g2,) = _top(ctx + (c1,), 1), _top(ctx + (c2,), 1)
        return DraftTree((root, c1, c2, g1, g2), (-1, 0, 0, 1, 2))
    assert shape == "wide"  # breadth 2 at the root and under its first child
    g11, g12 = _top(ctx + (c1,), 2)
    (g2,) = _top(ctx + (c2,), 1)
    return DraftTree((root, c1, c2, g11, g12, g2), (-1, 0, 0, 1, 1, 2))


def node_contexts(ctx: Tuple[int, ...], tree: DraftTree) -> List[Tuple[int, ...]]:
    """The context after every node: ``ctx`` plus the drafted tokens on the path to it."""
    out: List[Tuple[int, ...]] = [ctx]
    for i in range(1, tree.size):
        out.append(out[tree.parents[i]] + (tree.tokens[i],))
    return out


class LogitRows:
    """Target logits of contexts gathered into one ``[n, V]`` tensor (one row per distinct
    context)."""

    def __init__(self):
        self.index: Dict[Tuple[int, ...], int] = {}
        self.rows: List[np.ndarray] = []

    def __call__(self, ctx: Tuple[int, ...]) -> int:
        i = self.index.get(ctx)
        if i is None:
            i = self.index[ctx] = len(self.rows)
            self.rows.append(target_logits(ctx))
        return i

    def gather(self, ids: Sequence[int]) -> torch.Tensor:
        table = torch.from_numpy(np.stack(self.rows))
        return table[torch.tensor(ids, dtype=torch.int64)]


# ---- the two decoding loops ---------------------------------------------------------------

def plain_outputs(params: SamplingParams, seeds: Sequence[int], prompt=PROMPT, n_tokens=L) -> List[tuple]:
    """Non-speculative decoding: one token per step at position ``len(output)``."""
    outs: List[tuple] = [()] * len(seeds)
    rows = LogitRows()
    for pos in range(n_tokens):
        ids = [rows(prompt + o) for o in outs]
        info = SamplingBatchInfo.from_params([params] * len(seeds), seeds, [pos] * len(seeds), "cpu")
        toks = sample(rows.gather(ids), info).tolist()
        outs = [o + (t,) for o, t in zip(outs, toks)]
    return outs


def speculative_outputs(params: SamplingParams, seeds: Sequence[int], shape: str, prompt=PROMPT, n_tokens=L,
                        depth_in_position: bool = True):
    """The speculative loop of `SpecDecoder` (module doc). Returns the outputs and
    ``(verifies, drafted, accepted)`` counts. ``depth_in_position=False`` is a deliberately
    broken variant (every node of a tree sampled at position ``len(output)``)."""
    outs: List[List[int]] = [[] for _ in seeds]
    rows = LogitRows()
    active = list(range(len(seeds)))
    n_verify = n_drafted = n_accepted = 0
    while active:
        ids, row_seeds, positions, trees = [], [], [], []
        for r in active:
            ctx = prompt + tuple(outs[r])
            tree = propose(ctx, shape)
            if shape == "mixed":  # as SpecDecoder.plan: never more nodes than tokens left to emit
                tree = tree.truncated(n_tokens - len(outs[r]))
            trees.append(tree)
            ids.extend(rows(c) for c in node_contexts(ctx, tree))
            row_seeds.extend([seeds[r]] * tree.size)
            positions.extend(len(outs[r]) + (d if depth_in_position else 0) for d in tree.depths())
        info = SamplingBatchInfo.from_params([params] * len(ids), row_seeds, positions, "cpu")
        target = sample(rows.gather(ids), info).tolist()
        off = 0
        for r, tree in zip(active, trees):
            path, bonus = accept_path(tree, target[off: off + tree.size])
            off += tree.size
            outs[r].extend([tree.tokens[i] for i in path[1:]] + [bonus])
            n_verify += 1
            n_drafted += tree.size - 1
            n_accepted += len(path) - 1
        assert off == len(target)
        active = [r for r in active if len(outs[r]) < n_tokens]
    return [tuple(o[:n_tokens]) for o in outs], (n_verify, n_drafted, n_accepted)


# ---- exact distribution -------------------------------------------------------------------

def filtered_probs(logits: np.ndarray, p: SamplingParams) -> Tuple[np.ndarray, float]:
    """float64 next-token distribution from the definitions in sampler.py's docstring, and
    the smallest distance of a top-p / min-p decision from its threshold (inf if none)."""
    x = logits.astype(np.float64)
    if p.is_greedy:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out, math.inf
    x = x / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = np.ones(V, dtype=bool)
    margin = math.inf
    if p.min_p > 0:  # drop tokens below min_p * p_max
        thr = p.min_p * probs.max()
        keep &= probs >= thr
        margin = min(margin, float(np.min(np.abs(probs - thr))))
    order = np.argsort(-x, kind="stable")
    if p.top_k > 0:  # keep the k most likely
        keep[order[p.top_k:]] = False
    if p.top_p < 1:  # smallest sorted prefix whose mass reaches top_p
        q = np.where(keep, probs, 0.0)
        q = (q / q.sum())[order]
        before = np.cumsum(q) - q
        live = q > 0
        margin = min(margin, float(np.min(np.abs(before[live] - p.top_p))))
        keep[order[before >= p.top_p]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum(), margin


def exact_distribution(p: SamplingParams, prompt=PROMPT, n_tokens=L) -> Tuple[Dict[tuple, float], float]:
    """Probability of every ``n_tokens`` output, and the smallest filter margin met."""
    dist: Dict[tuple, float] = {}
    margin = math.inf
    cache: Dict[tuple, np.ndarray] = {}
    for seq in itertools.product(range(V), repeat=n_tokens):
        prob = 1.0
        for i, tok in enumerate(seq):
            ctx = prompt + seq[:i]
            if ctx not in cache:
                cache[ctx], m = filtered_probs(target_logits(ctx), p)
                margin = min(margin, m)
            prob *= cache[ctx][tok]
        dist[seq] = prob
    return dist, margin


# ---- chi-square ---------------------------------------------------------------------------

def _gammaincc(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series below a + 1, else Lentz's
    continued fraction; Numerical Recipes 6.2)."""
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        ap, term = a, 1.0 / a
        total = term
        for _ in range(100_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi2_dof >= stat)."""
    if math.isinf(stat):
        return 0.0
    return _gammaincc(dof / 2.0, stat / 2.0)


def chi_square(counts: Counter, dist: Dict[tuple, float], n: int) -> Tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value of ``counts`` (``n`` samples)
    against ``dist``. Bins expecting fewer than 5 samples are pooled (the pool is merged
    with the smallest remaining bins until it expects 5); a sample where ``dist`` puts no
    mass gives an infinite statistic."""
    if any(dist.get(k, 0.0) == 0.0 for k in counts):
        return math.inf, 0, 0.0
    bins = sorted(((dist[k] * n, counts.get(k, 0)) for k in dist if dist[k] > 0), key=lambda b: b[0])
    pool_e = pool_o = 0.0
    while bins and (bins[0][0] < 5 or (0 < pool_e < 5)):
        e, o = bins.pop(0)
        pool_e, pool_o = pool_e + e, pool_o + o
    if pool_e > 0:
        bins.append((pool_e, pool_o))
    stat = sum((o - e) ** 2 / e for e, o in bins)
    dof = len(bins) - 1
    return stat, dof, chi2_sf(stat, dof)


def test_chi2_sf_matches_closed_forms():
    for x in (0.1, 1.0, 3.0, 10.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-10)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(124.342113404, 100) == pytest.approx(0.05, rel=1e-6)  # chi2.ppf(0.95, 100)
    assert chi2_sf(200.0, 100) < 1e-7 and chi2_sf(50.0, 100) > 0.999


# ---- the statistical tests ----------------------------------------------------------------

@lru_cache(maxsize=None)
def _plain(case: str) -> tuple:
    return tuple(plain_outputs(CASES[case], SEEDS))


@lru_cache(maxsize=None)
def _exact(case: str) -> Dict[tuple, float]:
    dist, margin = exact_distribution(CASES[case])
    # no top-p / min-p decision is close enough to its threshold for float32 vs float64 to flip it
    assert margin > FILTER_MARGIN, (case, margin)
    return dist


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_keeps_the_target_distribution(case, shape):
    params = CASES[case]
    spec, (n_verify, n_drafted, n_accepted) = speculative_outputs(params, SEEDS, shape)
    plain = _plain(case)

    # identical to plain sampling with the same seeds, token for token
    diff = [i for i, (a, b) in enumerate(zip(spec, plain)) if a != b]
    assert not diff, f"{len(diff)} sequences differ, e.g. seed {SEEDS[diff[0]]}: {spec[diff[0]]} vs {plain[diff[0]]}"

    # drafts were both accepted and rejected, and speculation saved steps
    assert 0.05 < n_accepted / n_drafted < 0.95, (n_accepted, n_drafted)
    assert n_verify < L * N_SEQ, n_verify

    dist = _exact(case)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)
    counts = Counter(spec)
    outside = [k for k in counts if dist[k] == 0.0]
    assert not outside, f"outputs outside the filtered support: {outside[:5]}"
    stat, dof, p = chi_square(counts, dist, N_SEQ)
    assert dof >= 5 and p > 1e-3, (case, shape, stat, dof, p)

    # the same statistic rejects a wrong distribution (so the check above has power)
    wrong, _ = exact_distribution(WRONG[case])
    w_stat, w_dof, w_p = chi_square(counts, wrong, N_SEQ)
    assert w_p < 1e-6, (case, shape, w_stat, w_dof, w_p)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=1)],
                         ids=["t0", "top_k1"])
def test_greedy_speculation_is_argmax_decoding(params, shape):
    n_tokens = 6
    prompts = list(itertools.product(range(V), repeat=2))
    for prompt in prompts:
        expect: tuple = ()
        for _ in range(n_tokens):
            expect += (int(np.argmax(target_logits(prompt + expect))),)
        seeds = [0, 1, 2**40 + 3]
        spec, (_, n_drafted, n_accepted) = speculative_outputs(params, seeds, shape, prompt=prompt, n_tokens=n_tokens)
        assert spec == [expect] * len(seeds), (prompt, spec, expect)
        assert plain_outputs(params, seeds, prompt=prompt, n_tokens=n_tokens) == [expect] * len(seeds)


def test_identity_check_catches_noise_reused_across_depths():
    """A loop sampling every tree node at position ``len(output)`` (depth forgotten) reuses
    the root's noise for deeper nodes: the outputs then differ from plain sampling."""
    seeds = SEEDS[:4000]
    params = CASES["t1.0"]
    bad, _ = speculative_outputs(params, seeds, "tree", depth_in_position=False)
    plain = plain_outputs(params, seeds)
    n_diff = sum(a != b for a, b in zip(bad, plain))
    assert n_diff > len(seeds) // 20, n_diff
