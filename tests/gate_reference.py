"""The gate activations of the fused ``gate_up`` GEMMs in float64, as the tests' reference
(SiLU ``g * sigmoid(g)``; GELU with the tanh approximation of Hendrycks & Gimpel,
"Gaussian Error Linear Units", 2016: ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``)."""

import math

import torch


def gate_act_ref(g: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(g)`` for ``activation`` ``"silu"`` or ``"gelu_tanh"`` (any other name: GELU-tanh,
    as the kernels' tests have always treated it)."""
    if activation == "silu":
        return g / (1.0 + torch.exp(-g))
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
