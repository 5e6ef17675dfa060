"""FP8-weight mid-size GEMM (`fp8_mid_gemm`, 16 < M <= 256, issue 37) against float64.

Runs on CPU under the Triton interpreter (tests/kernels/conftest.py; the interpreter has no
FP8 ``tl.dot``, so the kernel's ``UPCAST`` form multiplies the e4m3 / bf16 operands in
float32, where their products are exact, as on the GPU) and on a GPU as is. Tiny ragged
shapes: M = 17 (one 32-row piece) and 33 (32 + 16), N = 48 / 64 (48: a partial 32-row
block), K = 96 / 160 (tails of 32 past ``block_k`` 64), per-channel and per-tensor weight
scales, with and without bias, split-K off, 2 and 3 (3 programs over 3 K steps: one each).

Bound (element-wise), the reference being float64 of the *same* quantised operands
(``x`` or ``q * s_x``, and ``W_q * s_w``):

* the products ``x * W_q`` (bf16 x e4m3: 8 x 4 significant bits) and ``q * W_q`` are exact
  in float32; summing K of them in any order (tiles, split-K atomics) errs by at most
  ``gamma_K * sum |x W_q|`` (Higham, 2nd ed., eq. 3.5); the epilogue's weight-scale and
  token-scale products and the bias add are three more roundings of ``u`` each, so
  ``gamma_{K+3} * (|x| @ |W|^T + |b|)`` over the dequantised magnitudes bounds it all;
* one rounding to bf16: at most one bf16 ulp, ``2**-7 |y|`` (the interpreter may truncate).

Gated: ``act(g) * u`` with ``|act'| <= 1.2`` (SiLU, GELU-tanh): ``1.2 |u| e_g + |act(g)|
e_u``, float32 activation math ``1e-6 |y|``, then the bf16 rounding (as tests/kernels/
test_mid_gemm.py).
"""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.mid_gemm import MidGemmConfig, m_pieces
from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
from attnserve.models.layers.quantization.fp8_mid_gemm import (
    FP8_MID_TABLE,
    M_BUCKETS,
    SMEM_BUDGET,
    fp8_mid_candidates,
    fp8_mid_config,
    fp8_mid_gemm_mode,
    fp8_mid_linear,
    fp8_mid_supported,
)
from attnserve.models.layers.quantization.fp8_utils import dequantize, quantize_per_row, quantize_per_tensor
from gate_reference import gate_act_ref
from numeric_bounds import FLOAT32_U, assert_within

BF16_ULP = 2.0**-7


def _weights(gen, n, k, per_tensor, device):
    w = torch.randn(n, k, generator=gen) * 0.05
    wq, ws = quantize_per_tensor(w) if per_tensor else quantize_per_row(w)
    return wq.to(device), ws.reshape(-1).to(device)


def _bound_terms(a64, w64, b64):
    """``(ref, gamma_{K+3} * (|a| @ |w|^T + |b|))`` in float64."""
    k = a64.shape[1] + 3
    gamma = k * FLOAT32_U / (1 - k * FLOAT32_U)
    ref = a64 @ w64.T + (b64 if b64 is not None else 0.0)
    mag = a64.abs() @ w64.abs().T + (b64.abs() if b64 is not None else 0.0)
    return ref, gamma * mag



CASES = [  # mode, m, n, k, per_tensor, bias, activation, config
    ("w8a16", 17, 48, 96, False, False, None, MidGemmConfig(block_n=32, block_k=64)),
    ("w8a16", 33, 64, 160, True, True, None, MidGemmConfig(block_n=32, block_k=64, split_k=3)),
    ("w8a8", 17, 64, 160, False, True, None, MidGemmConfig(block_n=16, block_k=64, split_k=2)),
    ("w8a8", 33, 48, 96, True, False, None, MidGemmConfig(block_n=32, block_k=64)),
    ("w8a16", 33, 48, 96, False, True, "silu", MidGemmConfig(block_n=16, block_k=64, split_k=2)),
    ("w8a8", 17, 64, 160, True, False, "gelu_tanh", MidGemmConfig(block_n=32, block_k=64, split_k=3)),
]


