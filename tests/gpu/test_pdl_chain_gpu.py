"""Programmatic dependent launch (`attnserve.pdl`) on a GPU: a chain of the
kernels that opt in, each reading the previous one's output, captured in a CUDA graph.

Two Llama-3-8B-shaped decoder layers at batch 1 without attention (fused add + RMSNorm ->
qkv GEMV -> in-place RoPE on q/k -> o GEMV on the rotated q -> fused add + RMSNorm ->
gate_up GEMV + SiLU -> down GEMV), then the final norm. With PDL a kernel starts before its
predecessor ends; a kernel that read an activation before its ``gdc_wait`` would see the
previous replay's values. Every replay gets fresh inputs, so such a race shows as an O(1)
error; the bound (1e-3 of the largest |value|) is bf16 rounding slack, since both sides
run the same kernels on the same inputs (they differ only in launch attributes and the
wait / trigger instructions).
"""

from __future__ import annotations

import math

import pytest
import torch

from attnserve.models.layers import fused_kernels as fk
from attnserve.pdl import pdl_enabled
from attnserve.models.layers.skinny_gemm import skinny_linear, skinny_linear_gated

pytestmark = pytest.mark.cuda
DEV = "cuda"
H, I, HD, HQ, HKV = 4096, 14336, 128, 32, 8


def _w(g, n, k):
    return (torch.randn(n, k, device=DEV, generator=g) / math.sqrt(k)).to(torch.bfloat16)


def _layer_weights(g):
    return {
        "qkv": _w(g, (HQ + 2 * HKV) * HD, H), "o": _w(g, H, HQ * HD), "gate_up": _w(g, 2 * I, H),
        "down": _w(g, H, I), "n1": (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).to(torch.bfloat16),
        "n2": (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).to(torch.bfloat16),
    }


def _chain(h, res, pos, layers, cos_sin, final_w):
    for lw in layers:
        x = fk.fused_add_rmsnorm(h, res, lw["n1"], 1e-5)
        qkv = skinny_linear(x, lw["qkv"])
        q, k = qkv[:, : HQ * HD], qkv[:, HQ * HD : (HQ + HKV) * HD]
        fk.rotary_embedding_inplace(pos, q, k, cos_sin, HD, HD, True)
        h = skinny_linear(q, lw["o"])
        x = fk.fused_add_rmsnorm(h, res, lw["n2"], 1e-5)
        h = skinny_linear(skinny_linear_gated(x, lw["gate_up"], "silu"), lw["down"])
    return fk.fused_add_rmsnorm(h, res, final_w, 1e-5)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("prefetch_mb", ["0", "16", "64"])
@pytest.mark.parametrize("rule", ["v1", "v2"])
def test_pdl_chain_graph_matches_plain_eager(monkeypatch, rule, prefetch_mb):
    """``prefetch_mb``: the GEMVs' L2 hint budget (`attnserve.models.layers.l2_prefetch`) at
    capture; the plain eager reference runs without PDL, so without hints."""
    monkeypatch.setenv("ATTNSERVE_SKINNY_RULE", rule)
    monkeypatch.setenv("ATTNSERVE_GEMV_L2_PREFETCH_MB", prefetch_mb)
    g = torch.Generator(device=DEV).manual_seed(3)
    layers = [_layer_weights(g) for _ in range(2)]
    final_w = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device=DEV, dtype=torch.float32) / HD))
    ang = torch.arange(4096, device=DEV, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)

    def fresh(seed):
        gi = torch.Generator(device=DEV).manual_seed(seed)
        h = torch.randn(1, H, device=DEV, generator=gi).to(torch.bfloat16)
        res = torch.randn(1, H, device=DEV, generator=gi).to(torch.bfloat16)
        pos = torch.randint(0, 4096, (1,), device=DEV, generator=gi)
        return h, res, pos

    monkeypatch.setenv("ATTNSERVE_PDL", "1")
    assert pdl_enabled(torch.device(DEV)) == (torch.cuda.get_device_capability()[0] >= 9)
    h_s, res_s, pos_s = fresh(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            _chain(h_s.clone(), res_s.clone(), pos_s, layers, cos_sin, final_w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = _chain(h_s, res_s, pos_s, layers, cos_sin, final_w)
    for seed in (11, 12, 13, 14):
        h, res, pos = fresh(seed)
        monkeypatch.setenv("ATTNSERVE_PDL", "0")
        ref = _chain(h.clone(), res.clone(), pos, layers, cos_sin, final_w)
        h_s.copy_(h)
        res_s.copy_(res)  # updated in place by the chain
        pos_s.copy_(pos)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all()
        assert _rel(out, ref) <= 1e-3, f"replay {seed}: PDL graph differs from the plain eager chain"
