"""FP8 routed experts for the tests: quantise float expert weights as the loader does, and
their dequantised float64 reference with `moe_checks.moe_reference`'s bound (shared by
tests/kernels/test_fused_moe_fp8.py and tests/gpu/test_fused_moe_fp8_gpu.py).

The fused kernel widens each e4m3 weight exactly to the activation dtype and applies the
float32 scale to a float32 partial sum (per channel: once per output; per block: once per
K step), so against the *dequantised* weights its error is `moe_reference`'s bound plus a
few float32 roundings per product (``u |x| |W|``-sized, far inside the bound's ``gamma_K``
terms); the FP8 rounding itself is in the reference's weights, not in the error.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from attnserve.models.layers.quantization.fp8_moe import dequantize_expert
from attnserve.models.layers.quantization.fp8_utils import FP8_DTYPE, quantize_per_block, quantize_per_row
from moe_checks import moe_reference


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, block: Optional[Tuple[int, int]]):
    """``(q13, s13, q2, s2)``: e4m3 ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` with per-row
    scales (``block`` None) or 128 x 128 block scales (gate and up halves blocked apart),
    in the layouts `fused_experts_triton` takes."""
    e, two_i, _ = w13.shape
    inter = two_i // 2
    q13, q2 = torch.empty_like(w13, dtype=FP8_DTYPE), torch.empty_like(w2, dtype=FP8_DTYPE)
    s13, s2 = [], []
    for x in range(e):
        if block is None:
            q13[x], s = quantize_per_row(w13[x])
            s13.append(s)
            q2[x], s = quantize_per_row(w2[x])
            s2.append(s)
        else:
            (qg, sg), (qu, su) = quantize_per_block(w13[x, :inter], block), quantize_per_block(w13[x, inter:], block)
            q13[x] = torch.cat([qg, qu])
            s13.append(torch.cat([sg, su]))
            q2[x], s = quantize_per_block(w2[x], block)
            s2.append(s)
    return q13, torch.stack(s13).contiguous(), q2, torch.stack(s2).contiguous()


def fp8_moe_reference(x, q13, s13, q2, s2, block, topk_weights, topk_ids):
    """``(out, bound)`` of `moe_reference` on the dequantised (float64) experts, on ``x``'s
    device (all tensors must be there)."""
    e = q13.shape[0]
    d13 = torch.stack([dequantize_expert(q13, s13, i, block, gated=True).double() for i in range(e)])
    d2 = torch.stack([dequantize_expert(q2, s2, i, block).double() for i in range(e)])
    return moe_reference(x, d13, d2, topk_weights, topk_ids)