@pytest.mark.parametrize("mode,m,n,k,per_tensor,bias,activation,cfg", CASES,
                         ids=["w8a16-m17-chan", "w8a16-m33-tensor-bias-split3", "w8a8-m17-chan-bias-split2",
                              "w8a8-m33-tensor", "w8a16-m33-silu-bias-split2", "w8a8-m17-gelu-tensor-split3"])
def test_fp8_mid_linear_matches_float64(gen, device, mode, m, n, k, per_tensor, bias, activation, cfg):
    wq, ws = _weights(gen, n, k, per_tensor, device)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    b = torch.randn(n, generator=gen).to(torch.bfloat16).to(device) if bias else None
    if mode == "w8a8":
        q, s = quantize_activation(x)
        assert fp8_mid_supported(q, wq, ws, b, s, torch.bfloat16)
        y = fp8_mid_linear(q, wq, ws, b, activation, x_scale=s, out_dtype=torch.bfloat16, config=cfg)
        a64 = dequantize(q, s).double().cpu()
    else:
        assert fp8_mid_supported(x, wq, ws, b)
        y = fp8_mid_linear(x, wq, ws, b, activation, config=cfg)
        a64 = x.double().cpu()
    cols = n // 2 if activation else n
    assert y.shape == (m, cols) and y.dtype == torch.bfloat16 and y.is_contiguous()
    ref, bound = _reference_and_bound(a64, wq, ws, b.double().cpu() if bias else None, activation)
    assert_within(y.double().cpu(), ref, bound, f"fp8_mid_linear {mode} m={m} {cfg}")
    # not vacuous: a missing K step or a wrong scale moves outputs by ~|y|
    assert float(bound.max()) < 0.05 * float(ref.abs().max())


def _reference_and_bound(a64, wq, ws, b64, activation):
    """float64 ``(reference, element-wise bound)`` of the module doc for the dequantised
    activations ``a64`` and the e4m3 weight ``wq`` with its scales ``ws``."""
    w64 = dequantize(wq.cpu(), ws.cpu()).double()
    ref, e = _bound_terms(a64, w64, b64)
    if activation:
        cols = ref.shape[1] // 2
        g, u = ref[:, :cols], ref[:, cols:]
        ref = gate_act_ref(g, activation) * u
        bound = 1.2 * u.abs() * e[:, :cols] + gate_act_ref(g, activation).abs() * e[:, cols:]
        bound = bound + (BF16_ULP + 1e-6) * ref.abs()
    else:
        bound = e + BF16_ULP * ref.abs()
    return ref, bound + 1e-30


PDL_CASES = [  # mode, m, n, k, activation, config (the plain one; its PDL twin adds pdl / prefetch)
    ("w8a8", 33, 48, 96, None, MidGemmConfig(block_n=32, block_k=32)),
    ("w8a16", 17, 64, 160, "silu", MidGemmConfig(block_n=32, block_k=64, split_k=2)),
    # 3 K steps over 4 splits: the last program's range is empty (its peeled step adds zeros)
    ("w8a8", 20, 64, 96, None, MidGemmConfig(block_n=32, block_k=32, split_k=4)),
    ("w8a8", 33, 80, 96, "gelu_tanh", MidGemmConfig(block_n=32, block_k=32, split_k=3)),
]


@pytest.mark.parametrize("mode,m,n,k,activation,cfg", PDL_CASES,
                         ids=["w8a8-plain", "w8a16-silu-split2", "w8a8-split4-empty-range", "w8a8-gelu-split3"])
