"""Gated activations of feed-forward blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202).

    Shapes:
        ``x`` ``[..., 2 * d]`` holding ``[gate | up]`` (the layout of a fused
        ``gate_up_proj``) -> ``silu(gate) * up`` ``[..., d]``, same dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """GeGLU gate (Shazeer, arXiv:2002.05202), as in Gemma's feed-forward blocks.

    Args:
        approximate: ``"tanh"`` (Gemma: HF's ``gelu_pytorch_tanh``,
            ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``) or ``"none"`` (erf GELU).

    Shapes:
        ``x`` ``[..., 2 * d]`` holding ``[gate | up]`` (a fused ``gate_up_proj``) ->
        ``gelu(gate) * up`` ``[..., d]``, same dtype.
    """

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
