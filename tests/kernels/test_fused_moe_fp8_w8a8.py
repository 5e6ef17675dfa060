"""W8A8 FP8 experts in the fused MoE Triton kernel (issue 37) under the interpreter: e4m3
activations (per token with per-channel weights, per 1 x 128 group with 128 x 128 block
weights) times e4m3 experts, float32 accumulation.

Bound (`fp8_moe_checks.fp8_w8a8_moe_reference`): against the float64 product of the
dequantised experts and the quantised-then-dequantised input, the kernel's error is
`moe_checks.moe_reference`'s rounding bound (float32 accumulation, the storage roundings)
plus the intermediate's own e4m3 quantisation, ``2**-4 |a| + 2**-10 s`` an element (half an
ulp of a 3-bit mantissa, or half the subnormal step), carried through ``|W_2|``: the kernel
quantises its own float32-accurate intermediate, which may round to the other neighbour of
the reference's, so that quantisation cannot be in the reference exactly. The result is
also held to 5 % (Frobenius) of a float64 simulation of every quantisation step, which a
wrong scale, row or group would miss by far (measured 1.5 - 2 %: the interpreter rounds
float32 -> bfloat16 toward zero, so its intermediate sits an ulp off and some e4m3
roundings flip). Cases: K not a multiple of 128 or of the tile
(H 200, I 72 / 136), ragged top-2 routing with an expert that gets no token.

The layer test: a `FusedMoE` quantised at load, Triton (W8A8 by the rule, the threshold
set to 0) against its native path (W8A16: bf16 activations), element-wise within the bound
above widened by the input's quantisation error carried through ``|W_13|`` (`x_err`) plus
the native path's own rounding bound.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnserve.models.layers.moe.fp8_w8a8 import W8A8_MIN_SLOTS_ENV, fp8_w8a8_min_slots, use_fp8_w8a8
from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton
from fp8_moe_checks import (
    activation_quant_error,
    fp8_w8a8_moe_reference,
    fp8_w8a8_moe_simulated,
    quantize_experts,
)
from moe_checks import moe_reference

#: BLOCK_SIZE_K 32: four K steps share one activation / weight scale group
_SMALL_TILES = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1, "num_warps": 4,
                "num_stages": 1}
CASES = [  # (T, E, top_k, H, I, block, config)
    (9, 4, 2, 200, 72, None, None),
    (9, 4, 2, 200, 136, (128, 128), _SMALL_TILES),  # gate / up halves each two row blocks
]


def _inputs(t, e, k, h, inter, gen):
    x = (torch.randn(t, h, generator=gen) * torch.rand(t, 1, generator=gen) * 3).bfloat16()  # per-token ranges
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * 0.1
    w2 = torch.randn(e, h, inter, generator=gen) * 0.1
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)]).to(torch.int32)  # expert e-1: none
    return x, w13, w2, torch.rand(t, k, generator=gen), ids


@pytest.mark.parametrize("t, e, k, h, inter, block, config", CASES,
                         ids=[f"H{c[3]}-I{c[4]}-{'block' if c[5] else 'channel'}" for c in CASES])
def test_w8a8_matches_quantised_float64(t, e, k, h, inter, block, config, gen, device):
    x, w13, w2, tw, ids = _inputs(t, e, k, h, inter, gen)
    q13, s13, q2, s2 = quantize_experts(w13, w2, block)
    out = fused_experts_triton(x.to(device), q13.to(device), q2.to(device), tw.to(device), ids.to(device),
                               w13_scale=s13.to(device), w2_scale=s2.to(device), block_shape=block, config=config,
                               fp8_w8a8=True).cpu()
    assert out.dtype == torch.bfloat16 and out.shape == (t, h) and torch.isfinite(out).all()
    ref, bound = fp8_w8a8_moe_reference(x, q13, s13, q2, s2, block, tw, ids)
    diff = (out.double() - ref).abs()
    assert (diff <= bound).all(), f"worst ratio {(diff / bound).max():.3f}"
    sim = fp8_w8a8_moe_simulated(x, q13, s13, q2, s2, block, tw, ids)
    rel = ((out.double() - sim).norm() / sim.norm()).item()
    assert rel <= 0.05, f"relative error {rel:.3e} against the simulated W8A8 steps"


def test_w8a8_rule_and_threshold(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(W8A8_MIN_SLOTS_ENV, raising=False)
    assert fp8_w8a8_min_slots() == 16
    # Mixtral (E 8, top 2): 64 tokens = 16 slots an expert -> W8A8; 32 tokens -> W8A16
    assert use_fp8_w8a8(64, 2, 8, cpu) and not use_fp8_w8a8(32, 2, 8, cpu)
    assert use_fp8_w8a8(256, 8, 128, cpu) and not use_fp8_w8a8(255, 8, 128, cpu)  # Qwen3-30B-A3B
    assert not use_fp8_w8a8(1, 8, 1, cpu)  # one token never (slot blocks)
    assert use_fp8_w8a8(1, 2, 8, cpu, force=True) and not use_fp8_w8a8(8192, 2, 8, cpu, force=False)
    monkeypatch.setenv(W8A8_MIN_SLOTS_ENV, "0")
    assert use_fp8_w8a8(2, 1, 64, cpu)
    monkeypatch.setenv(W8A8_MIN_SLOTS_ENV, "sixteen")
    with pytest.raises(ValueError, match=W8A8_MIN_SLOTS_ENV):
        use_fp8_w8a8(64, 2, 8, cpu)


def test_w8a8_needs_fp8_experts(device):
    x = torch.randn(2, 32).bfloat16().to(device)
    w13, w2 = torch.zeros(2, 16, 32).bfloat16().to(device), torch.zeros(2, 32, 8).bfloat16().to(device)
    ids, tw = torch.zeros(2, 1, dtype=torch.int32, device=device), torch.ones(2, 1, device=device)
    with pytest.raises(ValueError, match="fp8_w8a8=True needs FP8 experts"):
        fused_experts_triton(x, w13, w2, tw, ids, fp8_w8a8=True)


def test_layer_w8a8_against_native(monkeypatch, gen, device):
    """`FusedMoE` quantised at load (per channel): the Triton path runs W8A8 by the rule
    (threshold 0) and stays within the activation-quantisation bound of the native path."""
    from attnserve.models.layers.moe.layer import FusedMoE
    from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
    from attnserve.models.layers.quantization.apply import quantize_model_linears
    from attnserve.models.layers.quantization.fp8_moe import dequantize_expert

    e, h, inter, k, t = 4, 96, 40, 2, 6
    monkeypatch.setenv("ATTNSERVE_MOE_BACKEND", "triton")
    monkeypatch.setenv(W8A8_MIN_SLOTS_ENV, "0")
    cfg = QuantizationConfig("channel")
    holder = nn.Module()
    with torch.device(device), quantized_construction(cfg):
        holder.experts = FusedMoE(e, h, inter, torch.bfloat16, reduce_results=False)
    quantize_model_linears(holder, cfg, device, torch.bfloat16)
    moe = holder.experts
    x, w13, w2, tw, ids = _inputs(t, e, k, h, inter, gen)
    for i in range(e):
        moe.load_expert_weight("w1", i, w13[i, :inter].bfloat16(), f"experts.{i}.gate_proj.weight")
        moe.load_expert_weight("w3", i, w13[i, inter:].bfloat16(), f"experts.{i}.up_proj.weight")
        moe.load_expert_weight("w2", i, w2[i].bfloat16(), f"experts.{i}.down_proj.weight")
    assert moe.w13_weight.dtype == torch.float8_e4m3fn and moe.backend == "triton"
    import attnserve.models.layers.moe.fused_moe_triton as fmt

    calls = []
    real = fmt.quantize_moe_activation
    monkeypatch.setattr(fmt, "quantize_moe_activation", lambda a, b: calls.append(tuple(a.shape)) or real(a, b))
    out = moe(x.to(device), tw.to(device), ids.to(device)).cpu()
    assert calls == [(t, h), (t * k, inter)]  # W8A8: both GEMM inputs quantised
    monkeypatch.setenv("ATTNSERVE_MOE_BACKEND", "native")
    moe.backend = "native"
    native = moe(x.to(device), tw.to(device), ids.to(device)).cpu()
    s13, s2 = (s.cpu() for s in moe.quant_method.scales(moe))
    q13, q2 = moe.w13_weight.cpu(), moe.w2_weight.cpu()
    d13 = torch.stack([dequantize_expert(q13, s13, i, gated=True).double() for i in range(e)])
    d2 = torch.stack([dequantize_expert(q2, s2, i).double() for i in range(e)])
    # |triton - native| <= |triton - exact| + |exact - native|, exact = float64 W8A16 product
    _, w8a8_bound = moe_reference(x, d13, d2, tw, ids, act_fp8="token", x_err=activation_quant_error(x, None))
    exact, native_bound = moe_reference(x, d13, d2, tw, ids)
    diff = (out.double() - native.double()).abs()
    assert (diff <= w8a8_bound + native_bound).all(), f"worst ratio {(diff / (w8a8_bound + native_bound)).max():.3f}"
    assert ((native.double() - exact).abs() <= native_bound).all()
