"""Dense layers whose parameters are allocated but not initialised.

The weights always come from a checkpoint (or `init_dummy_weights`), so the random
initialisation ``nn.Linear`` / ``nn.Embedding`` run in their constructors is skipped: it
costs seconds on CPU for a 135M model and minutes for 8B shapes. Parameter names
(``weight``, ``bias``) match ``torch.nn`` so HF checkpoint names map one to one.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; ``weight`` ``[out_features, in_features]`` (uninitialised).

    Shapes: ``x`` ``[..., in_features]`` -> ``[..., out_features]``, parameter dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """Token embedding table ``weight`` ``[num_embeddings, embedding_dim]`` (uninitialised).

    Shapes: int64 ``ids`` ``[...]`` -> ``[..., embedding_dim]``, parameter dtype.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
