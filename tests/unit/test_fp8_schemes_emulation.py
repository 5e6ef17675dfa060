"""`benchmarks/fp8_schemes.EmulatedFp8Method` (the scheme table of `fp8_accuracy.py
--schemes`) computes what the FP8 linear methods' CPU reference computes: the same weight
quantised per channel (per-token activations) or in 128 x 128 blocks (1 x 128 activation
groups) gives bit-identical outputs (the reference: Triton interpreter off), gated or not,
and ``activation="none"`` is W8A16."""

import sys
from pathlib import Path

import pytest
import torch

from attnserve.models.layers.linear import Linear
from attnserve.models.layers.quantization.config import QuantizationConfig
from attnserve.models.layers.quantization.fp8_linear import BlockFp8LinearMethod, Fp8LinearMethod
from attnserve.models.layers.quantization.fp8_utils import (
    dequantize,
    quantize_per_block,
    quantize_per_row,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fp8_schemes  # noqa: E402


def _fp8_linear(w: torch.Tensor, block: bool) -> Linear:
    n, k = w.shape
    lin = Linear(k, n, dtype=torch.bfloat16)
    if block:
        method = BlockFp8LinearMethod(QuantizationConfig("block", (128, 128)))
        method.create_weights(lin, torch.device("cpu"), torch.bfloat16)
        q, s = quantize_per_block(w)
        lin.weight_scale_inv.data.copy_(s)
    else:
        method = Fp8LinearMethod(QuantizationConfig())
        method.create_weights(lin, torch.device("cpu"), torch.bfloat16)
        q, s = quantize_per_row(w)
        lin.weight_scale.data.copy_(s)
    lin.weight.data.copy_(q)
    lin.quant_method = method
    return lin


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("gated", [None, "silu"])
def test_emulation_matches_reference_path(block, gated, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the methods' PyTorch reference, not the kernels
    torch.manual_seed(0)
    w = (torch.randn(192, 200) * 0.05).bfloat16()  # K not a multiple of 128
    x = torch.randn(7, 200).bfloat16()
    real = _fp8_linear(w, block)
    emu = fp8_schemes.EmulatedFp8Method(w, "block" if block else "channel", "group" if block else "token")
    y_real = real.quant_method.apply(real, x, None, gated)
    y_emu = emu.apply(real, x, None, gated)
    assert y_emu.dtype == y_real.dtype == torch.bfloat16
    assert torch.equal(y_emu, y_real)


def test_w8a16_and_bytes():
    torch.manual_seed(1)
    w = (torch.randn(64, 96) * 0.05).bfloat16()
    x = torch.randn(3, 96).bfloat16()
    q, s = quantize_per_row(w)
    emu = fp8_schemes.EmulatedFp8Method(w, "channel", "none")
    expected = (x.float() @ dequantize(q, s).t()).bfloat16()
    assert torch.equal(emu.apply(None, x, None), expected)
    lin = Linear(96, 64, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    lins = {"model.layers.0.mlp.down_proj": lin}
    size = fp8_schemes.apply_scheme(lins, fp8_schemes.Scheme("t", "channel", "none", lambda n: True))
    assert size["linear_bytes_rel"] == pytest.approx((64 * 96 + 4 * 64) / (2 * 64 * 96))
    assert size["quantised_params_share"] == 1.0
    fp8_schemes.clear_scheme(lins)
    assert lin.quant_method is None
