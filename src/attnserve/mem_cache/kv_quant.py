"""FP8 KV-cache formats and per-tensor scales (``--kv-cache-dtype``).

A cache entry stores ``q = saturate(x * (1 / scale))`` in an 8-bit float format and the kernels
read ``x ~= float(q) * scale`` (per layer, one ``k_scale`` and one ``v_scale``, as SGLang's
and vLLM's FP8 KV caches do). Saturation clamps to the format's largest finite value before
the cast, so an outlier becomes the largest representable number instead of inf/NaN.

Formats (OCP 8-bit floating point spec, v1.0, 2023; PyTorch ``torch.float8_*``):

* ``fp8_e4m3`` -> ``torch.float8_e4m3fn``: 4 exponent, 3 mantissa bits, max 448, no inf;
* ``fp8_e5m2`` -> ``torch.float8_e5m2``: 5 exponent, 2 mantissa bits, max 57344.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

#: ``--kv-cache-dtype`` names -> storage dtype (None: the model's dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the KV cache for ``--kv-cache-dtype name``.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def check_scale(name: str, value: float) -> float:
    """``value`` as a float when it is a finite number > 0.

    Raises:
        ValueError: a scale <= 0, inf or NaN.
    """
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: ``saturate(x / scale)`` for fp8, a plain cast
    otherwise (``scale`` ignored). Computed in float32."""
    if not is_fp8(dtype):
        return x.to(dtype)
    m = fp8_max(dtype)  # multiply by the reciprocal, as the store kernel does (same rounding)
    return (x.float() * (1.0 / scale)).clamp_(-m, m).to(dtype)


def dequantize_kv(q: torch.Tensor, scale: float, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Values of stored entries ``q``: ``float(q) * scale`` for fp8 (in ``out_dtype``,
    float32 by default), ``q`` itself otherwise."""
    if not is_fp8(q.dtype):
        return q if out_dtype is None else q.to(out_dtype)
    x = q.float() * scale
    return x if out_dtype is None else x.to(out_dtype)
