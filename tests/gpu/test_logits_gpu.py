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
