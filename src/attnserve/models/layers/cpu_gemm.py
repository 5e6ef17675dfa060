"""Batched float32 GEMMs on the CPU through oneDNN with the weight packed once.

``F.linear`` on a CPU float32 input calls MKL's ``sgemm``, which re-packs the weight on
every call; with a handful of rows (a decode batch) that packing dominates. PyTorch's
oneDNN integration can keep the weight in oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the op Inductor's CPU freezing pass uses for
the same reason) and run ``torch.ops.mkldnn._linear_pointwise`` on it. Measured on the
2-core CI-class machine, SmolLM2-135M's 121 weight matrices at 16 rows: 57-63 ms through
``F.linear``, 43-45 ms packed (benchmarks/NOTES.md, session 11). With one row MKL's GEMV
path is faster (123 vs 152 us for a 3072 x 576 weight), so single rows keep ``F.linear``.

The packed copy lives beside the weight (the original stays: other paths read it), so a
model that uses this path holds its float32 weights twice in host memory.
"""

from __future__ import annotations

from typing import Optional

import torch


def packed_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN and the packed-linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class PackedCPUWeight:
    """A oneDNN-packed copy of one float32 CPU weight ``[out_features, in_features]``,
    rebuilt whenever the weight's storage or version changes (a reload, an in-place copy).

    `linear` returns None where this path does not apply, so callers fall back to
    ``F.linear``: CUDA or non-float32 tensors, inputs that are not 2-D with at least 2 rows,
    or a build without the ops.
    """

    min_rows = 2

    def __init__(self):
        self._key = None
        self._packed: Optional[torch.Tensor] = None
        self._available = packed_linear_available()

    def __getstate__(self):  # copies and pickles start unpacked (oneDNN tensors cannot be copied)
        return {"_key": None, "_packed": None, "_available": self._available}

    def __deepcopy__(self, memo):
        new = PackedCPUWeight.__new__(PackedCPUWeight)
        new.__dict__.update(self.__getstate__())
        return new

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `linear` would take the packed path for ``x`` and ``weight``."""
        return (
            self._available
            and x.dim() == 2
            and x.shape[0] >= self.min_rows
            and x.dtype is torch.float32
            and weight.dtype is torch.float32
            and not x.is_cuda
            and not weight.is_cuda
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``x @ weight.T (+ bias)`` ``[M, out_features]`` float32, or None (see class doc).

        Args:
            x: float32 ``[M, in_features]``, ``M >= 2``.
            weight: float32 ``[out_features, in_features]``.
            bias: float32 ``[out_features]`` or None.
        """
        if not self.applies(x, weight):
            return None
        key = (weight.data_ptr(), weight._version, weight.shape)
        if self._key != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._key = key
        b = None if bias is None else bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), self._packed, b,
                                                   "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           packed: Optional[PackedCPUWeight]) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` where it applies (see `PackedCPUWeight`)."""
    out = packed.linear(x, weight, bias) if packed is not None else None
    return torch.nn.functional.linear(x, weight, bias) if out is None else out