def test_pdl_form_matches_plain_kernel(gen, device, mode, m, n, k, activation, cfg):
    """The PDL form (first ``K`` step peeled, weight tiles loaded before the wait, L2 hints;
    on a GPU also launched with PDL behind a producer kernel) gives the plain kernel's bits:
    same accumulation order. With split-K the GPU's atomics add in any order, so there the
    two agree to the float32 accumulation bound instead."""
    import dataclasses

    wq, ws = _weights(gen, n, k, False, device)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    twin = dataclasses.replace(cfg, pdl=True, prefetch=2)

    def run(c):
        xin = x * 1.0  # a producer kernel right before the GEMM (the PDL launch overlaps it)
        if mode == "w8a8":
            q, s = quantize_activation(xin)
            return fp8_mid_linear(q, wq, ws, None, activation, x_scale=s, out_dtype=torch.bfloat16, config=c)
        return fp8_mid_linear(xin, wq, ws, None, activation, config=c)

    plain, pdl = run(cfg), run(twin)
    if cfg.split_k == 1 or device.type == "cpu":
        assert torch.equal(plain, pdl)
    else:
        a64 = (dequantize(*quantize_activation(x)) if mode == "w8a8" else x).double().cpu()
        ref, bound = _reference_and_bound(a64, wq, ws, None, activation)
        for y, name in ((plain, "plain"), (pdl, "pdl")):
            assert_within(y.double().cpu(), ref, bound, f"{name} {cfg}")
    assert float(plain.double().abs().max()) > 0  # not vacuous


