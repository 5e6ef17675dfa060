"""Merge two partial attention states by their log-sum-exp.

Attention over a key set split in two parts A and B (e.g. a shared prefix and a per-request
suffix, as in cascade / split-K attention, Flash-Decoding 2023 and FlashInfer's
``merge_state``) gives per part a normalised output ``v`` and ``s = log(sum(exp(scores)))``.
The attention over A u B is ``(e^{s_a} v_a + e^{s_b} v_b) / (e^{s_a} + e^{s_b})`` with
log-sum-exp ``log(e^{s_a} + e^{s_b})``, computed stably by subtracting ``max(s_a, s_b)``
(FlashAttention-2, arXiv:2307.08691, section 3.1).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_state_kernel(
    va_ptr, sa_ptr, vb_ptr, sb_ptr, vo_ptr, so_ptr,
    num_heads,
    stride_vat, stride_vah,
    stride_vbt, stride_vbh,
    stride_vot, stride_voh,
    stride_sat, stride_sbt, stride_sot,
    stride_sah, stride_sbh, stride_soh,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < num_heads
    mask = mask_h[:, None] & (offs_d < D)[None, :]

    s_a = tl.load(sa_ptr + t * stride_sat + offs_h * stride_sah, mask=mask_h, other=float("-inf")).to(tl.float32)
    s_b = tl.load(sb_ptr + t * stride_sbt + offs_h * stride_sbh, mask=mask_h, other=float("-inf")).to(tl.float32)
    s_max = tl.maximum(s_a, s_b)
    # Both parts empty: s_max = -inf; shift by 0 instead so that the weights are 0, not NaN.
    shift = tl.where(s_max == float("-inf"), 0.0, s_max)
    w_a = tl.exp(s_a - shift)
    w_b = tl.exp(s_b - shift)
    denom = w_a + w_b
    inv = tl.where(denom > 0, 1.0 / tl.maximum(denom, 1e-30), 0.0)

    v_a = tl.load(va_ptr + t * stride_vat + offs_h[:, None] * stride_vah + offs_d[None, :], mask=mask, other=0.0)
    v_b = tl.load(vb_ptr + t * stride_vbt + offs_h[:, None] * stride_vbh + offs_d[None, :], mask=mask, other=0.0)
    # An empty part contributes exactly nothing, even when its v holds junk (NaN/inf).
    v = tl.where((w_a > 0)[:, None], v_a.to(tl.float32) * (w_a * inv)[:, None], 0.0)
    v += tl.where((w_b > 0)[:, None], v_b.to(tl.float32) * (w_b * inv)[:, None], 0.0)
    tl.store(vo_ptr + t * stride_vot + offs_h[:, None] * stride_voh + offs_d[None, :], v.to(vo_ptr.dtype.element_ty), mask=mask)
    s_out = tl.where(denom > 0, shift + tl.log(tl.maximum(denom, 1e-30)), float("-inf"))
    tl.store(so_ptr + t * stride_sot + offs_h * stride_soh, s_out, mask=mask_h)


def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    v_merged: Optional[torch.Tensor] = None,
    s_merged: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states ``(v_a, s_a)`` and ``(v_b, s_b)`` over disjoint key sets.

    Args:
        v_a, v_b: ``[T, H, D]`` fp16/bf16/fp32 partial outputs (each normalised by its own
            softmax sum; last dim contiguous).
        s_a, s_b: float32 ``[T, H]`` natural-log log-sum-exp of each part's scaled scores;
            ``-inf`` marks an empty part (its ``v`` is then ignored, even if it holds NaN).
        v_merged: optional ``[T, H, D]`` output (any float dtype; may alias ``v_a``).
        s_merged: optional float32 ``[T, H]`` output (may alias ``s_a``).

    Returns:
        ``(v_merged, s_merged)``. Where both parts are empty the output is 0 with
        log-sum-exp ``-inf`` (never NaN).

    Raises:
        ValueError: on shape, dtype or device mismatches.
    """
    if v_a.dim() != 3 or v_a.shape != v_b.shape:
        raise ValueError(f"v_a and v_b must be [T, H, D] of one shape, got {tuple(v_a.shape)} and {tuple(v_b.shape)}")
    t, h, d = v_a.shape
    if s_a.shape != (t, h) or s_b.shape != (t, h):
        raise ValueError(f"s_a and s_b must be [{t}, {h}], got {tuple(s_a.shape)} and {tuple(s_b.shape)}")
    if s_a.dtype != torch.float32 or s_b.dtype != torch.float32:
        raise ValueError(f"s_a and s_b must be float32, got {s_a.dtype} and {s_b.dtype}")
    if v_a.dtype not in (torch.float16, torch.bfloat16, torch.float32) or v_b.dtype != v_a.dtype:
        raise ValueError(f"v_a and v_b must share one of fp16/bf16/fp32, got {v_a.dtype} and {v_b.dtype}")
    if v_merged is None:
        v_merged = torch.empty_like(v_a)
    if s_merged is None:
        s_merged = torch.empty_like(s_a)
    if v_merged.shape != v_a.shape or s_merged.shape != (t, h) or s_merged.dtype != torch.float32:
        raise ValueError("v_merged must be [T, H, D] and s_merged float32 [T, H]")
    for name, x in (("v_a", v_a), ("v_b", v_b), ("v_merged", v_merged)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if len({x.device for x in (v_a, s_a, v_b, s_b, v_merged, s_merged)}) != 1:
        raise ValueError("all merge_state tensors must be on one device")
    if t == 0 or h == 0:
        return v_merged, s_merged
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(h), 4096 // block_d, 16))
    _merge_state_kernel[(t, triton.cdiv(h, block_h))](
        v_a, s_a, v_b, s_b, v_merged, s_merged,
        h,
        v_a.stride(0), v_a.stride(1),
        v_b.stride(0), v_b.stride(1),
        v_merged.stride(0), v_merged.stride(1),
        s_a.stride(0), s_b.stride(0), s_merged.stride(0),
        s_a.stride(1), s_b.stride(1), s_merged.stride(1),
        D=d,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return v_merged, s_merged
