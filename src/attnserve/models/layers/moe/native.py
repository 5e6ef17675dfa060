"""The PyTorch mixture-of-experts path: a loop over the experts that received tokens.

It runs anywhere (the CPU path) and is the reference the Triton kernels are checked
against. Each expert is a SwiGLU MLP (Shazeer, arXiv:2002.05202):
``y_e(x) = (silu(x @ gate_e.T) * (x @ up_e.T)) @ down_e.T``, and a token's output is
``sum_j topk_weights[t, j] * y_{topk_ids[t, j]}(x_t)`` (the per-expert loop of HF's
``MixtralExperts.forward``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def _check_shapes(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    if hidden_states.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected hidden_states [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(hidden_states.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, h = hidden_states.shape
    e, two_i, h13 = w13.shape
    if two_i % 2 or h13 != h or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"expected w13 [E, 2I, H={h}] and w2 [E, H, I]; got {tuple(w13.shape)}, {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"expected topk_weights and topk_ids [T={t}, top_k]; got {tuple(topk_weights.shape)}, "
                         f"{tuple(topk_ids.shape)}")


def fused_experts_native(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                         w2_scale: Optional[torch.Tensor] = None,
                         block_shape: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Routed-expert output of every token, expert by expert.

    Args:
        hidden_states: ``[T, H]``, any float dtype.
        w13: ``[E, 2*I, H]``: rows ``[0, I)`` gate (HF ``gate_proj``/``w1``), ``[I, 2I)`` up
            (``up_proj``/``w3``).
        w2: ``[E, H, I]`` (HF ``down_proj``/``w2``).
        topk_weights: ``[T, top_k]`` routing weights (float32 from `routing.select_experts`).
        topk_ids: ``[T, top_k]`` integer expert ids in ``[0, E)`` (int32).
        w13_scale, w2_scale, block_shape: FP8 experts (float8_e4m3fn ``w13`` / ``w2``; the
            layouts of `fused_moe_triton.fused_experts_triton`): each expert that runs is
            dequantised to float32 (`fp8_moe.dequantize_expert`); the activations are not
            quantised (W8A16).

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype. Every product and the sum over the top-k
        slots are taken in float32, then cast once.

    Reads the per-expert token counts on the host once (not CUDA-graph capturable; the
    Triton path is).

    Raises:
        ValueError: inconsistent shapes, or an expert id outside ``[0, E)``.
    """
    _check_shapes(hidden_states, w13, w2, topk_weights, topk_ids)
    if (w13.dtype == torch.float8_e4m3fn or w2.dtype == torch.float8_e4m3fn) and (w13_scale is None or w2_scale is None):
        raise ValueError("FP8 expert weights need w13_scale and w2_scale")
    if w13_scale is not None:
        from attnserve.models.layers.quantization.fp8_moe import dequantize_expert
    t, h = hidden_states.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden_states.device)
    flat_ids = topk_ids.reshape(-1).long()
    if flat_ids.numel() == 0:
        return out.to(hidden_states.dtype)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(t, device=hidden_states.device).repeat_interleave(topk_ids.shape[1])
    bad = ((flat_ids < 0) | (flat_ids >= e)).sum().view(1)
    stats = torch.cat([torch.bincount(flat_ids.clamp(0, e - 1), minlength=e), bad]).tolist()  # the one host sync
    counts, n_bad = stats[:e], stats[e]
    if n_bad:
        raise ValueError(f"topk_ids must be in [0, {e}); {n_bad} of them are not")
    order = torch.argsort(flat_ids, stable=True)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        tokens = token_of[slots]
        x = hidden_states[tokens].float()
        if w13_scale is None:
            w13e, w2e = w13[expert].float(), w2[expert].float()
        else:
            w13e = dequantize_expert(w13, w13_scale, expert, block_shape, gated=True)
            w2e = dequantize_expert(w2, w2_scale, expert, block_shape)
        gate_up = x @ w13e.t()  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2e.t()  # [n, H]
        out.index_add_(0, tokens, y * flat_w[slots].unsqueeze(1))
    return out.to(hidden_states.dtype)