def test_default_config_and_rejects_bad_input(gen, device):
    """``config=None`` takes the table (block_k capped to K); bad operands raise ValueError."""
    wq, ws = _weights(gen, 64, 96, False, device)
    x = torch.randn(20, 96, generator=gen).to(torch.bfloat16).to(device)
    y = fp8_mid_linear(x, wq, ws)
    ref = x.double().cpu() @ dequantize(wq.cpu(), ws.cpu()).double().T
    assert (y.double().cpu() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert not fp8_mid_supported(x.float(), wq, ws)  # float32 activations
    assert not fp8_mid_supported(x, wq.float(), ws)  # unquantised weight
    assert not fp8_mid_supported(torch.zeros(257, 96, dtype=torch.bfloat16, device=device), wq, ws)
    assert not fp8_mid_supported(x, wq, ws[:10])  # scale rows do not match
    q, s = quantize_activation(x)
    assert not fp8_mid_supported(q, wq, ws)  # e4m3 x without its scale
    assert not fp8_mid_supported(q, wq, ws, x_scale=s)  # ... or without an output dtype
    with pytest.raises(ValueError, match="fp8_mid_linear: unsupported"):
        fp8_mid_linear(q, wq, ws)
    with pytest.raises(ValueError, match="activation"):
        fp8_mid_linear(x, wq, ws, activation="relu")
    with pytest.raises(ValueError, match="even number"):
        fp8_mid_linear(x, wq[:63].contiguous(), ws[:63].contiguous(), activation="silu")


def test_table_configs_valid_and_fit_shared_memory():
    """Every table entry (both modes, Llama-3-8B shapes) validates, caps block_k at K and
    fits `SMEM_BUDGET`; candidates start with the table's choice and hold no duplicates."""
    for mode, xbytes in (("w8a16", 2), ("w8a8", 1)):
        for n, k, gated in ((6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False),
                            (40000, 4096, False), (48, 96, False)):
            for m in (17, 32, 33, 64, 100, 128, 200, 256):
                cfg = fp8_mid_config(m, n, k, mode, gated)
                cfg.validate()
                assert cfg.block_k <= max(32, 1 << (k - 1).bit_length())
                pieces = sum(m_pieces(m))
                per_stage = ((2 if gated else 1) * cfg.block_n + pieces * xbytes) * cfg.block_k
                assert cfg.num_stages * per_stage <= SMEM_BUDGET or cfg.num_stages == 1
                cands = fp8_mid_candidates(m, n, k, mode, gated)
                assert cands[0] == cfg and len(set(cands)) == len(cands) >= 4
    assert all(sorted(row) == list(M_BUCKETS) for row in FP8_MID_TABLE.values())
    with pytest.raises(ValueError):
        fp8_mid_config(257, 64, 64, "w8a16")
    with pytest.raises(ValueError):
        fp8_mid_config(64, 64, 64, "w4a16")


def test_linear_routing_by_env(monkeypatch, device):
    """``ATTNSERVE_FP8_MID_GEMM``: unset -> the existing path (the kernel is not called);
    ``w8a16`` -> `fp8_mid_linear` on the 16-bit rows (bits equal to a direct call), the gated
    form fused; ``w8a8`` -> on the per-token quantised rows, and a producer-quantised
    `Fp8Activation` input too; 16 rows (the skinny range) and 257 rows are not routed; a
    bad value raises."""
    import attnserve.models.layers.quantization.fp8_mid_gemm as mid
    from attnserve.models.layers.linear import Linear
    from attnserve.models.layers.parallel import load_param
    from attnserve.models.layers.quantization import QuantizationConfig, quantized_construction
    from attnserve.models.layers.quantization.apply import quantize_model_linears
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation

    cfg = QuantizationConfig("channel")
    with quantized_construction(cfg):
        layer = Linear(96, 64, dtype=torch.bfloat16)
    quantize_model_linears(layer, cfg, device, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    load_param(layer.weight, (torch.randn(64, 96, generator=g) * 0.05).to(torch.bfloat16).to(device), "w")
    layer.use_fused = True
    calls = []
    real = mid.fp8_mid_linear
    monkeypatch.setattr(mid, "fp8_mid_linear", lambda *a, **kw: calls.append(a[0].dtype) or real(*a, **kw))
    x = torch.randn(20, 96, generator=g).to(torch.bfloat16).to(device)
    monkeypatch.delenv("ATTNSERVE_FP8_MID_GEMM", raising=False)
    assert fp8_mid_gemm_mode() is None
    layer(x)
    assert calls == []
    monkeypatch.setenv("ATTNSERVE_FP8_MID_GEMM", "w8a16")
    assert torch.equal(layer(x), real(x, layer.weight, layer.weight_scale))
    assert torch.equal(layer.forward_gated(x, "silu"), real(x, layer.weight, layer.weight_scale, activation="silu"))
    assert calls == [torch.bfloat16, torch.bfloat16]
    layer(x[:16])
    layer(torch.cat([x] * 13)[:257])
    assert len(calls) == 2
    monkeypatch.setenv("ATTNSERVE_FP8_MID_GEMM", "w8a8")
    q, s = quantize_activation(x)
    want = real(q, layer.weight, layer.weight_scale, x_scale=s, out_dtype=torch.bfloat16)
    assert torch.equal(layer(x), want)
    assert torch.equal(layer(Fp8Activation(q, s, torch.bfloat16)), want)
    assert calls[2:] == [torch.float8_e4m3fn, torch.float8_e4m3fn]
    monkeypatch.setenv("ATTNSERVE_FP8_MID_GEMM", "w4a16")
    with pytest.raises(ValueError, match="ATTNSERVE_FP8_MID_GEMM"):
        layer(x)


def test_table_rows_with_pdl_fields():
    """A table row's optional 7th / 8th fields give ``pdl`` / ``prefetch`` (absent: plain); the
    PDL form keeps a stage of shared memory for its peeled first step; ``pdl`` with split-K
    validates only for the FP8 kernel (its workspace is not zeroed by a launch right before)."""
    from attnserve.models.layers.quantization.fp8_mid_gemm import _config_from_row

    plain = _config_from_row((64, 128, 4, 6, 2, True), 64, 4096, False, "w8a8")
    assert (plain.pdl, plain.prefetch, plain.use_tma) == (False, 0, True)
    twin = _config_from_row((64, 128, 4, 6, 2, True, True, 3), 64, 4096, False, "w8a8")
    assert (twin.pdl, twin.prefetch, twin.split_k) == (True, 3, 2)
    per_stage = (64 + sum(m_pieces(64))) * 128
    assert (twin.num_stages + 1) * per_stage <= SMEM_BUDGET and twin.num_stages <= plain.num_stages
    assert _config_from_row((64, 128, 4, 4, 1, False, False, 3), 64, 4096, False, "w8a8").prefetch == 0
    with pytest.raises(ValueError, match="pdl needs split_k"):
        twin.validate()
    twin.validate(pdl_with_split_k=True)
