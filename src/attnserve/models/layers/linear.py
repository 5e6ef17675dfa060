"""Dense layers whose parameters are allocated but not initialised.

The weights always come from a checkpoint (or `init_dummy_weights`), so the random
initialisation ``nn.Linear`` / ``nn.Embedding`` run in their constructors is skipped: it
costs seconds on CPU for a 135M model and minutes for 8B shapes. Parameter names
(``weight``, ``bias``) match ``torch.nn`` so HF checkpoint names map one to one.

On CUDA, `Linear` runs decode-sized inputs (2-D, at most ``MAX_SKINNY_M`` rows) through the
skinny GEMM kernel (`attnserve.models.layers.skinny_gemm`) instead of cuBLAS, unless
``use_fused`` is off (`FusedKernelUser`, ``--disable-fused-kernels``). On the CPU, float32
inputs of two rows or more go through a oneDNN-packed copy of the weight
(`attnserve.models.layers.cpu_gemm`).

FP8 (issue 37): built inside `quantization.quantized_construction`, a `Linear` defers its
weight (``meta``, ``quant_pending``) until `quantization.apply.quantize_model_linears`
gives it FP8 parameters and a ``quant_method``; `matmul` and `forward_gated` then go
through the method.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.models.layers import cpu_gemm
from attnserve.models.layers.activation import act_and_mul
from attnserve.models.layers.fused_kernels import FusedKernelUser
from attnserve.models.layers.quantization.context import deferring_linear_weights
from attnserve.models.layers.mid_gemm import (
    MAX_MID_M,
    mid_gemm_config,
    mid_gemm_supported,
    mid_linear,
    mid_linear_gated,
)
from attnserve.models.layers.skinny_gemm import (
    MAX_SKINNY_M,
    SKINNY_ACTIVATIONS,
    skinny_gemm_supported,
    skinny_linear,
    skinny_linear_gated,
)


class Linear(nn.Module, FusedKernelUser):
    """``y = x @ weight.T + bias``; ``weight`` ``[out_features, in_features]`` (uninitialised).

    Shapes: ``x`` ``[..., in_features]`` -> ``[..., out_features]``, parameter dtype.

    CUDA inputs that are 2-D with ``1..MAX_SKINNY_M`` rows (decode batches) go through
    `skinny_linear` (one Triton launch, float32 accumulation) when `skinny_gemm_supported`
    accepts them and fused kernels were enabled at construction (``self.use_fused``); every
    other input (CPU, 3-D, prefill-sized) through ``F.linear``, except CPU float32 2-D
    inputs of two rows or more, which use the oneDNN-packed weight (`cpu_gemm`). CUDA
    inputs of ``17..256`` rows go through `mid_linear` (`mid_linear_gated`) only where the
    device's tuned table (`mid_gemm_config`) says the kernel beats cuBLAS for this shape
    and row bucket; with no table, ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        #: FP8 linear method (`quantization.fp8_linear`), or None for a plain weight
        self.quant_method = None
        self.quant_pending = deferring_linear_weights()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device="meta" if self.quant_pending else None), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.init_fused(True)
        self.cpu_packed = cpu_gemm.PackedCPUWeight()

    def _skinny(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the skinny GEMM path."""
        return (
            self.use_fused
            and x.is_cuda
            and x.dim() == 2
            and x.shape[0] <= MAX_SKINNY_M
            and skinny_gemm_supported(x, self.weight, self.bias)
        )

    def _mid(self, x: torch.Tensor, gated: bool = False):
        """The tuned `mid_gemm` config for ``x`` (``16 < M <= 256`` CUDA rows whose
        ``(N, K, gated, M-bucket)`` entry of the device's table beat cuBLAS), else None."""
        if not (self.use_fused and x.is_cuda and x.dim() == 2 and MAX_SKINNY_M < x.shape[0] <= MAX_MID_M):
            return None
        n, k = self.weight.shape
        cfg = mid_gemm_config(x.shape[0], n, k, x.dtype, x.device, gated)
        return cfg if cfg is not None and mid_gemm_supported(x, self.weight, self.bias) else None

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` by the same path choice as `forward`, with the bias
        given explicitly (None: no bias; `RowParallelLinear` adds its own after the
        all-reduce)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        if self._skinny(x):
            return skinny_linear(x, self.weight, bias)
        mid = self._mid(x)
        if mid is not None:
            return mid_linear(x, self.weight, bias, config=mid)
        return cpu_gemm.linear(x, self.weight, bias, self.cpu_packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def forward_gated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """Gated projection of a fused ``gate_up`` weight ``[2I, K]`` = ``[W_g | W_u]``.

        Args:
            x: ``[..., K]`` (``K = in_features``).
            activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, GELU's tanh form).

        Returns:
            ``act(x W_g^T + b_g) * (x W_u^T + b_u)`` ``[..., I]`` in the parameter dtype
            (bias terms only when the layer has a bias). Decode-sized CUDA inputs: one
            `skinny_linear_gated` launch; 17..256 rows with a tuned-table entry (gated) one
            `mid_linear_gated` launch; otherwise ``F.linear`` then the fused act-and-mul
            kernel (CUDA, fused kernels on) or the PyTorch formula.

        Raises:
            ValueError: unknown ``activation`` or an odd ``out_features``.
        """
        if activation not in SKINNY_ACTIVATIONS:
            raise ValueError(
                f"forward_gated: activation must be one of {', '.join(map(repr, SKINNY_ACTIVATIONS))}, got {activation!r}"
            )
        if self.out_features % 2:
            raise ValueError(f"forward_gated: out_features={self.out_features} must be even ([gate | up] rows)")
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias, activation)
        if self._skinny(x):
            return skinny_linear_gated(x, self.weight, activation, bias=self.bias)
        mid = self._mid(x, gated=True)
        if mid is not None:
            return mid_linear_gated(x, self.weight, activation, bias=self.bias, config=mid)
        return act_and_mul(cpu_gemm.linear(x, self.weight, self.bias, self.cpu_packed), activation, self.use_fused)

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
