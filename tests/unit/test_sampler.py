"""Batched sampling: matches per-row references, is batch independent, never NaN."""

import math

import pytest
import torch

from attnserve.engine.sampler import SamplingBatchInfo, counter_uniform, sample, unit_interval
from attnserve.engine.sampling_params import SamplingParams


def _info(params, seeds=None, positions=None):
    n = len(params)
    return SamplingBatchInfo.from_params(params, seeds or list(range(n)), positions or [0] * n, "cpu")


def _reference_support(logits, p: SamplingParams):
    """Set of token ids the filters keep for one row (float64 reference)."""
    x = logits.double() / p.temperature
    probs = torch.softmax(x, -1)
    keep = torch.ones_like(x, dtype=torch.bool)
    order = torch.argsort(x, descending=True)
    if p.top_k > 0:
        keep[order[p.top_k:]] = False
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    if p.top_p < 1:
        masked = torch.where(keep, x, torch.tensor(-math.inf, dtype=x.dtype))
        q = torch.softmax(masked, -1)[order]
        before = torch.cumsum(q, 0) - q
        drop = order[before >= p.top_p]
        keep[drop] = False
    return set(torch.nonzero(keep).flatten().tolist())


def test_greedy_and_tiny_temperatures_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 30
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-300, 1e-38, 1e-6, 0.0)]
    out = sample(logits, _info(params))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_sampled_rows_stay_in_the_filtered_support():
    torch.manual_seed(1)
    logits = torch.randn(4, 64) * 3
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.5),
              SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.9, top_k=20, top_p=0.8)]
    supports = [_reference_support(logits[i], p) for i, p in enumerate(params)]
    seen = [set() for _ in params]
    for pos in range(200):
        out = sample(logits, _info(params, seeds=[7, 8, 9, 10], positions=[pos] * 4))
        for i, t in enumerate(out.tolist()):
            assert t in supports[i], (i, t)
            seen[i].add(t)
    assert all(len(s) > 1 for s in seen)  # really sampling, not argmax


def test_distribution_matches_softmax():
    """Frequencies over 4000 positions match softmax(logits / T) (chi-square, 7 dof)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5]])
    t = 0.8
    n = 4000
    counts = torch.zeros(8)
    p = SamplingParams(temperature=t)
    for pos in range(n):
        counts[sample(logits, _info([p], seeds=[42], positions=[pos]))[0]] += 1
    expect = torch.softmax(logits[0] / t, -1) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 24.3, (chi2, counts.tolist(), expect.tolist())  # p = 0.001 for 7 dof


def test_rows_are_batch_independent():
    """A row's token depends on its own (seed, position, logits) only."""
    torch.manual_seed(2)
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_k=10), SamplingParams(temperature=0.5, min_p=0.1),
              SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, top_k=3)]
    seeds, positions = [11, 12, 13, 14, 15, 16], [3, 1, 4, 1, 5, 9]
    batch = sample(logits, _info(params, seeds, positions)).tolist()
    for i in range(6):
        alone = sample(logits[i:i + 1], _info([params[i]], [seeds[i]], [positions[i]])).tolist()
        assert alone == [batch[i]], i


def test_counter_uniform_range_and_independence():
    u = counter_uniform(torch.tensor([0, 1, 2**40]), torch.tensor([0, 0, 5]), 10000)
    assert u.shape == (3, 10000) and float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])
    again = counter_uniform(torch.tensor([1]), torch.tensor([0]), 10000)
    assert torch.equal(again[0], u[1])


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0])
def test_invalid_temperatures_are_refused(bad):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=bad)


def test_argmax_last_matches_torch_argmax_including_ties():
    from attnserve.engine.sampler import argmax_last

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1000, generator=g)
    x[2, 10] = x[2, 500] = x[2].max() + 1  # tie: the first index wins, as torch.argmax
    x[5, :] = 0.0  # all equal
    assert torch.equal(argmax_last(x), torch.argmax(x, dim=-1))
    assert argmax_last(x)[2] == 10 and argmax_last(x)[5] == 0


def test_uniforms_never_reach_one_so_masked_tokens_stay_masked():
    h = torch.tensor([0, 1, 2**31 - 129, 2**31 - 128, 2**31 - 1])
    u = unit_interval(h)
    assert bool((u > 0).all()) and bool((u < 1).all()), u
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())
    # a grammar-style mask: only 3 of 49,152 tokens allowed, 256 seeds, temperature 1
    n, vocab = 256, 49152
    logits = torch.full((n, vocab), float("-inf"))
    allowed = torch.tensor([5, 700, 40000])
    logits[:, allowed] = torch.randn(n, 3)
    info = SamplingBatchInfo.from_params([SamplingParams(temperature=1.0)] * n, list(range(n)), [0] * n, "cpu")
    ids = sample(logits, info)
    assert bool(torch.isin(ids, allowed).all())
