"""Opt-in W8A16 one-row variants (`fp8_gemv`, issue 37) under the Triton interpreter: each
variant's plain-``tl`` form against the float64 product of x and the dequantised weight,
within `fp8_gemv_error_bound`; f16 range edge cases of ``f16x2``; the
``ATTNSERVE_FP8_GEMV`` routing of `skinny_linear_fp8` and the errors of bad input."""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.quantization.fp8_utils import dequantize, quantize_per_row

TINY = {"f32": (4, 64, 1, 1), "f16x2": (4, 64, 1, 1), "dot16": (16, 32, 1, 1)}


def _cfg(variant, carry=False):
    from attnserve.models.layers.fp8_gemv import Fp8GemvConfig

    return Fp8GemvConfig(variant, *TINY[variant], carry=carry)


def _ref(x, wq, ws, act):
    full = x.double() @ dequantize(wq, ws).double().t()
    if act is None:
        return full
    i = full.shape[1] // 2
    return torch.nn.functional.silu(full[:, :i]) * full[:, i:]


def _check(variant, x, wq, ws, act, carry=False):
    from attnserve.models.layers.fp8_gemv import fp8_gemv, fp8_gemv_error_bound

    y = fp8_gemv(x, wq, ws, None, act, variant=variant, config=_cfg(variant, carry)).double()
    ref = _ref(x, wq, ws, act)
    # the interpreter truncates the 16-bit output: 2**-7 relative
    bound = fp8_gemv_error_bound(x, wq, ws, variant, act, out_rel=2.0 ** -7)
    assert torch.isfinite(y).all()
    assert ((y - ref).abs() <= bound).all(), float(((y - ref).abs() / bound).max())
    return y, ref


@pytest.mark.parametrize("variant", ["f32", "f16x2", "dot16"])
def test_variants_match_float64_interpreter(variant, monkeypatch):
    """Plain (N = 24: a partial row block; K = 200: a partial K step) and gated (SiLU); the
    f32 form also with carried tiles (f16x2's interpreter form has one loop for both)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(7)
    for n, k, act in ((24, 200, None), (32, 136, "silu")):
        wq, ws = quantize_per_row(torch.randn(n, k, generator=g) * 0.05)
        x = torch.randn(1, k, generator=g).to(torch.bfloat16)
        if variant == "f32":
            _check(variant, x, wq, ws, act, carry=True)
        y, ref = _check(variant, x, wq, ws, act)
        assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()  # and the bound is not vacuous here


def test_f16x2_range_edges_interpreter(monkeypatch):
    """f16 products: x near f16's largest value against weights at e4m3's largest (448)
    stays finite (the 2**-11 weight scaling); a small-valued x (|x| ~ 1e-3, typical of a
    down_proj input) keeps its precision (no f16 subnormals for x)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(11)
    n, k = 8, 128
    w = torch.randn(n, k, generator=g).sign()  # every |w_q| = 448 after per-row quantisation
    wq, ws = quantize_per_row(w)
    assert wq.float().abs().min() == 448
    x = (torch.randn(1, k, generator=g).sign() * 60000).to(torch.bfloat16)
    _check("f16x2", x, wq, ws, None)
    wq, ws = quantize_per_row(torch.randn(n, k, generator=g) * 0.05)
    x = (torch.randn(1, k, generator=g) * 1e-3).to(torch.bfloat16)
    y, ref = _check("f16x2", x, wq, ws, None)
    # truncation to bf16 (2**-7) dominates; x * 2**-11 in f16 would lose ~1% per entry here
    assert ((y - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-3 * ref.abs().max()).all()


def test_env_routes_one_row_and_rejects_unknown(monkeypatch):
    """``ATTNSERVE_FP8_GEMV=<variant>``: one row through `skinny_linear_fp8` gives the bits
    of `fp8_gemv` (same kernel and default tile); unset / ``default`` is f16x2, ``skinny`` /
    ``0`` the skinny kernel; unsupported operands (f16x2 with float16 x) take the skinny
    kernel; an unknown name raises; two rows ignore the variable."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnserve.models.layers.fp8_gemv import fp8_gemv, fp8_gemv_supported
    from attnserve.models.layers.skinny_gemm import fp8_skinny_config, skinny_linear_fp8

    g = torch.Generator().manual_seed(3)
    wq, ws = quantize_per_row(torch.randn(16, 96, generator=g) * 0.05)
    x = torch.randn(1, 96, generator=g).to(torch.bfloat16)
    default = skinny_linear_fp8(x, wq, ws, config=fp8_skinny_config(1, 16, 96))
    monkeypatch.setenv("ATTNSERVE_FP8_GEMV", "f16x2")
    assert torch.equal(skinny_linear_fp8(x, wq, ws), fp8_gemv(x, wq, ws, variant="f16x2"))
    xh = x.to(torch.float16)
    assert not fp8_gemv_supported(xh, wq, ws, None, "f16x2")
    plain = skinny_linear_fp8(xh, wq, ws, config=fp8_skinny_config(1, 16, 96))
    assert torch.equal(skinny_linear_fp8(xh, wq, ws), plain)
    with pytest.raises(ValueError, match="unsupported"):
        fp8_gemv(xh, wq, ws, variant="f16x2")
    monkeypatch.setenv("ATTNSERVE_FP8_GEMV", "skinny")
    assert torch.equal(skinny_linear_fp8(x, wq, ws), default)
    for unset in ("default", ""):  # f16x2 by default
        monkeypatch.setenv("ATTNSERVE_FP8_GEMV", unset)
        assert torch.equal(skinny_linear_fp8(x, wq, ws), fp8_gemv(x, wq, ws, variant="f16x2"))
    monkeypatch.delenv("ATTNSERVE_FP8_GEMV")
    assert torch.equal(skinny_linear_fp8(x, wq, ws), fp8_gemv(x, wq, ws, variant="f16x2"))
    monkeypatch.setenv("ATTNSERVE_FP8_GEMV", "0")
    assert torch.equal(skinny_linear_fp8(x, wq, ws), default)
    monkeypatch.setenv("ATTNSERVE_FP8_GEMV", "f8x4")
    with pytest.raises(ValueError, match="ATTNSERVE_FP8_GEMV"):
        skinny_linear_fp8(x, wq, ws)
    monkeypatch.setenv("ATTNSERVE_FP8_GEMV", "dot16")
    x2 = torch.randn(2, 96, generator=g).to(torch.bfloat16)
    assert not fp8_gemv_supported(x2, wq, ws, None, "dot16")


def test_config_and_candidates():
    """Tiles by shape class, candidates start with the default, invalid configs raise."""
    from attnserve.models.layers.fp8_gemv import Fp8GemvConfig, fp8_gemv_candidates, fp8_gemv_config

    for variant in ("f32", "f16x2", "dot16"):
        for n, k, gated in ((6144, 4096, False), (4096, 4096, False), (14336, 4096, True), (4096, 14336, False)):
            cands = fp8_gemv_candidates(variant, n, k, gated=gated)
            assert cands[0] == fp8_gemv_config(variant, n, k, gated=gated)
            assert len(set(cands)) == len(cands) >= 2
            for c in cands:
                c.validate()
                assert c.block_k >= 256 * c.num_warps or variant == "dot16"  # a full layout row
    assert fp8_gemv_config("f16x2", 64, 100).block_k == 128  # capped at next_pow2(K)
    with pytest.raises(ValueError, match="invalid"):
        Fp8GemvConfig("dot16", 8, 64).validate()
    with pytest.raises(ValueError, match="unknown variant"):
        fp8_gemv_config("int4", 64, 64)
