"""gpt-oss's routed experts on the CPU: per-expert biases and the ``swigluoai`` activation in
`FusedMoE` (native path, and the Triton kernels under the interpreter), the router bias of
`MoEGate`, tensor parallelism, dummy weights, FP8 experts with biases, loading and errors.

References: HF transformers' ``GptOssExperts`` / ``GptOssTopKRouter`` / ``GptOssMLP``
(``models/gpt_oss/modeling_gpt_oss.py``; run here in float64 / float32) and the float64
formula of tests/moe_bias_checks.py, with its element-wise bound: float32 GEMM error
relative to the magnitudes of the terms (``gamma_n sum |x_i w_i|``) plus one rounding to the
storage dtype per stored intermediate (bf16: ``2**-8`` relative), doubled. The inputs are
scaled so that both clamps bite on a large share of the routed slots (asserted), and the
reference without clamps, without biases or with an unweighted down bias is asserted to lie
far outside the bound, so none of those can pass unnoticed.

Tiny shapes (E 4 / 8, H 64, I 32, T 1 - 40; one ragged H 48 / I 24 that leaves K tails and
wrapped columns in both GEMMs) keep the interpreter to about a second a case. On a machine
with a GPU the Triton cases run there instead (`_triton`: the interpreter is chosen when
Triton is imported, so CPU tensors cannot take the kernels once CUDA is present).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnserve.distributed.group import TPGroup
from attnserve.model_loader.dummy import init_dummy_weights
from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton as _fused_experts_triton
from attnserve.models.layers.moe.layer import FusedMoE
from attnserve.models.layers.moe.native import fused_experts_native
from attnserve.models.layers.moe.routing import RoutingConfig, select_experts
from attnserve.models.layers.moe.sparse_block import (
    MoEGate,
    SparseMoeBlock,
    check_experts_complete,
    route_expert_tensors,
)
from attnserve.models.layers.parallel import load_param
from moe_bias_checks import ALPHA, LIMIT, hf_formula_reference, oai_moe_reference, worst_ratio

H, I = 64, 32
OAI = dict(activation="swigluoai", swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
#: where the Triton path runs: the interpreter on the CPU, or the GPU when there is one
KDEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _to(v, dev):
    return v.to(dev) if isinstance(v, torch.Tensor) else v


def fused_experts_triton(*args, **kwargs):
    """`fused_experts_triton` on `KDEV` (inputs moved there), output back on the CPU."""
    out = _fused_experts_triton(*(_to(a, KDEV) for a in args), **{k: _to(v, KDEV) for k, v in kwargs.items()})
    return out.cpu()


def _layer_call(moe, backend, x, w, ids):
    """``moe(x, w, ids)`` on the CPU, or on `KDEV` for the Triton backend (output on the CPU)."""
    if backend != "triton":
        return moe(x, w, ids)
    return moe.to(KDEV)(x.to(KDEV), w.to(KDEV), ids.to(KDEV)).cpu()


def _experts(e, h=H, inter=I, seed=0, dtype=torch.float32):
    """Weights and biases whose gate / up values reach well past +-LIMIT: entries of W13 with
    std 5 / sqrt(H) and unit-normal x give g, u ~ N(0, 25) plus a N(0, 1) bias."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * (5.0 / h**0.5)
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    b13 = torch.randn(e, 2 * inter, generator=g)
    b2 = torch.randn(e, h, generator=g)
    return tuple(t.to(dtype) for t in (w13, w2, b13, b2))


