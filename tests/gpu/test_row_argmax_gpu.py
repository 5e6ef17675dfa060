"""`row_argmax` on the GPU: ``torch.argmax``'s indices at real vocabulary widths (Llama-3,
Qwen3, SmolLM2), 1-256 rows, float32 and bfloat16, with planted ties and NaN, eagerly and
replayed from a CUDA graph; `sampler.argmax_last` routes CUDA rows through it. Prints the
time of both (CUDA-graph replays) for the notes."""

import pytest
import torch

from attnserve.engine.row_argmax import row_argmax
from attnserve.engine.sampler import argmax_last

pytestmark = pytest.mark.cuda


def _logits(n, v, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, v, device="cuda", generator=g).to(dtype)
    if n > 2:
        x[1, 17] = x[1, v - 1] = 1e4          # a tie across pieces
        x[2, v // 2] = float("nan")           # NaN wins over +inf
        x[2, 3] = float("inf")
    return x


@pytest.mark.parametrize("v", [128256, 151936, 49152])
@pytest.mark.parametrize("n", [1, 3, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_matches_torch(v, n, dtype):
    x = _logits(n, v, dtype, n + v)
    want = torch.argmax(x, dim=-1)
    assert torch.equal(row_argmax(x), want)
    assert torch.equal(argmax_last(x), want)


@pytest.mark.parametrize("n", [1, 64])
def test_row_argmax_cuda_graph_and_time(n):
    v = 128256
    x = _logits(n, v, torch.float32, 7)
    row_argmax(x)
    torch.cuda.synchronize()
    graphs = {}
    for name, fn in (("row_argmax", row_argmax), ("torch.argmax", lambda t: torch.argmax(t, dim=-1))):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(x)
        graphs[name] = (g, out)
    x.copy_(_logits(n, v, torch.float32, 8))
    times = {}
    for name, (g, out) in graphs.items():
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 200 * 1e3
    assert torch.equal(graphs["row_argmax"][1], graphs["torch.argmax"][1])
    print(f"ARGMAX n={n} V={v}: row_argmax {times['row_argmax']:.1f} us, torch.argmax {times['torch.argmax']:.1f} us "
          "(graph replays, launch included)")
