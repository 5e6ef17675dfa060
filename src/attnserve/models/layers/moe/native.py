"""The PyTorch mixture-of-experts path: a loop over the experts that received tokens.

It runs anywhere (the CPU path) and is the reference the Triton kernels are checked
against. Each expert is a SwiGLU MLP (Shazeer, arXiv:2002.05202):
``y_e(x) = (silu(x @ gate_e.T) * (x @ up_e.T)) @ down_e.T``, and a token's output is
``sum_j topk_weights[t, j] * y_{topk_ids[t, j]}(x_t)`` (the per-expert loop of HF's
``MixtralExperts.forward``).

OpenAI's gpt-oss experts (HF ``GptOssExperts``, transformers
``models/gpt_oss/modeling_gpt_oss.py``; model card arXiv:2508.10925) add per-expert
biases and a clamped SwiGLU, ``activation="swigluoai"`` (SGLang / vLLM's name):
``g = x W_g^T + b_g``, ``u = x W_u^T + b_u``, ``g = min(g, limit)``,
``u = clamp(u, -limit, limit)``, ``a = (u + 1) * g * sigmoid(alpha g)`` and
``y_e(x) = a W_d^T + b_d``, weighted by the routing weight like the rest of ``y_e``
(HF: ``(h @ W_d + b_d) * weight``); gpt-oss has ``alpha = swiglu_alpha = 1.702``,
``limit = swiglu_limit = 7.0``. `swiglu_oai` is that activation.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

#: expert activations (`check_activation`): ``silu`` (SwiGLU) and ``swigluoai`` (gpt-oss)
MOE_ACTIVATIONS = ("silu", "swigluoai")
#: gpt-oss's ``swiglu_alpha`` / ``swiglu_limit`` (HF ``GptOssConfig`` defaults)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def check_activation(activation: str, swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT) -> None:
    """Raise ValueError for an activation not in `MOE_ACTIVATIONS` (naming the valid
    ones), or for ``swigluoai`` with a non-finite ``swiglu_alpha`` or a ``swiglu_limit``
    that is not a finite number > 0."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}; valid: {', '.join(MOE_ACTIVATIONS)}")
    if activation == "swigluoai":
        for what, v, low in (("swiglu_alpha", swiglu_alpha, None), ("swiglu_limit", swiglu_limit, 0.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                    low is not None and not v > low):
                raise ValueError(f"swigluoai: {what} must be a finite number{' > 0' if low is not None else ''}, "
                                 f"got {v!r}")


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_ALPHA,
               limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (HF ``GptOssExperts._apply_gate``), element-wise in the
    inputs' dtype: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)`` (the gate is clamped from above only)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def check_biases(w13: torch.Tensor, w2: torch.Tensor, w13_bias: Optional[torch.Tensor],
                 w2_bias: Optional[torch.Tensor]) -> Optional[str]:
    """Why the expert biases do not fit ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` (None when
    they do): ``w13_bias`` float ``[E, 2I]``, ``w2_bias`` float ``[E, H]``, on the weights'
    device; either may be None."""
    e, two_i, h = w13.shape
    for what, b, want in (("w13_bias", w13_bias, (e, two_i)), ("w2_bias", w2_bias, (e, h))):
        if b is not None and (tuple(b.shape) != want or not b.dtype.is_floating_point
                              or b.dtype == torch.float8_e4m3fn or b.device != w13.device):
            return f"{what} must be a float {list(want)} tensor on {w13.device}; got {b.dtype} {list(b.shape)} " \
                   f"on {b.device}"
    return None


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
                         block_shape: Optional[Tuple[int, int]] = None, w13_bias: Optional[torch.Tensor] = None,
                         w2_bias: Optional[torch.Tensor] = None, activation: str = "silu",
                         swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
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
        w13_bias: ``[E, 2I]`` (gate biases, then up biases; any float dtype) added to
            ``x @ w13[e].T`` in float32, or None (gpt-oss ``gate_up_proj_bias``).
        w2_bias: ``[E, H]`` added to the expert's down projection before the routing
            weight multiplies it, or None (gpt-oss ``down_proj_bias``).
        activation: ``"silu"`` (``silu(g) * u``) or ``"swigluoai"`` (`swiglu_oai` with
            ``swiglu_alpha`` / ``swiglu_limit``; see the module doc).

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype. Every product and the sum over the top-k
        slots are taken in float32, then cast once.

    Reads the per-expert token counts on the host once (not CUDA-graph capturable; the
    Triton path is).

    Raises:
        ValueError: inconsistent shapes (biases included), an unknown activation, or an
            expert id outside ``[0, E)``.
    """
    _check_shapes(hidden_states, w13, w2, topk_weights, topk_ids)
    check_activation(activation, swiglu_alpha, swiglu_limit)
    why = check_biases(w13, w2, w13_bias, w2_bias)
    if why is not None:
        raise ValueError(f"fused_experts_native: {why}")
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
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].float()
        if activation == "silu":
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        else:
            act = swiglu_oai(gate_up[:, :inter], gate_up[:, inter:], swiglu_alpha, swiglu_limit)
        y = act @ w2e.t()  # [n, H]
        if w2_bias is not None:
            y = y + w2_bias[expert].float()
        out.index_add_(0, tokens, y * flat_w[slots].unsqueeze(1))
    return out.to(hidden_states.dtype)
