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


def dequantized_activation(x: torch.Tensor, block) -> torch.Tensor:
    """``x`` as the W8A8 path quantises it (`fp8_w8a8.quantize_moe_activation`: per token, or
    per 1 x 128 group with block scales), dequantised to float64 on ``x``'s device."""
    from attnserve.models.layers.moe.fp8_w8a8 import quantize_moe_activation
    from attnserve.models.layers.quantization.fp8_utils import dequantize

    q, s = quantize_moe_activation(x, block)
    return dequantize(q, s, block=None if block is None else (1, block[1]), dtype=torch.float64)


def fp8_w8a8_moe_reference(x, q13, s13, q2, s2, block, topk_weights, topk_ids, acc_u: Optional[float] = None):
    """``(out, bound)`` for the W8A8 path: the float64 product of the dequantised experts
    and the quantised-then-dequantised input ``x``; the bound is `moe_reference`'s (storage
    dtype ``x.dtype``) with the intermediate's e4m3 quantisation error added to its error
    (``act_fp8``), so it holds whatever way the kernel's quantiser rounds its (slightly
    different) intermediate. ``acc_u``: `moe_reference`'s accumulation unit (None: float32's)."""
    e = q13.shape[0]
    d13 = torch.stack([dequantize_expert(q13, s13, i, block, gated=True).double() for i in range(e)])
    d2 = torch.stack([dequantize_expert(q2, s2, i, block).double() for i in range(e)])
    xd = dequantized_activation(x, block)
    return moe_reference(xd, d13, d2, topk_weights, topk_ids, storage_dtype=x.dtype,
                         act_fp8="token" if block is None else "group", group=128 if block is None else block[1],
                         **({} if acc_u is None else {"acc_u": acc_u}))


def fp8_w8a8_moe_simulated(x, q13, s13, q2, s2, block, topk_weights, topk_ids) -> torch.Tensor:
    """float64 ``[T, H]`` of the W8A8 path's steps in PyTorch: quantised input, dequantised
    experts, the intermediate rounded to ``x.dtype`` and quantised (`fp8_utils`, per token or
    per 1 x 128 group) -- what the kernel computes up to float32 roundings and the rare
    quantisation flip they cause."""
    from attnserve.models.layers.quantization.fp8_utils import dequantize, quantize_per_group, quantize_per_row

    xd = dequantized_activation(x, block)
    inter = q13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    ids = topk_ids.long()
    for ex in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == ex, as_tuple=True)
        w13e = dequantize_expert(q13, s13, ex, block, gated=True).double()
        w2e = dequantize_expert(q2, s2, ex, block).double()
        gu = xd[tok] @ w13e.T
        a = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(x.dtype)
        if block is None:
            q, s = quantize_per_row(a)
            ad = dequantize(q, s, dtype=torch.float64)
        else:
            q, s = quantize_per_group(a, block[1])
            ad = dequantize(q, s, block=(1, block[1]), dtype=torch.float64)
        out.index_add_(0, tok, topk_weights[tok, slot].double()[:, None] * (ad @ w2e.T))
    return out


def activation_quant_error(x: torch.Tensor, block) -> torch.Tensor:
    """float64 ``[T, H]`` bound on ``|dequantised e4m3 x - x|`` for the W8A8 path's quantiser
    (per token, or per 1 x 128 group): ``2**-4 |x| + 2**-10 s`` (`moe_checks._act_quant_error`)."""
    from moe_checks import _act_quant_error

    xd = x.double()
    return _act_quant_error(xd, torch.zeros_like(xd), None if block is None else block[1])
