"""Root-mean-square layer normalisation (Zhang & Sennrich, arXiv:1910.07467)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from attnserve.models.layers.fused_kernels import (
    fused_add_rmsnorm_supported,
    fused_add_rmsnorm_unchecked,
    FusedKernelUser,
    rmsnorm,
)
from attnserve.models.layers.quantization.fused_inputs import Fp8Activation, ScaledProduct, emits_fp8


class RMSNorm(nn.Module, FusedKernelUser):
    """``y = x / sqrt(mean(x**2, -1) + eps) * weight``, computed in float32.

    The statistics and the scaling by ``weight`` are computed in float32 whatever the
    input dtype; the result is cast back to the input's dtype.

    Args:
        hidden_size: size of the last dimension (the normalised one).
        eps: added to the mean square before the reciprocal square root.
        dtype: dtype of ``weight`` (initialised to ones).

    Shapes:
        ``x`` ``[..., hidden_size]`` -> same shape and dtype.

    On CUDA tensors the fused Triton kernels of `fused_kernels` do the work in one launch
    (``use_fused``, `FusedKernelUser`); the code below is the
    reference and the CPU path.
    """

    #: the fused kernels compute ``x_hat * (weight + fused_weight_offset)``; a subclass whose
    #: ``_norm`` is not of that form must set this to None (no fused path)
    fused_weight_offset: Optional[float] = 0.0
    #: set by `quantization.fused_inputs.enable_fused_producers`: with a residual, large
    #: CUDA batches return an `Fp8Activation` (the add-RMSNorm output quantised per token)
    fp8_output: bool = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.init_fused(self.fused_weight_offset is not None)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one op (`torch.nn.functional.rms_norm`, the same float32 formula) instead of six
            return torch.nn.functional.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        return (xf * self.weight.float()).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Normalise ``x``; with ``residual``, first add it (pre-norm residual stream).

        Args:
            x: ``[..., hidden_size]``, or a folded FP8 linear's `ScaledProduct`
                (`fused_inputs`, "Lazy scales"): a norm that quantises its output
                (``fp8_output``) applies its scales in its own kernel, any other
                materialises it first.
            residual: optional tensor of the same shape. When given, ``s = x + residual``
                is formed and ``(norm(s), s)`` is returned, so that a decoder layer carries
                the un-normalised residual stream to the next block.

        Returns:
            ``norm(x)``, or ``(norm(x + residual), x + residual)`` when ``residual`` is given.
            On the fused (CUDA) path the sum is written into ``residual`` in place and that
            tensor is returned.
        """
        if isinstance(x, ScaledProduct):  # a folded FP8 linear's unscaled output (`fused_inputs`)
            if residual is not None and self.fp8_output and self.use_fused and x.raw.is_cuda:
                if (emits_fp8(x.raw, self.fused_weight_offset is not None) and x.raw.shape == residual.shape
                        and residual.stride(-1) == 1):
                    from attnserve.models.layers.quantization.fp8_kernels import fused_add_rmsnorm_quant_fp8

                    q, s = fused_add_rmsnorm_quant_fp8(x.raw, residual, self.weight, self.variance_epsilon,
                                                       self.fused_weight_offset, row_scale=x.row_scale,
                                                       col_scale=x.col_scale)
                    return Fp8Activation(q, s, x.dtype), residual
            x = x.materialize()
        if self.use_fused and x.is_cuda:
            if residual is None:
                return rmsnorm(x, self.weight, self.variance_epsilon, self.fused_weight_offset)
            if fused_add_rmsnorm_supported(x, residual):
                if self.fp8_output and emits_fp8(x, self.fused_weight_offset is not None):
                    from attnserve.models.layers.quantization.fp8_kernels import fused_add_rmsnorm_quant_fp8

                    q, s = fused_add_rmsnorm_quant_fp8(x, residual, self.weight, self.variance_epsilon,
                                                       self.fused_weight_offset)
                    return Fp8Activation(q, s, x.dtype), residual
                out = fused_add_rmsnorm_unchecked(x, residual, self.weight, self.variance_epsilon,
                                                  self.fused_weight_offset)
                return out, residual
        if residual is None:
            return self._norm(x)
        s = x + residual
        return self._norm(s), s

    def forward_all_reduce(self, x_partial: torch.Tensor, residual: torch.Tensor,
                           tp) -> Tuple[torch.Tensor, torch.Tensor]:
        """``forward(tp.all_reduce(x_partial), residual)``, in one kernel where it can be.

        Args:
            x_partial: ``[..., hidden_size]`` a row-parallel layer's partial sums on this rank
                (``reduce_results=False``).
            residual: ``[..., hidden_size]`` the residual stream.
            tp: the rank's `TPGroup`.
        Returns:
            ``(norm(sum + residual), sum + residual)`` as `forward`.

        Where `forward` would take its fused CUDA path (and emit no FP8 activation),
        `TPGroup.fused_all_reduce_add_rmsnorm` runs (the all-reduce, add and norm in one
        kernel when the custom all-reduce's one-shot path takes the message; otherwise
        ``tp.all_reduce`` then `forward`, as everywhere else).
        """
        if isinstance(x_partial, ScaledProduct):
            x_partial = x_partial.materialize()
        if (self.use_fused and x_partial.is_cuda and not self.fp8_output and self.fused_weight_offset is not None
                and fused_add_rmsnorm_supported(x_partial, residual)):
            return tp.fused_all_reduce_add_rmsnorm(x_partial, residual, self.weight, self.variance_epsilon,
                                                   self.fused_weight_offset, add_rmsnorm=self.forward)
        return self.forward(tp.all_reduce(x_partial), residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``y = x / sqrt(mean(x**2, -1) + eps) * (1 + weight)`` in float32.

    The parameter holds the offset from 1 (HF's Gemma convention; llama.cpp stores
    ``1 + weight`` and the GGUF loader subtracts 1), so ``weight`` is initialised to zeros
    and dummy weights fill it with 0 (`GemmaRMSNorm` models set ``dummy_norm_fill = 0``).
    The product with ``1 + weight`` is taken in float32 before the cast back to the input
    dtype (Gemma 3 technical report, arXiv:2503.19786; same order as HF's Gemma3RMSNorm).

    Shapes and the ``residual`` form are those of `RMSNorm`.
    """

    fused_weight_offset = 1.0  # fused kernels: x_hat * (weight + 1)

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None):
        super().__init__(hidden_size, eps, dtype)
        with torch.no_grad():
            self.weight.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
