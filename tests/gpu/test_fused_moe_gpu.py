"""Fused MoE Triton path on a GPU at real model shapes, against a float64 reference.

Shapes (E, H, I, top_k): Qwen3-30B-A3B (128, 2048, 768, 8), DeepSeek-V2-Lite routed experts
(64, 2048, 1408, 6), Mixtral-8x7B (8, 4096, 14336, 2). Token counts 1 (decode), 37 and
300 (ragged, several M-tile sizes of the default rule and of any tuned table for this
GPU); experts 0 and 3 receive no token. Reference and element-wise bound:
tests/moe_checks.py (float64 from the same rounded inputs). Also float16 / float32,
`moe_align_block_size`'s invariants on both of its forms (up to 8192 x 8 slots), and CUDA
graph capture / replay: the replayed graph, fed new routing and activations in its static
buffers, gives bit-for-bit the eager result (rows are computed independently of their
position in a tile, so the atomics' slot order within an expert does not matter).
"""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.moe.align import moe_align_block_size
from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton
from moe_checks import check_alignment, moe_reference

pytestmark = pytest.mark.cuda
DEV = "cuda"
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v2-lite": (64, 2048, 1408, 6),
          "mixtral-8x7b": (8, 4096, 14336, 2)}


def _case(shape, t, dtype=torch.bfloat16, seed=0, exclude=(0, 3), top_k=None):
    e, h, inter, k = SHAPES[shape] if isinstance(shape, str) else shape
    k = top_k or k
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, h, device=DEV, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, device=DEV, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device=DEV, generator=g) / inter**0.5).to(dtype)
    allowed = torch.tensor([i for i in range(e) if i not in exclude], device=DEV)
    scores = torch.rand(t, len(allowed), device=DEV, generator=g)
    ids = allowed[scores.topk(k, dim=-1).indices].to(torch.int32)
    w = torch.softmax(torch.randn(t, k, device=DEV, generator=g), dim=-1)
    return x, w13, w2, w, ids


def _check(out, x, w13, w2, w, ids):
    ref, bound = moe_reference(x, w13, w2, w, ids)
    diff = (out.double() - ref).abs()
    assert out.dtype == x.dtype and out.shape == x.shape and torch.isfinite(out).all()
    ratio = (diff / bound).max().item()
    assert ratio <= 1.0, f"max |delta| {diff.max().item():.3e}, {ratio:.3f} of the bound"


@pytest.mark.parametrize("t, k, e, bs", [(1, 8, 128, 16), (256, 8, 128, 32), (300, 6, 64, 64), (8192, 8, 128, 128),
                                         (4096, 2, 8, 64)])
def test_align_real_sizes(t, k, e, bs):
    g = torch.Generator(device=DEV).manual_seed(t)
    ids = torch.rand(t, e, device=DEV, generator=g).topk(k, dim=-1).indices.to(torch.int32)
    ids[ids == 3] = 4  # expert 3 receives nothing (a row may then name expert 4 twice: alignment does not care)
    out = moe_align_block_size(ids, bs, e)
    torch.cuda.synchronize()
    check_alignment(ids, bs, e, *out)


@pytest.mark.parametrize("shape, t", [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 4), ("deepseek-v2-lite", 64),
                                      ("mixtral-8x7b", 3)])
def test_cuda_graph_replay(shape, t):
    x, w13, w2, w, ids = _case(shape, t, seed=1)
    sx, sw, sids = x.clone(), w.clone(), ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_experts_triton(sx, w13, w2, sw, sids)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout = fused_experts_triton(sx, w13, w2, sw, sids)
    for seed in (2, 3):
        x2, _, _, w2_, ids2 = _case(shape, t, seed=seed, exclude=())
        sx.copy_(x2)
        sw.copy_(w2_)
        sids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_experts_triton(x2, w13, w2, w2_, ids2)
        assert torch.equal(sout, eager)
        _check(sout, x2, w13, w2, w2_, ids2)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [1, 37, 300])
def test_real_shapes_bf16(shape, t):
    x, w13, w2, w, ids = _case(shape, t, seed=t)
    out = fused_experts_triton(x, w13, w2, w, ids)
    _check(out, x, w13, w2, w, ids)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_dtypes(dtype):
    x, w13, w2, w, ids = _case("qwen3-30b-a3b", 37, dtype=dtype, seed=5)
    out = fused_experts_triton(x, w13, w2, w, ids)
    _check(out, x, w13, w2, w, ids)


def test_top_k_one():
    x, w13, w2, w, ids = _case("qwen3-30b-a3b", 37, seed=7, top_k=1)
    out = fused_experts_triton(x, w13, w2, w, ids)
    _check(out, x, w13, w2, w, ids)


def _tables_for_this_gpu():
    import json

    from attnserve.models.layers.moe.tuned_configs import package_config_dir

    if not torch.cuda.is_available():
        return []
    name = torch.cuda.get_device_name()
    out = []
    for f in sorted(package_config_dir().glob("*.json")):
        data = json.loads(f.read_text())
        if data["meta"]["device_name"] == name:
            out.append(data)
    return out


@pytest.mark.parametrize("t", [1, 32, 256])
def test_tuned_tables_of_this_gpu(t):
    """Every shipped table for this GPU: its entry nearest to ``t`` is correct on its shape."""
    tables = _tables_for_this_gpu()
    if not tables:
        pytest.skip(f"no tuned table for {torch.cuda.get_device_name()}")
    for data in tables:
        m = data["meta"]
        x, w13, w2, w, ids = _case((m["E"], m["K"], m["N"], m["top_k"]), t, seed=11)
        key = min(data["configs"], key=lambda k: abs(int(k) - t))
        out = fused_experts_triton(x, w13, w2, w, ids, config=data["configs"][key])
        _check(out, x, w13, w2, w, ids)


@pytest.mark.parametrize("rows", [1, 144, 3000])
def test_float32_router_logits_from_one_gemm(rows):
    """DeepSeek's router (`MoEGate` with ``float32_logits``) on CUDA: one bf16 GEMM with a float32
    output. Reference: float64 product of the same bf16 operands; the float32 result carries only
    float32 accumulation error over K = 2048 terms (relative ~1e-6), so 1e-5 x max |ref| fails if
    the product were rounded through bf16 (2**-9). Its top-k must match the cast form's."""
    from attnserve.models.layers.moe.sparse_block import MoEGate

    gate = MoEGate(64, 2048, torch.bfloat16, float32_logits=True).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(rows)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(64, 2048, device=DEV, generator=g) * 0.02)
    x = torch.randn(rows, 2048, device=DEV, generator=g).to(torch.bfloat16)
    out = gate.forward(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 64)
    ref = x.double() @ gate.weight.double().T
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, err
    cast = torch.nn.functional.linear(x.float(), gate.weight.float())
    assert (out.topk(6).indices.sort().values == cast.topk(6).indices.sort().values).float().mean() > 0.999
