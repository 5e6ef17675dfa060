"""Skinny GEMM kernels (`attnserve.models.layers.skinny_gemm`) against float64 references.

Runs on CPU under the Triton interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1
when there is no GPU) and on a GPU as is. Shapes are small and ragged on purpose: N and K
are not multiples of the tiles (N=40, K=72 with block_k=32 leaves an 8-wide K tail and a
partial column block; N=96, K=160 a 32-wide tail with block_k=64), M in {1, 3, 16} covers
the 2-D broadcast path, a masked 4-row tile and a full tl.dot tile.

Tolerances. The reference is computed in float64 from the *same* rounded inputs, so the
only errors are (a) float32 accumulation over K <= 160 terms of size ~1 (relative ~1e-6,
absolute <= ~1e-5) and (b) the single rounding of the output to the storage dtype: at most
half an ulp, i.e. 2**-24 (float32), 2**-11 (float16), 2**-8 relative (bfloat16). Hence
``rtol`` = one ulp for the 16-bit dtypes (twice the worst rounding: 2**-10, 2**-7) and
2e-6 for float32 (where the accumulation order dominates), plus a small ``atol`` for
outputs near zero where cancellation leaves only the float32 accumulation error. The gated
kernel adds float32 activation math (exp-based sigmoid / tanh, relative error ~1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnserve.models.layers import cpu_gemm
from attnserve.models.layers.linear import Linear
from attnserve.models.layers.skinny_gemm import (
    MAX_SKINNY_M,
    SkinnyGemmConfig,
    skinny_gemm_config,
    skinny_gemm_supported,
    skinny_linear,
    skinny_linear_gated,
)
from numeric_bounds import assert_within, dot_product_bound

TOL = {
    torch.float32: dict(rtol=2e-6, atol=2e-5),
    torch.float16: dict(rtol=2.0**-10, atol=1e-4),
    torch.bfloat16: dict(rtol=2.0**-7, atol=1e-4),
}


def _inputs(gen, m, n, k, dtype, device, bias):
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


def _ref_linear(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def _ref_gated(x, w, b, activation):
    y = _ref_linear(x, w, b)
    i = w.shape[0] // 2
    g, u = y[:, :i], y[:, i:]
    if activation == "silu":
        a = g / (1.0 + torch.exp(-g))
    else:
        a = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    return a * u


def _check(out, ref, dtype, shape):
    assert out.dtype == dtype and tuple(out.shape) == tuple(shape) and out.is_contiguous()
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), **TOL[dtype])


CONFIGS = {
    "bcast": SkinnyGemmConfig(block_n=16, block_k=32, use_dot=False),
    "dot": SkinnyGemmConfig(block_n=16, block_k=64, use_dot=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n,k", [(40, 72), (96, 160)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_linear(m, n, k, bias, cfg, dtype, gen, device):
    x, w, b = _inputs(gen, m, n, k, dtype, device, bias)
    out = skinny_linear(x, w, b, config=CONFIGS[cfg])
    _check(out, _ref_linear(x, w, b), dtype, (m, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (3, 96, 160), (8, 40, 72), (16, 96, 160), (2, 5, 1200)])
def test_skinny_linear_default_config(m, n, k, dtype, gen, device):
    x, w, b = _inputs(gen, m, n, k, dtype, device, bias=m % 2 == 1)
    _check(skinny_linear(x, w, b), _ref_linear(x, w, b), dtype, (m, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("i,k,bias", [(20, 72, False), (48, 160, True)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_linear_gated(m, i, k, bias, activation, cfg, dtype, gen, device):
    x, w, b = _inputs(gen, m, 2 * i, k, dtype, device, bias)
    x = x * 2.0  # gate pre-activations over a few units: both tails of silu / gelu matter
    out = skinny_linear_gated(x, w, activation, bias=b, config=CONFIGS[cfg])
    _check(out, _ref_gated(x, w, b, activation), dtype, (m, i))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_extreme_gates(activation, device):
    """Huge |gate| must saturate (act -> 0 or g) without inf/nan from the exp."""
    k, i = 16, 24
    x = torch.ones(2, k, device=device)
    w = torch.zeros(2 * i, k)
    w[:i] = torch.linspace(-400.0, 400.0, i)[:, None] / k  # gates -400..400
    w[i:] = 1.0 / k  # up = 1
    w = w.to(device)
    out = skinny_linear_gated(x, w, activation, config=CONFIGS["bcast"])
    assert torch.isfinite(out).all()
    _check(out, _ref_gated(x, w, None, activation), torch.float32, (2, i))


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("layout", ["padded_rows", "every_other_row"])
def test_strided_x_rows(layout, use_dot, gen, device):
    m, n, k = 5, 40, 72
    if layout == "padded_rows":  # slice on the device: .to(device) of a view would copy it contiguous
        buf = torch.randn(m, k + 24, generator=gen).to(device)
        x = buf[:, 3 : 3 + k]
    else:
        buf = torch.randn(2 * m, k, generator=gen).to(device)
        x = buf[::2]
    assert not x.is_contiguous() and x.stride(1) == 1
    _, w, b = _inputs(gen, m, n, k, torch.float32, device, bias=True)
    cfg = CONFIGS["dot" if use_dot else "bcast"]
    _check(skinny_linear(x, w, b, config=cfg), _ref_linear(x, w, b), torch.float32, (m, n))
    _check(skinny_linear_gated(x, w, "silu", bias=b, config=cfg), _ref_gated(x, w, b, "silu"), torch.float32, (m, n // 2))


def test_default_configs_are_valid():
    for dtype in (torch.bfloat16, torch.float32):
        for m in range(1, MAX_SKINNY_M + 1):
            for n, k in [(960, 576), (576, 1536), (6144, 4096), (28672, 4096), (128256, 4096), (5, 3)]:
                for gated in (False, True):
                    cfg = skinny_gemm_config(m, n, k, dtype, 132, gated=gated)
                    cfg.validate()
                    assert cfg.use_dot == (m >= 2 and dtype != torch.float32)  # the H100-tuned rule
                    if not cfg.use_dot:  # register budget of the broadcast product
                        assert (2 if gated else 1) * cfg.block_m(m) * cfg.block_n * cfg.block_k <= 64 * 32 * cfg.num_warps
    # large matrices get >= 2 programs per SM
    cfg = skinny_gemm_config(1, 4096, 4096, torch.bfloat16, 132)
    assert -(-4096 // cfg.block_n) >= 264


def test_bad_inputs(device, monkeypatch):
    x = torch.randn(2, 8, device=device)
    w = torch.randn(6, 8, device=device)
    cases = [
        (lambda: skinny_linear(x[None], w), "2-D"),
        (lambda: skinny_linear(x[:0], w), "rows"),
        (lambda: skinny_linear(torch.randn(MAX_SKINNY_M + 1, 8, device=device), w), "rows"),
        (lambda: skinny_linear(x, torch.randn(6, 9, device=device)), "weight \\[N, K\\] with K"),
        (lambda: skinny_linear(x, w.to(torch.bfloat16)), "dtypes"),
        (lambda: skinny_linear(x.double(), w.double()), "dtypes"),
        (lambda: skinny_linear(x, torch.randn(8, 6, device=device).t()), "contiguous"),
        (lambda: skinny_linear(torch.randn(8, 2, device=device).t(), w), "contiguous last dim"),
        (lambda: skinny_linear(x, w, torch.randn(5, device=device)), "bias"),
        (lambda: skinny_linear(x, w, torch.randn(6, device=device, dtype=torch.float16)), "bias"),
        (lambda: skinny_linear(x, w, torch.randn(12, device=device)[::2]), "bias"),
        (lambda: skinny_linear(x, w, config=SkinnyGemmConfig(block_n=24, block_k=32)), "powers of two"),
        (lambda: skinny_linear(x, w, config=SkinnyGemmConfig(block_n=8, block_k=32, use_dot=True)), "use_dot"),
        (lambda: skinny_linear(x, w, config=SkinnyGemmConfig(block_n=8, block_k=32, num_warps=3)), "num_warps"),
        (lambda: skinny_linear(x, w, config=SkinnyGemmConfig(block_n=8, block_k=32, num_stages=0)), "num_stages"),
        (lambda: skinny_linear_gated(x, w, "relu"), "activation"),
        (lambda: skinny_linear_gated(x, torch.randn(5, 8, device=device), "silu"), "even"),
        (lambda: skinny_linear_gated(x, w, "silu", bias=torch.randn(3, device=device)), "bias"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    assert skinny_gemm_supported(x, w) and not skinny_gemm_supported(x, w.t())
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not skinny_gemm_supported(x, w)
        with pytest.raises(ValueError, match="needs CUDA"):
            skinny_linear(x, w)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 64)])
def test_linear_forward_gated_cpu(shape, activation, bias, gen):
    """CPU path of `Linear`: its GEMM (oneDNN-packed for 2+ rows, `cpu_gemm.linear`; within
    float32 rounding of F.linear, whose MKL kernel may round differently on another CPU) and
    the PyTorch gate formula (no Triton)."""
    lin = Linear(64, 2 * 24, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen) / 8)
        if bias:
            lin.bias.copy_(torch.randn(48, generator=gen))
    x = torch.randn(*shape, generator=gen)
    y = cpu_gemm.linear(x, lin.weight, lin.bias, lin.cpu_packed)
    # two float32 kernels (oneDNN, MKL) sum the 64 products (and the bias) in their own
    # orders: within Higham's bound 2 gamma_65 (|x| @ |W|.T + |b|) of each other, element-wise
    flat = x.reshape(-1, 64)
    bound = dot_product_bound(flat, lin.weight, lin.bias).reshape(y.shape)
    assert_within(y, F.linear(x, lin.weight, lin.bias), bound, "cpu_gemm.linear vs F.linear")
    g, u = y[..., :24], y[..., 24:]
    ref = F.silu(g) * u if activation == "silu" else F.gelu(g, approximate="tanh") * u
    torch.testing.assert_close(lin.forward_gated(x, activation), ref, rtol=0, atol=0)
    torch.testing.assert_close(lin(x), y, rtol=0, atol=0)
    assert not lin._skinny(x.reshape(-1, 64))  # CPU tensors never take the Triton path


def test_linear_forward_gated_errors():
    with pytest.raises(ValueError, match="activation"):
        Linear(8, 6).forward_gated(torch.randn(1, 8), "gelu")
    with pytest.raises(ValueError, match="even"):
        Linear(8, 5).forward_gated(torch.randn(1, 8), "silu")


# ---- the deferred reduction, the carried loop and PDL launches (rule v2, issue 33) ----------
#: K not a multiple of block_k: 72 = 2 x 32 + 8 and 160 = 2 x 64 + 32 leave a partial last
#: step; with carry the prefetch past K is fully masked; N = 40 / 96 leave a partial row block
#: at block_n 16 (40) and exercise the masked x rows of the deferred form.
NEW_CONFIGS = {
    "defer": SkinnyGemmConfig(block_n=16, block_k=32, use_dot=False, defer=True),
    "defer_carry": SkinnyGemmConfig(block_n=8, block_k=64, use_dot=False, defer=True, carry=True),
    "carry_bcast": SkinnyGemmConfig(block_n=16, block_k=32, use_dot=False, carry=True),
    "carry_dot": SkinnyGemmConfig(block_n=16, block_k=64, use_dot=True, carry=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n,k", [(40, 72), (96, 160)])
@pytest.mark.parametrize(  # defer takes one row (more are rejected: test_defer_rejects_rows_and_dot)
    "cfg,m", [(c, m) for c in NEW_CONFIGS for m in (1, 3) if m == 1 or not NEW_CONFIGS[c].defer]
)
def test_skinny_linear_new_forms(m, cfg, n, k, bias, dtype, gen, device):
    config = NEW_CONFIGS[cfg]
    x, w, b = _inputs(gen, m, n, k, dtype, device, bias)
    _check(skinny_linear(x, w, b, config=config), _ref_linear(x, w, b), dtype, (m, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", ["defer", "defer_carry", "carry_bcast"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("i,k,bias", [(20, 72, False), (48, 160, True)])
def test_skinny_linear_gated_new_forms(i, k, bias, activation, cfg, dtype, gen, device):
    x, w, b = _inputs(gen, 1, 2 * i, k, dtype, device, bias)
    x = x * 2.0  # gates over a few units: both tails of the activation matter
    out = skinny_linear_gated(x, w, activation, bias=b, config=NEW_CONFIGS[cfg])
    _check(out, _ref_gated(x, w, b, activation), dtype, (1, i))


def test_defer_rejects_rows_and_dot(device):
    x = torch.randn(2, 8, device=device)
    w = torch.randn(6, 8, device=device)
    with pytest.raises(ValueError, match="one activation row"):
        skinny_linear(x, w, config=NEW_CONFIGS["defer"])
    with pytest.raises(ValueError, match="defer needs the broadcast form"):
        skinny_linear(x[:1], w, config=SkinnyGemmConfig(block_n=16, block_k=16, use_dot=True, defer=True))


def test_pdl_request_is_harmless_off_hopper(gen, device):
    """``pdl=True`` where PDL cannot run (the interpreter, a CPU) launches plainly; on a GPU
    it runs with PDL: same values either way."""
    x, w, b = _inputs(gen, 1, 40, 72, torch.float32, device, True)
    ref = _ref_linear(x, w, b)
    _check(skinny_linear(x, w, b, pdl=True), ref, torch.float32, (1, 40))
    _check(skinny_linear(x, w, b, pdl=False), ref, torch.float32, (1, 40))


def test_rule_v2_and_v1(monkeypatch):
    """v2 (default) changes only one 16-bit row with K > 1024, or K == 1024 with 2048 < N <= 4096
    (not gated); ATTNSERVE_SKINNY_RULE=v1 restores v1. The tensor-parallel shards measured
    on the H100 get their tiles (Llama-3-8B tp 4 qkv 1536 x 4096 and o 4096 x 1024)."""
    from attnserve.models.layers.skinny_gemm import _rule_v1

    shapes = [(6144, 4096, False), (4096, 14336, False), (28672, 4096, True), (960, 576, False), (3072, 576, True),
              (1536, 4096, False), (4096, 1024, False), (4096, 1024, True), (1024, 1024, False)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        itemsize = torch.empty((), dtype=dtype).element_size()
        for m in (1, 2, 16):
            for n, k, gated in shapes:
                monkeypatch.delenv("ATTNSERVE_SKINNY_RULE", raising=False)
                v2 = skinny_gemm_config(m, n, k, dtype, 132, gated=gated)
                monkeypatch.setenv("ATTNSERVE_SKINNY_RULE", "v1")
                v1 = skinny_gemm_config(m, n, k, dtype, 132, gated=gated)
                assert v1 == _rule_v1(m, n, k, itemsize, gated) and not v1.defer and not v1.carry
                if m == 1 and itemsize == 2 and (k > 1024 or (k == 1024 and not gated and 2048 < n <= 4096)):
                    assert v2.defer and not v2.use_dot
                else:
                    assert v2 == v1
    monkeypatch.delenv("ATTNSERVE_SKINNY_RULE", raising=False)
    qkv_tp4 = skinny_gemm_config(1, 1536, 4096, torch.bfloat16, 132)
    o_tp4 = skinny_gemm_config(1, 4096, 1024, torch.bfloat16, 132)
    assert (qkv_tp4.block_n, qkv_tp4.block_k, qkv_tp4.num_warps, qkv_tp4.carry) == (2, 2048, 8, False)
    assert (o_tp4.block_n, o_tp4.block_k, o_tp4.num_warps, o_tp4.carry) == (4, 512, 4, True)
