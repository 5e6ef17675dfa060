"""`fused_experts_native` against a float64 reference, and `FusedMoE`: per-expert loading,
tensor parallelism simulated in one process, dummy weights, missing experts, bad input and
backend dispatch."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.model_loader.dummy import init_dummy_weights
from attnserve.models.layers.moe.layer import FusedMoE
from attnserve.models.layers.moe.native import fused_experts_native
from attnserve.models.layers.parallel import load_param

E, H, I, K, T = 6, 16, 12, 2, 9


def _reference(x, w1, w3, w2, weights, ids):
    """float64 per token, per slot: sum_j w_j * down(silu(gate x) * (up x))."""
    x, w1, w3, w2 = (t.double() for t in (x, w1, w3, w2))
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g = w1[e] @ x[t]
            u = w3[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (g * torch.sigmoid(g) * u))
    return out


def _experts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, I, H, generator=gen) * 0.3
    w3 = torch.randn(E, I, H, generator=gen) * 0.3
    w2 = torch.randn(E, H, I, generator=gen) * 0.3
    return w1, w3, w2


def _routing(seed=1, t=T):
    """Random top-K of the first E-1 experts (expert E-1 receives no token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:K] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, K, generator=gen)
    return weights, ids


def _load(moe: FusedMoE, w1, w3, w2, skip=None):
    for e in range(E):
        for shard, full in (("w1", w1[e]), ("w3", w3[e]), ("w2", w2[e])):
            if (e, shard) != skip:
                moe.load_expert_weight(shard, e, full, f"experts.{e}.{shard}.weight")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_matches_float64(dtype, tol):
    w1, w3, w2 = _experts()
    weights, ids = _routing()
    x = torch.randn(T, H)
    w13 = torch.cat([w1, w3], dim=1).to(dtype)
    out = fused_experts_native(x.to(dtype), w13, w2.to(dtype), weights, ids)
    assert out.dtype == dtype and out.shape == (T, H)
    ref = _reference(x.to(dtype), w13[:, :I], w13[:, I:], w2.to(dtype), weights, ids)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_native_empty_and_bad_ids():
    w1, w3, w2 = _experts()
    w13 = torch.cat([w1, w3], dim=1)
    out = fused_experts_native(torch.zeros(0, H), w13, w2, torch.zeros(0, K), torch.zeros(0, K, dtype=torch.int32))
    assert out.shape == (0, H)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 6\)"):
        fused_experts_native(torch.zeros(1, H), w13, w2, torch.ones(1, K), torch.tensor([[0, E]], dtype=torch.int32))
    with pytest.raises(ValueError, match="w13"):
        fused_experts_native(torch.zeros(1, H + 1), w13, w2, torch.ones(1, K), torch.zeros(1, K, dtype=torch.int32))


