"""gpt-oss experts (per-expert biases, ``swigluoai``) through the fused Triton MoE path on a GPU
at gpt-oss-20b's shapes, against the float64 reference and element-wise bound of
tests/moe_bias_checks.py and against the native path.

gpt-oss-20b (HF ``openai/gpt-oss-20b`` config; arXiv:2508.10925): 32 experts, top 4, hidden
2880, expert intermediate 2880 (1440 a rank at tp 2), bf16 activations. Neither 2880 nor 1440
is a multiple of 128 (2880 = 22.5 x 128), so K steps of 128 leave a tail of 64 (masked loads)
and column bands of 128 / 64 outputs wrap past N (wrapped weight and bias rows are read but
never stored); both the default rule (no tuned table exists for E=32, N=2880, K=2880) and
forced 128-wide tiles are run. Token counts 1 (slot blocks), 7, 64, 300 (several M tiles).
Weights are scaled so that both clamps of ``swigluoai`` bite (asserted). Also: the layer
(`FusedMoE` with ``has_bias``), CUDA graph capture and replay, and FP8 experts with biases.

Every output must lie within both bounds of moe_bias_checks: the rigorous worst-case one,
which at K = 2880 is as large as the outputs (it adds all 2880 errors of a row with one
sign), and the probabilistic one (Higham and Mary 2019, ``lambda = 8``: failure odds under
1e-7 for the whole test), which is ~10x tighter. On an H200 (2026-11-28) the Triton path
used 0.06 - 0.10 of the probabilistic bound and the native path 0.04 - 0.07, while a
missing clamp, missing biases, or a down bias not weighted by the routing weight lie 4 - 16
times outside it (asserted > 2 at T = 1 and 64).
"""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton
from attnserve.models.layers.moe.layer import FusedMoE
from attnserve.models.layers.moe.native import fused_experts_native
from attnserve.models.layers.moe.routing import RoutingConfig, select_experts
from attnserve.models.layers.moe.tuned_configs import get_fused_moe_config
from moe_bias_checks import ALPHA, LIMIT, hf_formula_reference, oai_moe_reference, worst_ratio

pytestmark = pytest.mark.cuda
DEV = "cuda"
E, TOP_K, H, I = 32, 4, 2880, 2880
OAI = dict(activation="swigluoai", swiglu_alpha=ALPHA, swiglu_limit=LIMIT)


