"""Skinny GEMM kernels on a GPU at real model shapes (bfloat16), against float32 matmul.

Shapes ``(N, K)``: SmolLM2-135M qkv (960, 576), o (576, 576), gate_up (3072, 576), down
(576, 1536); Llama-3-8B qkv (6144, 4096), o (4096, 4096), gate_up (28672, 4096), down
(4096, 14336); M in {1, 2, 8, 16} (both inner-product forms are reached by the default
config: broadcast for M <= 4, tl.dot above). Reference: ``x.float() @ w.float().T`` on the
same bf16 inputs. Error measure: max |out - ref| / max |ref| per case; bfloat16 output
rounding alone contributes up to 2**-9 of each element, float32 accumulation order
~1e-6, so the bound 8e-3 leaves margin without hiding a wrong row or a dropped K chunk
(those give errors of order 1). Also: the forced non-default inner product, the gated
variant (both activations), `Linear` dispatch, float16/float32, and a CUDA-graph
capture / replay of both launchers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnserve.models.layers.linear import Linear
from attnserve.models.layers.skinny_gemm import (
    MAX_SKINNY_M,
    SkinnyGemmConfig,
    skinny_gemm_config,
    skinny_linear,
    skinny_linear_gated,
)

pytestmark = pytest.mark.cuda
DEV = "cuda"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
          (1536, 4096), (4096, 1024)]  # the last two: Llama-3-8B qkv and o shards at tp 4
MS = [1, 2, 8, 16]
REL = 8e-3


def _inputs(m, n, k, dtype=torch.bfloat16, seed=0, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, device=DEV, generator=g).to(dtype) if bias else None
    return x, w, b


def _ref(x, w, b=None):
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


def _rel(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _gate(y, activation):
    i = y.shape[-1] // 2
    g, u = y[..., :i], y[..., i:]
    return (F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")) * u


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_skinny_linear_model_shapes(m, n, k):
    x, w, _ = _inputs(m, n, k, seed=m * 7 + n + k)
    out = skinny_linear(x, w)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert _rel(out, _ref(x, w)) <= REL


@pytest.mark.parametrize("n,k", [(960, 576), (4096, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", MS)
def test_skinny_linear_other_inner_product(m, n, k):
    """The inner product the default does not pick for this M, with bias."""
    x, w, b = _inputs(m, n, k, seed=m + n, bias=True)
    default = skinny_gemm_config(m, n, k, x.dtype, torch.cuda.get_device_properties(0).multi_processor_count)
    if default.use_dot:  # broadcast with 16 rows: keep 16 * block_n * block_k within the register budget
        cfg = SkinnyGemmConfig(block_n=4, block_k=128, use_dot=False)
    else:
        cfg = SkinnyGemmConfig(block_n=32, block_k=256, num_stages=3, use_dot=True)
    assert _rel(skinny_linear(x, w, b, config=cfg), _ref(x, w, b)) <= REL


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("n,k", [(3072, 576), (4096, 640), (28672, 4096)])
@pytest.mark.parametrize("m", MS)
def test_skinny_linear_gated_model_shapes(m, n, k, activation):
    x, w, _ = _inputs(m, n, k, seed=m + 3 * n)
    out = skinny_linear_gated(x, w, activation)
    assert out.shape == (m, n // 2) and out.dtype == torch.bfloat16
    assert _rel(out, _gate(_ref(x, w), activation)) <= REL


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_linear_other_dtypes(m, dtype):
    x, w, b = _inputs(m, 576, 1536, dtype=dtype, seed=m, bias=True)
    rel = 2e-3 if dtype == torch.float16 else 1e-5
    assert _rel(skinny_linear(x, w, b), _ref(x, w, b)) <= rel
    assert _rel(skinny_linear_gated(x, w, "silu", bias=b), _gate(_ref(x, w, b), "silu")) <= rel


def test_linear_dispatch():
    lin = Linear(576, 2 * 1536, bias=True, dtype=torch.bfloat16).to(DEV)
    x, w, b = _inputs(MAX_SKINNY_M + 1, 2 * 1536, 576, seed=5, bias=True)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    assert lin.use_fused
    assert lin._skinny(x[:MAX_SKINNY_M]) and not lin._skinny(x) and not lin._skinny(x[None, :4])
    for rows in (x[:1], x[:MAX_SKINNY_M], x, x[None, :4]):  # skinny, skinny, cuBLAS, cuBLAS (3-D)
        ref = _ref(rows, w, b)
        assert _rel(lin(rows), ref) <= REL
        assert _rel(lin.forward_gated(rows, "silu"), _gate(ref, "silu")) <= 2 * REL
        assert _rel(lin.forward_gated(rows, "gelu_tanh"), _gate(ref, "gelu_tanh")) <= 2 * REL


@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph_capture_replay(m):
    x, w, b = _inputs(m, 4096, 4096, seed=11, bias=True)
    _, wg, _ = _inputs(m, 2 * 1536, 4096, seed=12)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            skinny_linear(static_x, w, b)
            skinny_linear_gated(static_x, wg, "silu")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = skinny_linear(static_x, w, b)
        z = skinny_linear_gated(static_x, wg, "silu")
    for seed in (21, 22):  # new inputs copied into the captured buffer
        new_x, _, _ = _inputs(m, 4096, 4096, seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, skinny_linear(new_x, w, b), rtol=0, atol=0)
        torch.testing.assert_close(z, skinny_linear_gated(new_x, wg, "silu"), rtol=0, atol=0)
        assert _rel(y, _ref(new_x, w, b)) <= REL


#: M = 1 forms of rule v2 / the candidate sweep (benchmarks/gemv.py --candidates), on model
#: shapes and on a ragged one (K = 4104 = 8 x 512 + 8: a partial last step at every block_k)
NEW_FORMS = {
    "defer": SkinnyGemmConfig(block_n=4, block_k=512, num_warps=4, num_stages=1, defer=True),
    "defer_carry": SkinnyGemmConfig(block_n=4, block_k=1024, num_warps=8, num_stages=1, defer=True, carry=True),
    "defer_wide": SkinnyGemmConfig(block_n=2, block_k=2048, num_warps=8, num_stages=1, defer=True),
    "carry": SkinnyGemmConfig(block_n=4, block_k=512, num_warps=4, num_stages=1, carry=True),
}


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("form", list(NEW_FORMS))
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 4104)])
def test_skinny_linear_new_forms_gpu(n, k, form, pdl):
    x, w, b = _inputs(1, n, k, seed=n + k, bias=n == 1000)
    out = skinny_linear(x, w, b, config=NEW_FORMS[form], pdl=pdl)
    assert out.shape == (1, n)
    assert _rel(out, _ref(x, w, b)) <= REL


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("form", ["defer", "defer_carry", "carry"])
@pytest.mark.parametrize("n,k", [(28672, 4096), (2000, 4104)])
def test_skinny_linear_gated_new_forms_gpu(n, k, form, pdl):
    x, w, _ = _inputs(1, n, k, seed=n + 2 * k)
    out = skinny_linear_gated(x, w, "silu", config=NEW_FORMS[form], pdl=pdl)
    assert _rel(out, _gate(_ref(x, w), "silu")) <= REL


def test_lm_head_shape_default_config():
    """The vocabulary-projection class of rule v2 (128256 x 4096, one row)."""
    x, w, _ = _inputs(1, 128256, 4096, seed=9)
    assert _rel(skinny_linear(x, w), _ref(x, w)) <= REL


@pytest.mark.parametrize("rule,rows,skinny", [("v2", 1, True), ("v2", 16, True), ("v2", 17, False),
                                              ("v1", 1, False)])
def test_compute_logits_routing(monkeypatch, rule, rows, skinny):
    """`CausalLM.compute_logits` (Llama's): skinny GEMM for <= 16 rows under rule v2, cuBLAS
    otherwise; float32 logits equal to the float32 product up to bf16 rounding."""
    import attnserve.models.base as base
    from attnserve.model_loader.loader import load_model

    monkeypatch.setenv("ATTNSERVE_SKINNY_RULE", rule)
    calls = []
    real = base.skinny_linear
    monkeypatch.setattr(base, "skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = load_model("llama-tiny", load_format="dummy", dtype=torch.bfloat16, device=DEV,
                       load_tokenizer=False).model
    g = torch.Generator(device=DEV).manual_seed(rows)
    h = torch.randn(rows, model.config.hidden_size, device=DEV, generator=g).to(torch.bfloat16)
    logits = model.compute_logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (rows, model.config.vocab_size)
    assert bool(calls) == skinny
    assert _rel(logits, _ref(h, model.lm_head_weight)) <= REL


@pytest.mark.parametrize("form", ["default", "defer", "carry"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("n,k", [(1536, 4096), (4096, 1024), (7168, 4096), (1000, 4104)])
def test_l2_prefetch_hint_changes_no_bit(monkeypatch, n, k, gated, form):
    """The L2 hint before the PDL wait (`attnserve.models.layers.l2_prefetch`) at budgets that
    cover a few lines, most of a row and whole rows gives the bits of the launch without it
    (same kernel otherwise); shapes: Llama-3-8B tp-4 shards (qkv, o, gate_up) and a ragged K."""
    from attnserve.models.layers.l2_prefetch import l2_prefetch_lines

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL (and so the hint) needs sm_90+")
    x, w, _ = _inputs(1, n, k, seed=n + 3 * k)
    cfg = None if form == "default" else NEW_FORMS[form]

    def run():
        if gated:
            return skinny_linear_gated(x, w, "silu", config=cfg, pdl=True)
        return skinny_linear(x, w, config=cfg, pdl=True)

    monkeypatch.setenv("ATTNSERVE_GEMV_L2_PREFETCH_MB", "0")
    want = run()
    lines = []
    for mb in ("0.25", "4", "64"):
        monkeypatch.setenv("ATTNSERVE_GEMV_L2_PREFETCH_MB", mb)
        lines.append(l2_prefetch_lines(n, k, 2, 512))
        assert torch.equal(run(), want), f"budget {mb} MiB changed the output"
    assert lines[-1] > 0  # the largest budget does hint
