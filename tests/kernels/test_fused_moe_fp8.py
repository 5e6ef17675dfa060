"""FP8 experts in the fused MoE Triton kernel (W8A16, issue 37) under the interpreter, against
the float64 product of the dequantised experts (`fp8_moe_checks`): per-channel and 128 x 128
block scales, K not a multiple of the tile or of the scale block (H 200, I 72), ragged
routing with top-k 2 and an expert that gets no token, and the one-token slot-block path.
Three interpreter cases only (CI time)."""

from __future__ import annotations

import pytest
import torch

from attnserve.models.layers.moe.fused_moe_triton import fused_experts_triton
from fp8_moe_checks import fp8_moe_reference, quantize_experts

#: BLOCK_SIZE_K 32: four K steps share one scale block; BLOCK_SIZE_N 64 > I: tiles wrap rows
_SMALL_TILES = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1, "num_warps": 4,
                "num_stages": 1}
CASES = [  # (T, E, top_k, H, I, block, config)
    (7, 4, 2, 200, 72, None, None),
    (7, 4, 2, 200, 136, (128, 128), _SMALL_TILES),  # gate / up halves each two row blocks
    (1, 4, 2, 136, 40, (128, 128), None),  # one token: no alignment
]


@pytest.mark.parametrize("t, e, k, h, inter, block, config", CASES,
                         ids=[f"T{c[0]}-H{c[3]}-I{c[4]}-{'block' if c[5] else 'channel'}" for c in CASES])
def test_fp8_experts_match_dequantised_float64(t, e, k, h, inter, block, config, gen, device):
    x = torch.randn(t, h, generator=gen).bfloat16()
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * 0.1
    w2 = torch.randn(e, h, inter, generator=gen) * 0.1
    # expert 3 receives no token; the rest get different numbers of slots
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    tw = torch.rand(t, k, generator=gen)
    q13, s13, q2, s2 = quantize_experts(w13, w2, block)
    out = fused_experts_triton(x.to(device), q13.to(device), q2.to(device), tw.to(device), ids.to(device),
                               w13_scale=s13.to(device), w2_scale=s2.to(device), block_shape=block, config=config)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h) and torch.isfinite(out).all()
    ref, bound = fp8_moe_reference(x, q13, s13, q2, s2, block, tw, ids)
    diff = (out.cpu().double() - ref).abs()
    assert (diff <= bound).all(), f"worst ratio {(diff / bound).max():.3f}"
    # the scales matter: the product with unit scales is far outside the bound
    assert ((ref - fp8_moe_reference(x, q13, torch.ones_like(s13), q2, s2, block, tw, ids)[0]).abs() > bound).any()


def test_fp8_scale_shape_is_checked(device):
    x = torch.randn(2, 32).bfloat16().to(device)
    q13 = torch.zeros(2, 16, 32, dtype=torch.float8_e4m3fn, device=device)
    q2 = torch.zeros(2, 32, 8, dtype=torch.float8_e4m3fn, device=device)
    ids, tw = torch.zeros(2, 1, dtype=torch.int32, device=device), torch.ones(2, 1, device=device)
    with pytest.raises(ValueError, match="w13_scale must be a contiguous float32"):
        fused_experts_triton(x, q13, q2, tw, ids, w13_scale=torch.ones(2, 15, device=device),
                             w2_scale=torch.ones(2, 32, device=device))
    with pytest.raises(ValueError, match="FP8 experts need"):
        fused_experts_triton(x, q13, q2, tw, ids)