def _case(t, inter=I, dtype=torch.bfloat16, seed=0):
    """x ~ N(0, 1); W13 entries of std 5 / sqrt(H), so gate / up ~ N(0, 25) + a N(0, 1) bias
    (well past +-7 on many slots); W2 of std 1 / sqrt(I); routing: softmax over the top 4 of
    random logits (gpt-oss's router)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, H, device=DEV, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, device=DEV, generator=g) * (5.0 / H**0.5)).to(dtype)
    w2 = (torch.randn(E, H, inter, device=DEV, generator=g) / inter**0.5).to(dtype)
    b13 = torch.randn(E, 2 * inter, device=DEV, generator=g).to(dtype)
    b2 = torch.randn(E, H, device=DEV, generator=g).to(dtype)
    logits = torch.randn(t, E, device=DEV, generator=g)
    w, ids = select_experts(logits, RoutingConfig(top_k=TOP_K, renormalize=True))
    return x, w13, w2, b13, b2, w, ids


#: Higham-Mary's lambda of the probabilistic bound (moe_bias_checks)
LAMBDA = 8.0


def _check(out, x, w13, w2, b13, b2, w, ids, clamps=True, storage_dtype=None):
    """``out`` within the worst-case and the probabilistic bound; returns the reference and
    the probabilistic bound."""
    assert out.dtype == x.dtype and out.shape == x.shape and torch.isfinite(out).all()
    for lam in (None, LAMBDA):
        ref, bound, stats = oai_moe_reference(x, w13, w2, b13, b2, w, ids, storage_dtype, prob_lambda=lam)
        if clamps:
            assert stats["gate_hi"] > 0.05 and stats["up_out"] > 0.1 and stats["free"] > 0.3, stats
        ratio = worst_ratio(out, ref, bound)
        assert ratio <= 1.0, f"max |delta| {(out.double() - ref).abs().max().item():.3e}, {ratio:.3f} of the " \
                             f"{'probabilistic' if lam else 'worst-case'} bound"
    return ref, bound


@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_gpt_oss_20b_bf16(t, no_tf32):
    x, w13, w2, b13, b2, w, ids = _case(t, seed=t)
    out = fused_experts_triton(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, **OAI)
    ref, bound = _check(out, x, w13, w2, b13, b2, w, ids)
    native = fused_experts_native(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, **OAI)
    _check(native, x, w13, w2, b13, b2, w, ids, clamps=False)
    if t == 7:  # the expert-by-expert reference is the token-by-token HF formula
        torch.testing.assert_close(hf_formula_reference(x, w13, w2, b13, b2, w, ids), ref, rtol=1e-9, atol=1e-9)
    if t in (1, 64):  # a missing clamp or bias, or an unweighted down bias, would be outside the bound
        no_clamp = oai_moe_reference(x, w13, w2, b13, b2, w, ids, limit=float("inf"))[0]
        no_bias = oai_moe_reference(x, w13, w2, None, None, w, ids)[0]
        slots = torch.arange(t, device=DEV).repeat_interleave(TOP_K)
        unweighted = ref.index_add(0, slots, (1 - w.reshape(-1, 1).double()) * b2[ids.reshape(-1).long()].double())
        for what, wrong in (("no clamp", no_clamp), ("no bias", no_bias), ("unweighted b_d", unweighted)):
            assert worst_ratio(wrong, ref, bound) > 2, what


@pytest.mark.parametrize("t", [1, 64, 300])
def test_tp2_rank_shape(t):
    """One rank's shard at tp 2 (I 1440: 1440 = 11.25 x 128, gate-up column bands wrap too)."""
    x, w13, w2, b13, b2, w, ids = _case(t, inter=I // 2, seed=100 + t)
    out = fused_experts_triton(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, **OAI)
    _check(out, x, w13, w2, b13, b2, w, ids)


@pytest.mark.parametrize("inter", [I, I // 2])
@pytest.mark.parametrize("t", [7, 300])
def test_forced_128_tiles_leave_tails(inter, t):
    """BLOCK_SIZE_N / BLOCK_SIZE_K 128 for both GEMMs: K = 2880 or 1440 leaves a masked tail,
    N = 2880 (down) and 1440 / 2880 gate-up columns (64 a band) wrap."""
    x, w13, w2, b13, b2, w, ids = _case(t, inter=inter, seed=200 + t)
    for bm in (16, 64):
        cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 4, "num_warps": 4,
               "num_stages": 3}
        out = fused_experts_triton(x, w13, w2, w, ids, config=cfg, w13_bias=b13, w2_bias=b2, **OAI)
        _check(out, x, w13, w2, b13, b2, w, ids)


@pytest.mark.parametrize("inter", [I, I // 2, I // 4])
def test_config_lookup_for_gpt_oss_shapes(inter):
    """No tuned table for these shapes: the default rule gives a valid config for every T."""
    for t in (1, 7, 64, 300, 4096):
        cfg = get_fused_moe_config(t, E, inter, H, TOP_K, torch.bfloat16, torch.device(DEV))
        cfg.validate()


def test_silu_without_bias_unchanged():
    """The new arguments left at their defaults launch the plain SiLU kernel: bit for bit the
    call without them."""
    x, w13, w2, _, _, w, ids = _case(64, seed=5)
    a = fused_experts_triton(x, w13, w2, w, ids)
    b = fused_experts_triton(x, w13, w2, w, ids, w13_bias=None, w2_bias=None, activation="silu")
    assert torch.equal(a, b)


def test_layer_with_biases(no_tf32):
    """`FusedMoE(has_bias=True, activation="swigluoai")` on CUDA (auto backend: Triton),
    loaded expert by expert."""
    x, w13, w2, b13, b2, w, ids = _case(64, seed=9)
    moe = FusedMoE(E, H, I, torch.bfloat16, has_bias=True, **OAI).to(DEV)
    for e in range(E):
        moe.load_expert_weight("w1", e, w13[e, :I], f"experts.{e}.gate_proj.weight")
        moe.load_expert_weight("w3", e, w13[e, I:], f"experts.{e}.up_proj.weight")
        moe.load_expert_weight("w2", e, w2[e], f"experts.{e}.down_proj.weight")
        moe.load_expert_bias("w1", e, b13[e, :I], f"experts.{e}.gate_proj.bias")
        moe.load_expert_bias("w3", e, b13[e, I:], f"experts.{e}.up_proj.bias")
        moe.load_expert_bias("w2", e, b2[e], f"experts.{e}.down_proj.bias")
    out = moe(x, w, ids)
    _check(out, x, w13, w2, b13, b2, w, ids)
    assert torch.equal(out, fused_experts_triton(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, **OAI))


@pytest.mark.parametrize("t", [1, 64])
def test_cuda_graph_replay(t):
    x, w13, w2, b13, b2, w, ids = _case(t, seed=11)
    sx, sw, sids = x.clone(), w.clone(), ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_experts_triton(sx, w13, w2, sw, sids, w13_bias=b13, w2_bias=b2, **OAI)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout = fused_experts_triton(sx, w13, w2, sw, sids, w13_bias=b13, w2_bias=b2, **OAI)
    for seed in (12, 13):
        x2, _, _, _, _, w_new, ids2 = _case(t, seed=seed)
        sx.copy_(x2)
        sw.copy_(w_new)
        sids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_experts_triton(x2, w13, w2, w_new, ids2, w13_bias=b13, w2_bias=b2, **OAI)
        assert torch.equal(sout, eager)


@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("t", [7, 300])
def test_fp8_experts_with_biases(scales, t):
    """e4m3 experts with bf16 biases: W8A16 within the bound of the float64 product of the
    dequantised experts; W8A8 (activations quantised to e4m3 too) within FP8's error of it."""
    from attnserve.models.layers.quantization.fp8_moe import dequantize_expert
    from attnserve.models.layers.quantization.fp8_utils import quantize_per_block, quantize_per_row

    x, w13, w2, b13, b2, w, ids = _case(t, seed=300 + t)
    block = (128, 128) if scales == "block" else None
    q13, s13, q2, s2 = [], [], [], []
    for e in range(E):
        for qs, ss, wt in ((q13, s13, None), (q2, s2, w2[e])):
            if wt is None:  # gate and up halves quantised separately (their own row blocks)
                parts = [quantize_per_block(h, block) if block else quantize_per_row(h)
                         for h in (w13[e, :I], w13[e, I:])]
                qs.append(torch.cat([p[0] for p in parts]))
                ss.append(torch.cat([p[1] for p in parts]))
            else:
                q, s = quantize_per_block(wt, block) if block else quantize_per_row(wt)
                qs.append(q)
                ss.append(s)
    q13, s13, q2, s2 = (torch.stack(v).contiguous() for v in (q13, s13, q2, s2))
    s13, s2 = s13.float(), s2.float()
    dq13 = torch.stack([dequantize_expert(q13, s13, e, block, gated=True) for e in range(E)])
    dq2 = torch.stack([dequantize_expert(q2, s2, e, block) for e in range(E)])
    common = dict(w13_scale=s13, w2_scale=s2, block_shape=block, w13_bias=b13, w2_bias=b2, **OAI)
    w8a16 = fused_experts_triton(x, q13, q2, w, ids, fp8_w8a8=False, **common)
    ref, _ = _check(w8a16, x, dq13, dq2, b13, b2, w, ids, storage_dtype=torch.bfloat16)
    w8a8 = fused_experts_triton(x, q13, q2, w, ids, fp8_w8a8=True, **common)
    rel = ((w8a8.double() - ref).norm() / ref.norm()).item()
    assert rel <= 0.06, rel  # e4m3 inputs of both GEMMs: ~2**-5 RMS relative rounding each
