"""The LM head writes float32 logits straight from the GEMM (`models.base._mm_float32_out`).

Reference: the float64 product of the same bf16 inputs. The float32 output carries only
float32 accumulation error (K = 4096 terms: relative ~1e-6 of the row's magnitude), so it
must sit well inside the bf16 rounding of the old path (2**-9 relative, ~2e-3): the bound
2e-4 x max |ref| fails if the result was rounded through bf16 anyway. Also checked inside a
CUDA graph (decode steps are captured).
"""

from __future__ import annotations

import pytest
import torch

from attnserve.models.base import _mm_float32_out

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("rows", [17, 144])
def test_float32_logits_from_the_gemm(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(32000, 4096, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    out = _mm_float32_out(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, 32000)
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-4, err
    graph = torch.cuda.CUDAGraph()
    static = torch.empty_like(out)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static.copy_(_mm_float32_out(x, w))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)


def test_logits_written_into_a_shared_graph_buffer():
    """``out=`` rows of a larger float32 buffer (`SharedGraphOutput.target`): the GEMM writes
    them in place, inside a graph too, with the same bits as a fresh output; the rows after
    them are untouched; an ``out`` of another shape is ignored (a fresh tensor comes back)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(48, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(32000, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    want = _mm_float32_out(x, w)
    buf = torch.full((64, 32000), -7.0, device="cuda")
    got = _mm_float32_out(x, w, buf[:48])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
    assert buf[48:].eq(-7.0).all()
    buf.fill_(-7.0)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        _mm_float32_out(x, w, buf[:48])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf[:48], want) and buf[48:].eq(-7.0).all()
    other = _mm_float32_out(x, w, buf[:47])
    assert other.data_ptr() != buf.data_ptr() and torch.equal(other, want)