def _routing(t, e, k, seed=1, h=H, dtype=torch.float32):
    """Inputs and gpt-oss routing (softmax over the top-k of random logits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g)
    w, ids = select_experts(logits, RoutingConfig(top_k=k, renormalize=True))
    return x, w, ids


def _run(path, x, w13, w2, b13, b2, w, ids):
    fn = fused_experts_native if path == "native" else fused_experts_triton
    return fn(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, **OAI)


CASES = [  # (T, E, top_k, dtype, H, I)
    (40, 4, 2, torch.float32, H, I),
    (40, 4, 2, torch.bfloat16, H, I),
    (33, 8, 4, torch.float32, H, I),
    (33, 8, 4, torch.bfloat16, H, I),
]


@pytest.mark.parametrize("path", ["native", "triton"])
@pytest.mark.parametrize("t, e, k, dtype, h, inter", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_swigluoai_bias_matches_float64(path, t, e, k, dtype, h, inter):
    w13, w2, b13, b2 = _experts(e, h, inter, seed=t + e, dtype=dtype)
    x, w, ids = _routing(t, e, k, seed=t * e, h=h, dtype=dtype)
    out = _run(path, x, w13, w2, b13, b2, w, ids)
    assert out.dtype == dtype and out.shape == (t, h)
    ref, bound, stats = oai_moe_reference(x, w13, w2, b13, b2, w, ids)
    # the clamps bite (gate from above, up both ways) and leave many values alone
    assert stats["gate_hi"] > 0.05 and stats["up_out"] > 0.1 and stats["free"] > 0.3, stats
    ratio = worst_ratio(out, ref, bound)
    print(f"{path} {dtype}: {ratio:.3f} of the bound")
    assert ratio <= 1.0, f"{ratio:.3f} of the bound"
    # the bound cannot be met without the clamps, the biases or the weighting of b_d
    no_clamp, _, _ = oai_moe_reference(x, w13, w2, b13, b2, w, ids, limit=float("inf"))
    no_bias, _, _ = oai_moe_reference(x, w13, w2, None, None, w, ids)
    unweighted_part = (1 - w.reshape(-1, 1).double()) * b2[ids.reshape(-1).long()].double()
    b2_unweighted = ref.index_add(0, torch.arange(t).repeat_interleave(k), unweighted_part)
    for what, wrong in (("no clamp", no_clamp), ("no bias", no_bias), ("unweighted b_d", b2_unweighted)):
        print(what, ((wrong - ref).abs() / bound).max().item())
        assert ((wrong - ref).abs() / bound).max() > 5, what


@pytest.mark.parametrize("t, e, k, dtype, h, inter",
                         [(1, 8, 4, torch.bfloat16, H, I), (23, 4, 2, torch.float32, 48, 24)],
                         ids=["one-token-slot-blocks", "ragged-48x24"])
def test_triton_one_token_and_ragged_shapes(t, e, k, dtype, h, inter):
    """T = 1 takes the slot-block launch (no alignment); H 48 / I 24 leave K tails in both
    GEMMs and column bands past N (the wrapped bias rows must not be stored)."""
    w13, w2, b13, b2 = _experts(e, h, inter, seed=7, dtype=dtype)
    x, w, ids = _routing(t, e, k, seed=8, h=h, dtype=dtype)
    out = _run("triton", x, w13, w2, b13, b2, w, ids)
    ref, bound, _ = oai_moe_reference(x, w13, w2, b13, b2, w, ids)
    assert worst_ratio(out, ref, bound) <= 1.0
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4,
           "num_stages": 1}
    out2 = fused_experts_triton(x, w13, w2, w, ids, config=cfg, w13_bias=b13, w2_bias=b2, **OAI)
    assert worst_ratio(out2, ref, bound) <= 1.0


def test_bias_alone_and_silu_unchanged():
    """Biases with SiLU (no clamp) on both paths; and without biases, SiLU is bit for bit the
    call without the new arguments."""
    w13, w2, b13, b2 = _experts(4, seed=3)
    w13, w2 = w13 / 5, w2  # small gate / up values: SiLU
    x, w, ids = _routing(17, 4, 2, seed=4)
    for fn in (fused_experts_native, fused_experts_triton):
        plain = fn(x, w13, w2, w, ids)
        assert torch.equal(plain, fn(x, w13, w2, w, ids, w13_bias=None, w2_bias=None, activation="silu"))
        biased = fn(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2)
        ref = torch.zeros(17, H, dtype=torch.float64)
        for t in range(17):
            for j in range(2):
                e = int(ids[t, j])
                gu = w13[e].double() @ x[t].double() + b13[e].double()
                act = torch.nn.functional.silu(gu[:I]) * gu[I:]
                ref[t] += float(w[t, j]) * (w2[e].double() @ act + b2[e].double())
        torch.testing.assert_close(biased.double(), ref, rtol=1e-5, atol=1e-5)


def _hf_config(e, k):
    from transformers import GptOssConfig

    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=e, num_experts_per_tok=k,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64)
    cfg._experts_implementation = "eager"
    return cfg


def _deinterleave(gate_up_proj, gate_up_bias):
    """HF gpt-oss ``gate_up_proj`` ``[E, H, 2I]`` / ``gate_up_proj_bias`` ``[E, 2I]`` (gate at
    even columns, up at odd) -> our ``w13`` ``[E, 2I, H]`` / ``w13_bias`` ``[E, 2I]`` (gate
    rows, then up rows)."""
    w13 = torch.cat([gate_up_proj[..., ::2], gate_up_proj[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    b13 = torch.cat([gate_up_bias[..., ::2], gate_up_bias[..., 1::2]], dim=-1).contiguous()
    return w13, b13


def test_reference_is_hf_gpt_oss_experts():
    """Our float64 references equal HF's ``GptOssExperts`` run in float64 (interleaved layout)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    e, k, t = 8, 4, 12
    hf = GptOssExperts(_hf_config(e, k)).double()
    w13, w2, b13, b2 = _experts(e, seed=11, dtype=torch.float64)
    inter_gu = torch.stack([w13[:, :I], w13[:, I:]], dim=2).reshape(e, 2 * I, H)  # rows g0, u0, g1, u1, ...
    with torch.no_grad():
        hf.gate_up_proj.copy_(inter_gu.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(torch.stack([b13[:, :I], b13[:, I:]], dim=2).reshape(e, 2 * I))
        hf.down_proj.copy_(w2.transpose(1, 2))
        hf.down_proj_bias.copy_(b2)
    x, w, ids = _routing(t, e, k, seed=12, dtype=torch.float64)
    with torch.no_grad():
        want = hf(x, ids.long(), w.double())
    back13, back_b13 = _deinterleave(hf.gate_up_proj.detach(), hf.gate_up_proj_bias.detach())
    assert torch.equal(back13, w13) and torch.equal(back_b13, b13)
    torch.testing.assert_close(hf_formula_reference(x, w13, w2, b13, b2, w, ids), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(oai_moe_reference(x, w13, w2, b13, b2, w, ids)[0], want, rtol=1e-12, atol=1e-12)


def test_router_bias_and_routing_match_hf():
    """``MoEGate(bias=True)`` + ``RoutingConfig(top_k, renormalize=True)`` is HF's
    ``GptOssTopKRouter``: top-k of the biased logits, softmax over the k (float32 here)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    e, k = 8, 4
    hf = GptOssTopKRouter(_hf_config(e, k))
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(e, H, generator=g) * 0.2)
        hf.bias.copy_(torch.randn(e, generator=g))
    for float32_logits in (False, True):
        gate = MoEGate(e, H, torch.float32, bias=True, float32_logits=float32_logits)
        load_param(gate.weight, hf.weight.detach(), "router.weight")
        load_param(gate.bias, hf.bias.detach(), "router.bias")
        x = torch.randn(29, H, generator=g)
        logits, scores, idx = hf(x)
        ours = gate.forward(x)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, logits.detach(), rtol=1e-6, atol=1e-6)
        w, ids = select_experts(ours, RoutingConfig(top_k=k, renormalize=True))
        order_ours, order_hf = ids.long().sort(dim=1), idx.sort(dim=1)
        assert torch.equal(order_ours.values, order_hf.values)
        torch.testing.assert_close(w.gather(1, order_ours.indices), scores.detach().gather(1, order_hf.indices),
                                   rtol=1e-6, atol=1e-7)
    assert MoEGate(e, H, torch.float32).bias is None  # default unchanged


def test_sparse_block_matches_hf_gpt_oss_mlp():
    """`SparseMoeBlock` with gpt-oss's options, loaded from a float32 HF ``GptOssMLP``, gives
    its output (float32 products on both sides: bound relative to the output's size)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    e, k = 4, 2
    hf = GptOssMLP(_hf_config(e, k))
    w13, w2, b13, b2 = _experts(e, seed=31)
    g = torch.Generator().manual_seed(32)
    with torch.no_grad():
        hf.experts.gate_up_proj.copy_(torch.stack([w13[:, :I], w13[:, I:]], dim=2).reshape(e, 2 * I, H).transpose(1, 2))
        hf.experts.gate_up_proj_bias.copy_(torch.stack([b13[:, :I], b13[:, I:]], dim=2).reshape(e, 2 * I))
        hf.experts.down_proj.copy_(w2.transpose(1, 2))
        hf.experts.down_proj_bias.copy_(b2)
        hf.router.weight.copy_(torch.randn(e, H, generator=g) * 0.3)
        hf.router.bias.copy_(torch.randn(e, generator=g))
    block = SparseMoeBlock(H, e, I, RoutingConfig(top_k=k, renormalize=True), torch.float32, router_bias=True,
                           expert_bias=True, **OAI)
    load_param(block.gate.weight, hf.router.weight.detach(), "router.weight")
    load_param(block.gate.bias, hf.router.bias.detach(), "router.bias")
    mine13, mine_b13 = _deinterleave(hf.experts.gate_up_proj.detach(), hf.experts.gate_up_proj_bias.detach())
    load_param(block.experts.w13_weight, mine13, "experts.gate_up_proj")
    load_param(block.experts.w2_weight, hf.experts.down_proj.detach().transpose(1, 2), "experts.down_proj")
    block.experts.load_expert_biases("w13", mine_b13, "experts.gate_up_proj_bias")
    block.experts.load_expert_biases("w2", hf.experts.down_proj_bias.detach(), "experts.down_proj_bias")
    assert block.experts.missing_expert_biases() == []
    x = torch.randn(1, 19, H, generator=g)
    with torch.no_grad():
        want = hf(x)[0][0]
    got = block.forward(x[0])
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _load_full(moe: FusedMoE, w13, w2, b13, b2, per_expert_bias=True):
    inter = moe.intermediate_size
    for e in range(moe.num_experts):
        moe.load_expert_weight("w1", e, w13[e, :inter], f"experts.{e}.gate_proj.weight")
        moe.load_expert_weight("w3", e, w13[e, inter:], f"experts.{e}.up_proj.weight")
        moe.load_expert_weight("w2", e, w2[e], f"experts.{e}.down_proj.weight")
        if per_expert_bias:
            moe.load_expert_bias("w1", e, b13[e, :inter], f"experts.{e}.gate_proj.bias")
            moe.load_expert_bias("w3", e, b13[e, inter:], f"experts.{e}.up_proj.bias")
            moe.load_expert_bias("w2", e, b2[e], f"experts.{e}.down_proj.bias")
    if not per_expert_bias:
        load_param(moe.w13_bias, b13, "w13_bias")
        load_param(moe.w2_bias, b2, "w2_bias")


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_tp2_partial_sums_equal_tp1(backend, monkeypatch):
    """Two ranks (``TPGroup`` size 2) loaded with the same full weights and biases: their
    partial outputs sum to the tp-1 output. w13_bias is cut like w13_weight's rows; rank 0
    alone adds w2_bias."""
    monkeypatch.setenv("ATTNSERVE_MOE_BACKEND", backend)
    e, k, t = 4, 2, 21
    w13, w2, b13, b2 = _experts(e, seed=41)
    x, w, ids = _routing(t, e, k, seed=42)
    full = FusedMoE(e, H, I, torch.float32, has_bias=True, **OAI)
    _load_full(full, w13, w2, b13, b2)
    ranks = [FusedMoE(e, H, I, torch.float32, tp=TPGroup(rank=r, size=2), reduce_results=False, has_bias=True, **OAI)
             for r in range(2)]
    for r, moe in enumerate(ranks):
        assert moe.w13_bias.shape == (e, I) and moe.w2_bias.shape == (e, H)
        _load_full(moe, w13, w2, b13, b2, per_expert_bias=r == 0)  # rank 1 through load_param of full tensors
        assert moe.missing_expert_biases() == [] and moe.missing_expert_weights() == []
        half = slice(r * I // 2, (r + 1) * I // 2)
        assert torch.equal(moe.w13_bias[:, :I // 2], b13[:, :I][:, half])  # gate biases of this rank
        assert torch.equal(moe.w13_bias[:, I // 2:], b13[:, I:][:, half])  # then its up biases
        assert torch.equal(moe.w2_bias, b2)
    ref = _layer_call(full, backend, x, w, ids)
    summed = _layer_call(ranks[0], backend, x, w, ids) + _layer_call(ranks[1], backend, x, w, ids)
    assert (summed - ref).abs().max() <= 1e-5 * ref.abs().max()


class _Holder(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.experts = moe


def test_dummy_weights_cover_biases_every_tp_size():
    e, k, t = 4, 2, 13
    x, w, ids = _routing(t, e, k, seed=51)
    full = _Holder(FusedMoE(e, H, I, torch.float32, has_bias=True, **OAI))
    init_dummy_weights(full, seed=3, std=0.5)
    assert full.experts.w13_bias.abs().max() > 0.1 and full.experts.w2_bias.abs().max() > 0.1
    outs = []
    for r in range(2):
        part = _Holder(FusedMoE(e, H, I, torch.float32, tp=TPGroup(rank=r, size=2), reduce_results=False,
                                has_bias=True, **OAI))
        init_dummy_weights(part, seed=3, std=0.5)
        outs.append(part.experts(x, w, ids))
    ref = full.experts(x, w, ids)
    assert (outs[0] + outs[1] - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_fp8_experts_with_biases(strategy, monkeypatch):
    """FP8 (W8A16) experts with biases: both paths within the bound of the float64 product
    of the dequantised experts (the biases stay in the model dtype)."""
    from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
    from attnserve.models.layers.quantization.apply import quantize_model_linears
    from attnserve.models.layers.quantization.fp8_moe import dequantize_expert

    cfg = QuantizationConfig("block", (128, 128)) if strategy == "block" else QuantizationConfig("channel")
    e, k, t = 4, 2, 15
    w13, w2, b13, b2 = _experts(e, seed=61)
    x, w, ids = _routing(t, e, k, seed=62, dtype=torch.bfloat16)
    outs = []
    for backend in ("native", "triton"):
        monkeypatch.setenv("ATTNSERVE_MOE_BACKEND", backend)
        with quantized_construction(cfg):
            holder = _Holder(FusedMoE(e, H, I, torch.bfloat16, has_bias=True, **OAI))
        quantize_model_linears(holder, cfg, "cpu", torch.bfloat16)
        moe = holder.experts
        _load_full(moe, w13, w2, b13, b2)
        assert moe.w13_weight.dtype == torch.float8_e4m3fn and moe.w13_bias.dtype == torch.bfloat16
        outs.append(_layer_call(moe, backend, x, w, ids))
        moe.cpu()
    s13, s2 = moe.quant_method.scales(moe)
    bs = moe.quant_method.block_shape
    dq13 = torch.stack([dequantize_expert(moe.w13_weight, s13, i, bs, gated=True) for i in range(e)])
    dq2 = torch.stack([dequantize_expert(moe.w2_weight, s2, i, bs) for i in range(e)])
    ref, bound, _ = oai_moe_reference(x, dq13, dq2, moe.w13_bias, moe.w2_bias, w, ids, storage_dtype=torch.bfloat16)
    for out in outs:
        assert worst_ratio(out, ref, bound) <= 1.0


def test_loading_routing_and_errors():
    e = 4
    w13, w2, b13, b2 = _experts(e, seed=71)
    with pytest.raises(ValueError, match=r"unknown MoE activation 'gelu'; valid: silu, swigluoai"):
        FusedMoE(e, H, I, torch.float32, activation="gelu")
    with pytest.raises(ValueError, match="swiglu_limit must be a finite number > 0"):
        FusedMoE(e, H, I, torch.float32, activation="swigluoai", swiglu_limit=0.0)
    with pytest.raises(ValueError, match="unknown MoE activation 'relu'"):
        fused_experts_native(torch.zeros(1, H), w13, w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                             activation="relu")
    with pytest.raises(ValueError, match=r"w2_bias must be a float \[4, 64\]"):
        fused_experts_triton(torch.zeros(1, H), w13, w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                             w2_bias=b2[:, :3])
    plain = FusedMoE(e, H, I, torch.float32)
    assert plain.w13_bias is None and plain.w2_bias is None and plain.missing_expert_biases() == []
    with pytest.raises(ValueError, match="'x.bias': an expert bias for experts built without has_bias"):
        plain.load_expert_bias("w1", 0, b13[0, :I], "x.bias")
    moe = FusedMoE(e, H, I, torch.float32, has_bias=True, **OAI)
    with pytest.raises(ValueError, match=r"has shape \(64,\), expected \(32,\)"):
        moe.load_expert_bias("w3", 0, b2[0], "experts.0.up_proj.bias")
    with pytest.raises(ValueError, match=r"expected \(4, 64\)"):
        load_param(moe.w13_bias, b13[:, :I], "w13_bias")
    with pytest.raises(ValueError, match="unknown expert bias 'w1'"):
        moe.load_expert_biases("w1", b13, "w13_bias")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _Holder(moe)

    model, loaded = Model(), set()
    names = [(f"mlp.experts.{x}.{p}.{kind}", t) for x in range(e) for p, kind, t in (
        ("gate_proj", "weight", w13[x, :I]), ("up_proj", "weight", w13[x, I:]), ("down_proj", "weight", w2[x]),
        ("gate_proj", "bias", b13[x, :I]), ("up_proj", "bias", b13[x, I:]))]  # no down_proj biases
    assert [n for n, _ in route_expert_tensors(model, names + [("other", torch.zeros(1))], loaded)] == ["other"]
    assert moe.missing_expert_biases() == [(x, "w2") for x in range(e)]
    with pytest.raises(ValueError, match=r"missing 4 expert tensors: mlp\.experts\.0\.down_proj\.bias"):
        check_experts_complete(model, loaded)
    assert "activation=swigluoai(alpha=1.702, limit=7.0)" in repr(moe) and ", bias" in repr(moe)


@pytest.mark.parametrize("inter", [2880, 1440, 720])
def test_default_configs_for_gpt_oss_20b_shapes(inter):
    """gpt-oss-20b (E 32, top 4, H 2880, I 2880 / tp) has no tuned table: the CUDA default rule
    gives valid launches for every batch, whose K steps and column bands need the kernel's
    masks (2880 and 1440 are not multiples of 128; the masking itself is run by the ragged
    case above and by tests/gpu/test_fused_moe_bias_gpu.py)."""
    from attnserve.models.layers.moe.tuned_configs import default_config

    tails = []
    for t in (1, 7, 64, 300, 8192):
        cfg = default_config(t, 32, inter, 2880, 4, torch.bfloat16)
        cfg.validate()
        g1, g2 = cfg.gemm1, cfg.gemm2
        tails.append(bool(2880 % g1.block_k or inter % (g1.block_n // 2) or inter % g2.block_k or 2880 % g2.block_n))
    assert any(tails)
