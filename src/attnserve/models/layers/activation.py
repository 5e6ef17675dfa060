"""Gated activations of feed-forward blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.models.layers.fused_kernels import FusedKernelUser, gelu_tanh_and_mul, silu_and_mul


def act_and_mul(x: torch.Tensor, activation: str, use_fused: bool) -> torch.Tensor:
    """``act(gate) * up`` of ``x`` ``[..., 2 * d]`` = ``[gate | up]`` -> ``[..., d]``, same dtype.

    activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU, GELU's tanh form) or ``"gelu"``
    (erf GELU). ``use_fused`` and a CUDA tensor: one Triton launch (`fused_kernels`; not for
    erf GELU); otherwise the PyTorch formula, the reference.
    """
    if use_fused and x.is_cuda and activation != "gelu":
        return silu_and_mul(x) if activation == "silu" else gelu_tanh_and_mul(x)
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


class SiluAndMul(nn.Module, FusedKernelUser):
    """SwiGLU gate (Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202).

    Shapes:
        ``x`` ``[..., 2 * d]`` holding ``[gate | up]`` (the layout of a fused
        ``gate_up_proj``) -> ``silu(gate) * up`` ``[..., d]``, same dtype.

    On CUDA tensors one Triton launch (`fused_kernels.silu_and_mul`, float32 math) while
    ``use_fused`` is on (`FusedKernelUser`).
    """

    def __init__(self):
        super().__init__()
        self.init_fused(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_mul(x, "silu", self.use_fused)


class GeluAndMul(nn.Module, FusedKernelUser):
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
        self.init_fused(approximate == "tanh")  # fused kernel (CUDA tensors) for the tanh form only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_mul(x, "gelu_tanh" if self.approximate == "tanh" else "gelu", self.use_fused)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
