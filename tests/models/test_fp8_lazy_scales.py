"""Lazy scales of the folded FP8 linears (`fused_inputs.ScaledProduct`): a folded ``o_proj`` /
``down_proj`` at tp 1 leaves its row and column scales to the add-RMSNorm that reads its
output. CPU: the fused norm kernel under the Triton interpreter against `scale_rows_cols`
followed by it, the norm's materialising path, the folded route's return value, and which
linears `lazy_scale_consumers` marks."""

from __future__ import annotations

import types

import pytest
import torch

from attnserve.model_loader.loader import load_model
from attnserve.models.layers.quantization.fused_inputs import LAZY_SCALES_ENV, ScaledProduct, lazy_scale_consumers


def _lazy(model) -> list:
    return [name for name, m in model.named_modules() if getattr(m, "fp8_lazy_output", False)]


@pytest.mark.parametrize("rdtype", [torch.float32, torch.bfloat16])
def test_norm_kernel_applies_scales_as_scale_rows_cols_interpreter(rdtype, monkeypatch):
    """`fused_add_rmsnorm_quant_fp8` with ``row_scale`` / ``col_scale`` on an unscaled float32
    product gives, bit for bit, the e4m3 values, scales and residual of `scale_rows_cols`
    followed by the same kernel without scales (both kernels interpreted: the same roundings,
    whatever the interpreter's 16-bit conversion does); N = 200 is not a power of two."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnserve.models.layers.quantization.fp8_kernels import fused_add_rmsnorm_quant_fp8, scale_rows_cols

    g = torch.Generator().manual_seed(7)
    m, n = 3, 200
    raw = torch.randn(m, n, generator=g) * 400  # an e4m3 x e4m3 product summed over K
    rs, cs = torch.rand(m, 1, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-2
    r = torch.randn(m, n, generator=g).to(rdtype)
    w = torch.rand(n, generator=g).to(rdtype)
    r_lazy, r_plain = r.clone(), r.clone()
    q, s = fused_add_rmsnorm_quant_fp8(raw, r_lazy, w, 1e-5, 0.0, row_scale=rs, col_scale=cs)
    q_ref, s_ref = fused_add_rmsnorm_quant_fp8(scale_rows_cols(raw, rs, cs, rdtype), r_plain, w, 1e-5, 0.0)
    assert torch.equal(r_lazy, r_plain) and not torch.equal(r_lazy, r)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    with pytest.raises(ValueError, match="given together"):
        fused_add_rmsnorm_quant_fp8(raw, r.clone(), w, 1e-5, row_scale=rs)
    with pytest.raises(ValueError, match="given together"):
        fused_add_rmsnorm_quant_fp8(raw, r.clone(), w, 1e-5, row_scale=rs, col_scale=cs[:-1])


def test_norm_materialises_what_it_does_not_fuse():
    """On the CPU (and for a norm that does not quantise) a `ScaledProduct` is materialised
    first: the same ``(norm, residual)`` as the scaled tensor, with and without a residual."""
    from attnserve.models.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, 1e-6, dtype=torch.bfloat16)
    norm.weight.data = torch.rand(64, generator=g).to(torch.bfloat16)
    sp = ScaledProduct(torch.randn(5, 64, generator=g) * 100, torch.rand(5, 1, generator=g) * 1e-2,
                       torch.rand(64, generator=g) * 1e-2, torch.bfloat16)
    dense = sp.materialize()
    assert dense.dtype == torch.bfloat16 and sp.shape == (5, 64)
    # one rounding to bf16: the suite runs Triton's interpreter (tests/conftest.py), which
    # truncates: up to a whole ulp, 2**-7 relative (round to nearest would give half)
    torch.testing.assert_close(dense.float(), sp.raw * sp.row_scale * sp.col_scale, rtol=2 ** -7, atol=0)
    r = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    got, got_r = norm.forward(sp, r.clone())
    want, want_r = norm.forward(dense, r.clone())
    assert torch.equal(got, want) and torch.equal(got_r, want_r)
    assert torch.equal(norm.forward(sp), norm.forward(dense))


def test_folded_route_returns_the_product_when_marked(monkeypatch):
    """`Fp8LinearMethod._folded_down` on a marked ``down_proj`` returns a `ScaledProduct`
    (raw product, the input's token scales, the weight's channel scales) whose value is what
    the unmarked route returns; ``lazy=False`` (an input of more than two dimensions) keeps
    the tensor. The GEMM is stood in for on the CPU by the float32 product it computes."""
    from attnserve.models.layers.quantization import fp8_kernels
    from attnserve.models.layers.quantization.fp8_kernels import quantize_activation
    from attnserve.models.layers.quantization.fused_inputs import Fp8Activation

    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    down = loaded.model.model.layers[0].mlp.down_proj
    method = down.quant_method
    monkeypatch.setattr(type(method), "_unscaled_product",
                        lambda self, layer, x, dt: (x.q.float() @ layer.weight.float().t()).to(dt))
    monkeypatch.setattr(fp8_kernels, "_use_triton", lambda t: False)  # scale_rows_cols in PyTorch
    x = torch.randn(24, down.in_features, generator=torch.Generator().manual_seed(1))
    a = Fp8Activation(*quantize_activation(x), x.dtype)
    assert down.fp8_lazy_output
    sp = method._folded_down(down, a)
    assert isinstance(sp, ScaledProduct) and sp.raw.dtype == torch.float32
    assert sp.row_scale is a.scale and sp.col_scale is down.weight_scale
    kept = method._folded_down(down, a, lazy=False)
    assert isinstance(kept, torch.Tensor) and torch.equal(sp.materialize(), kept)
    down.fp8_lazy_output = False
    assert torch.equal(method._folded_down(down, a), kept)


def test_marks_follow_the_reader(monkeypatch):
    """Every Llama layer's folded ``o_proj`` and ``down_proj`` are marked (the last layer's
    ``down_proj`` feeds the final norm of `DecoderModel.forward`); none with
    ``ATTNSERVE_FP8_LAZY_SCALES=0``; a ``down_proj`` whose reader is a layer that overrides
    ``forward``, that layer's own linears, and linears under tensor parallelism are not."""
    from attnserve.models.layers.quantization.fused_inputs import enable_fused_producers
    from attnserve.models.llama import LlamaDecoderLayer

    loaded = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    n = len(loaded.model.model.layers)
    assert _lazy(loaded.model) == [f"model.layers.{i}.{p}" for i in range(n) for p in ("self_attn.o_proj",
                                                                                        "mlp.down_proj")]
    monkeypatch.setenv(LAZY_SCALES_ENV, "0")
    off = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    assert _lazy(off.model) == [] and off.model.model.layers[0].mlp.down_proj.fp8_folded_max_m

    class OwnForward(LlamaDecoderLayer):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    monkeypatch.setenv("ATTNSERVE_FP8_FUSED_PRODUCERS", "0")  # loaded unmarked; marked below
    monkeypatch.delenv(LAZY_SCALES_ENV)
    own = load_model("llama-tiny", load_format="dummy", load_tokenizer=False, progress=False, quantization="fp8")
    layers = own.model.model.layers
    layers[1].__class__ = OwnForward
    enable_fused_producers(own.model)
    assert _lazy(own.model) == ["model.layers.0.self_attn.o_proj"]
    layers[1].__class__ = LlamaDecoderLayer
    enable_fused_producers(own.model)
    down = layers[0].mlp.down_proj
    assert down in lazy_scale_consumers(own.model)
    down.tp = types.SimpleNamespace(size=2)
    assert down not in lazy_scale_consumers(own.model)
