"""Opt-in K-major storage of 16-bit projection weights (``ATTNSERVE_WEIGHT_LAYOUT=kn``; an
experiment for issue 33's decode GEMMs, off by default).

A `Linear` keeps its weight ``[N, K]`` row-major, so ``F.linear`` hands cuBLAS the transposed-B
problem. Stored K-major (``[K, N]`` contiguous, exposed as its ``[N, K]`` transpose view) the
same ``F.linear`` call is cuBLAS's plain problem, with its own kernel choice. Timed in CUDA
graphs on one H100 over rotating weights (``benchmarks/gemm_weight_layout.py``,
``benchmarks/results/h100-80gb-hbm3-gemm-weight-layout-2026-11-28.json``), the Llama-3-8B
projections at 64-256 rows ran 0.95-1.12x faster K-major (144 rows: qkv 22.1 -> 21.2 µs, o
15.3 -> 15.1, gate_up 93.0 -> 87.2, down 52.2 -> 50.2); Qwen3-0.6B's stayed within 3%.

The Triton decode GEMMs (`skinny_gemm` up to 16 rows, `mid_gemm`'s tuned entries) read
row-major weights only: with a K-major weight they decline (`gemm_operands_supported`) and
cuBLAS takes those batches too.

Measured in the engine (one H100, Llama-3-8B shape, dummy bf16 weights,
``benchmarks/results/h100-80gb-hbm3-bf16-weight-layout-engine-2026-11-28.json`` and
``...-offline-random-mixed-layout-{nk,kn}-2026-11-28.json``), row-major / K-major: decode step
at batch 1 5.56 / 5.81 ms (the skinny GEMV lost), 64 7.86 / 7.77, 144 10.22 / 9.99; prefill of
8,192 tokens 218.6 / 216.9 ms; the mixed workload (256 prompts, [100, 1024] in and out) 17.16 /
17.14 s. What the large batches gain the small ones give back, so the default stays row-major.
"""

from __future__ import annotations

import os

import torch
from torch import nn

#: ``ATTNSERVE_WEIGHT_LAYOUT=kn`` stores decoder-layer projection weights K-major (read at load)
WEIGHT_LAYOUT_ENV = "ATTNSERVE_WEIGHT_LAYOUT"


def weight_layout_requested() -> str:
    """``"kn"`` or ``"nk"`` (the default) from ``ATTNSERVE_WEIGHT_LAYOUT``.

    Raises:
        ValueError: any other value, naming the accepted ones.
    """
    value = os.environ.get(WEIGHT_LAYOUT_ENV, "nk").strip().lower() or "nk"
    if value not in ("nk", "kn"):
        raise ValueError(f"{WEIGHT_LAYOUT_ENV}={value!r}: expected 'nk' (row-major, default) or 'kn' (K-major)")
    return value


def apply_weight_layout(model: nn.Module, device_types=("cuda",)) -> int:
    """Store every unquantised 16-bit `Linear` weight of ``model`` on one of
    ``device_types`` K-major when ``ATTNSERVE_WEIGHT_LAYOUT=kn`` (the LM head and embeddings
    excepted: they are not `Linear` projections of a decoder layer). The parameter keeps its
    ``[N, K]`` shape and values; only its strides change (``(1, N)``). Returns how many
    weights were re-laid."""
    if weight_layout_requested() != "kn":
        return 0
    from attnserve.models.layers.linear import Linear

    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or "lm_head" in name or getattr(module, "quant_method", None) is not None:
            continue
        w = module.weight
        if (w.dim() != 2 or w.device.type not in device_types or w.dtype not in (torch.float16, torch.bfloat16)
                or not w.is_contiguous()):
            continue
        w.data = w.data.t().contiguous().t()
        count += 1
    return count