def test_layer_loads_hf_experts():
    w1, w3, w2 = _experts()
    weights, ids = _routing()
    x = torch.randn(T, H)
    moe = FusedMoE(E, H, I, torch.float32)
    _load(moe, w1, w3, w2)
    assert moe.missing_expert_weights() == []
    torch.testing.assert_close(moe(x, weights, ids).double(), _reference(x, w1, w3, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)
    # the fused 3-D tensors through load_param (its tp_shard spec) give the same parameters
    other = FusedMoE(E, H, I, torch.float32)
    load_param(other.w13_weight, torch.cat([w1, w3], dim=1), "w13")
    load_param(other.w2_weight, w2, "w2")
    assert torch.equal(other.w13_weight, moe.w13_weight) and torch.equal(other.w2_weight, moe.w2_weight)


def test_tp2_partial_sums_equal_tp1():
    w1, w3, w2 = _experts(seed=5)
    weights, ids = _routing(seed=6)
    x = torch.randn(T, H)
    full = FusedMoE(E, H, I, torch.float32)
    _load(full, w1, w3, w2)
    ranks = [FusedMoE(E, H, I, torch.float32, tp=TPGroup(rank=r, size=2), reduce_results=False) for r in range(2)]
    for moe in ranks:
        assert moe.w13_weight.shape == (E, I, H) and moe.w2_weight.shape == (E, H, I // 2)
        _load(moe, w1, w3, w2)
        assert moe.missing_expert_weights() == []
    # rank 1 holds gate rows I/2..I and up rows I/2..I of every expert
    torch.testing.assert_close(ranks[1].w13_weight[:, I // 2:], w3[:, I // 2:])
    summed = ranks[0](x, weights, ids) + ranks[1](x, weights, ids)
    torch.testing.assert_close(summed, full(x, weights, ids), rtol=1e-5, atol=1e-5)


class _Holder(nn.Module):
    def __init__(self, moe: FusedMoE):
        super().__init__()
        self.experts = moe


def test_dummy_weights_same_model_every_tp_size():
    weights, ids = _routing(seed=7)
    x = torch.randn(T, H)
    full = _Holder(FusedMoE(E, H, I, torch.float32))
    init_dummy_weights(full, seed=3, std=0.5)
    outs = []
    for r in range(2):
        part = _Holder(FusedMoE(E, H, I, torch.float32, tp=TPGroup(rank=r, size=2), reduce_results=False))
        init_dummy_weights(part, seed=3, std=0.5)
        outs.append(part.experts(x, weights, ids))
    ref = full.experts(x, weights, ids)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(outs[0] + outs[1], ref, rtol=1e-5, atol=1e-5)


def test_missing_expert_and_bad_tensors():
    w1, w3, w2 = _experts()
    moe = FusedMoE(E, H, I, torch.float32)
    _load(moe, w1, w3, w2, skip=(3, "w3"))
    assert moe.missing_expert_weights() == [(3, "w3")]
    with pytest.raises(ValueError, match=r"'experts\.2\.w2\.weight' has shape \(12, 16\), expected \(16, 12\)"):
        moe.load_expert_weight("w2", 2, w1[2], "experts.2.w2.weight")
    with pytest.raises(ValueError, match=r"expert id 6 is outside \[0, 6\)"):
        moe.load_expert_weight("w1", E, w1[0], "experts.6.w1.weight")
    with pytest.raises(ValueError, match="unknown expert shard 'w4'"):
        moe.load_expert_weight("w4", 0, w1[0], "experts.0.w4.weight")


def test_bad_tp_size():
    with pytest.raises(ValueError, match="--tp-size 5 does not divide the experts' intermediate size 12"):
        FusedMoE(E, H, I, torch.float32, tp=TPGroup(rank=0, size=5))


class _DoublingTP(TPGroup):
    """A stand-in group whose "all-reduce" doubles, to see that the layer calls it."""

    def all_reduce(self, x):
        return x.mul_(2)


def test_reduce_results_all_reduces():
    weights, ids = _routing()
    x = torch.randn(T, H)
    moes = [FusedMoE(E, H, I, torch.float32, tp=_DoublingTP(rank=0, size=2), reduce_results=flag)
            for flag in (False, True)]
    for moe in moes:
        _load(moe, *_experts())
    torch.testing.assert_close(moes[1](x, weights, ids), 2 * moes[0](x, weights, ids))


def test_backend_from_env(monkeypatch):
    calls = []
    fake = types.ModuleType("attnserve.models.layers.moe.fused_moe_triton")
    fake.fused_experts_triton = lambda *args: calls.append(args) or fused_experts_native(*args)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    weights, ids = _routing()
    x = torch.randn(T, H)
    monkeypatch.setenv("ATTNSERVE_MOE_BACKEND", "triton")
    moe = FusedMoE(E, H, I, torch.float32)
    _load(moe, *_experts())
    moe(x, weights, ids)
    assert len(calls) == 1 and calls[0][1] is moe.w13_weight
    monkeypatch.setenv("ATTNSERVE_MOE_BACKEND", "native")
    native = FusedMoE(E, H, I, torch.float32)
    _load(native, *_experts())
    native(x, weights, ids)
    monkeypatch.delenv("ATTNSERVE_MOE_BACKEND")
    auto = FusedMoE(E, H, I, torch.float32)  # auto: CPU tensors take the native path
    _load(auto, *_experts())
    auto(x, weights, ids)
    assert len(calls) == 1 and native.backend == "native" and auto.backend == "auto"
    monkeypatch.setenv("ATTNSERVE_MOE_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="ATTNSERVE_MOE_BACKEND='cutlass'"):
        FusedMoE(E, H, I, torch.float32)
