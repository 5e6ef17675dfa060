"""When the fused MoE layer runs its FP8 experts W8A8 (FP8 activations too), and the
activation quantisation it then uses (issue 37).

FP8 experts run W8A16 by default: the Triton kernel widens each e4m3 weight tile to the
16-bit activation dtype, so the tensor cores do bf16 math plus a dequantisation. That is
right where a layer call is bound by the weight bytes (decode), but at large batches the
experts are compute bound and W8A16 is slower than bf16 experts (H100, Mixtral-8x7B tp 2,
8192 tokens: bf16 5.1 ms, W8A16 8.9 ms; ``benchmarks/results/
h100-80gb-hbm3-moe-layer-fp8-2026-11-27.json``). W8A8 quantises the activations to e4m3
and runs e4m3 x e4m3 ``tl.dot`` (twice the bf16 tensor-core rate on sm 89 / 90):

* per-channel (and per-tensor) weights: one scale per token (``x ~= q s_t``), applied with
  the channel scale in the epilogue, ``acc[m, n] * s_t[m] * s_w[n]``;
* 128 x 128 block weights (DeepSeek-V3): one scale per ``1 x 128`` group of a token,
  ``a_scale[m, kb] * w_scale[n // 128, kb]`` on each 128-wide K step (DeepSeek-AI,
  "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 3.3).

The gate-up GEMM's input (the hidden states) is quantised by `fp8_kernels.quantize_activation`
(the dense FP8 path's quantiser, one launch); the down GEMM's input, the SiLU-and-mul
intermediate (``[T top_k, I]`` in the storage dtype), likewise: a per-token scale needs the
whole row of ``I``, which the gate-up programs (one column band each) do not see.

The choice (`use_fp8_w8a8`): W8A8 when the mean slots per expert ``T top_k / E`` is at least
`fp8_w8a8_min_slots` (default 16; ``ATTNSERVE_MOE_FP8_W8A8_MIN_SLOTS``), on a device with
FP8 tensor cores (sm >= 89) or the CPU interpreter, and never for one token (decode at
batch 1, which skips the alignment). The default 16 is where the W8A16 rows of that H100
table fall off (share of their byte floor: Mixtral-8x7B 0.93 at 32 tokens, 16 slots an
expert at 64 tokens 0.80, 0.55 at 128; Qwen3-30B-A3B 0.82 at 128 tokens, 0.68 at 256 =
16 slots; DeepSeek-V2-Lite 0.80 at 128, 0.69 at 256 = 24 slots), while smaller batches
stay W8A16 (their shares are 0.8 - 0.9 and an activation quantisation costs two launches).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

#: default of `fp8_w8a8_min_slots`
DEFAULT_W8A8_MIN_SLOTS = 16
#: environment variable of `fp8_w8a8_min_slots`
W8A8_MIN_SLOTS_ENV = "ATTNSERVE_MOE_FP8_W8A8_MIN_SLOTS"
_MAX_MIN_SLOTS = 1 << 20


def fp8_w8a8_min_slots() -> int:
    """Mean slots per expert (``T top_k / E``) from which FP8 experts run W8A8: 16, or
    ``ATTNSERVE_MOE_FP8_W8A8_MIN_SLOTS`` (0 = W8A8 for every batch of more than one token;
    a large value = always W8A16). Read at every call (CUDA graphs bake the choice in at
    capture).

    Raises:
        ValueError: a value that is not an integer in ``0..2**20``.
    """
    from attnserve.env_options import env_int

    return env_int(W8A8_MIN_SLOTS_ENV, DEFAULT_W8A8_MIN_SLOTS, 0, _MAX_MIN_SLOTS)


@functools.lru_cache(maxsize=16)
def _fp8_dot_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def use_fp8_w8a8(num_tokens: int, top_k: int, num_experts: int, device: torch.device,
                 force: Optional[bool] = None) -> bool:
    """Whether FP8 experts run W8A8 for a call of ``num_tokens`` tokens (see the module doc).

    Args:
        force: True / False choose W8A8 / W8A16 regardless of the batch (True still needs
            sm >= 89 on CUDA); None: the rule.

    Raises:
        ValueError: ``force`` True on a CUDA device without FP8 tensor cores.
    """
    capable = device.type != "cuda" or _fp8_dot_capable(device.index if device.index is not None
                                                        else torch.cuda.current_device())
    if force is not None:
        if force and not capable:
            raise ValueError(f"fp8_w8a8=True needs FP8 tensor cores (sm >= 89); {device} has "
                             f"sm {''.join(map(str, torch.cuda.get_device_capability(device)))}")
        return bool(force)
    if num_tokens <= 1 or not capable:
        return False
    return num_tokens * top_k >= fp8_w8a8_min_slots() * num_experts


def quantize_moe_activation(x: torch.Tensor, block_shape: Optional[Tuple[int, int]]
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] e4m3, s float32)``: per token ``s [M, 1]`` (per-channel
    weights, ``block_shape`` None) or per ``1 x block_shape[1]`` group ``s [M, cdiv(K, 128)]``
    (block weights); `fp8_kernels.quantize_activation` on CUDA.

    CPU tensors (also under ``TRITON_INTERPRET=1``) take the PyTorch quantiser of
    `fp8_utils`: Triton 3.x's interpreter casts float32 to e4m3 wrongly where the value
    rounds up to the next power of two (124.3 -> 64 rather than 128), which the hardware
    cast does not."""
    group = None if block_shape is None else int(block_shape[1])
    if x.device.type == "cpu":
        from attnserve.models.layers.quantization.fp8_utils import quantize_per_group, quantize_per_row

        if group is None:
            q, s = quantize_per_row(x)
            return q, s.unsqueeze(1)
        return quantize_per_group(x, group)
    from attnserve.models.layers.quantization.fp8_kernels import quantize_activation

    return quantize_activation(x, group)
