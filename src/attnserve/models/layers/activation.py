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
