"""One-launch KV-cache write (Triton) and the switch for attnserve's fused kernels.

`store_kv` replaces the un-fused write ``k_buffer[loc] = k.to(dtype); v_buffer[loc] =
v.to(dtype)`` (up to two casts and two ``index_put`` kernels) by one Triton launch. It
lives in ``mem_cache`` (not ``models``) because `MHATokenToKVPool` uses it and imports run
downwards (models -> mem_cache); `attnserve.models.layers.fused_kernels` re-exports it.

This module imports without Triton; the kernel module (`store_kv_triton`) is imported only
when `store_kv` is called.

Switch: every module with a fused path derives from `FusedKernelUser`; it decides in its
constructor whether it has a fused path for its configuration (``fused_supported``) and
uses it while ``use_fused`` is on. The engine turns them all off with
``--disable-fused-kernels`` (`attnserve.models.layers.fused_kernels.set_fused_kernels`;
the KV pool takes ``use_fused_store``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

def fused_kernels_available() -> bool:
    """True when Triton is installed (the fused kernels can be compiled).

    Callers still dispatch to the fused path only for CUDA tensors.
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] is None (import blocked)
        return False


class FusedKernelUser:
    """Mixin of the modules with a fused Triton path (norms, RoPE, gates, skinny linear).

    ``fused_supported``: whether this instance has a fused path at all (set in the
    constructor from its configuration and `fused_kernels_available`); ``use_fused``:
    whether it takes it (on CUDA tensors), on by default where supported. `set_fused` is
    the switch `set_fused_kernels` (``--disable-fused-kernels``) turns.
    """

    fused_supported: bool = False
    use_fused: bool = False

    def init_fused(self, supported: bool) -> None:
        """Record whether the fused path exists here and turn it on where it does."""
        self.fused_supported = bool(supported) and fused_kernels_available()
        self.use_fused = self.fused_supported

    def set_fused(self, enabled: bool) -> None:
        """Take the fused path (where supported) when ``enabled``, the PyTorch path otherwise."""
        self.use_fused = bool(enabled) and self.fused_supported


@dataclass(frozen=True)
class KVStoreTarget:
    """Where `rotary_embedding_inplace` also writes K and V (fused KV-cache store).

    Attributes:
        k_buffer: ``[slots, Hkv, head_dim]`` K cache of one layer (last dim contiguous).
        v_buffer: ``[slots, Hkv, Dv]`` V cache of the same layer.
        loc: int64/int32 ``[T]`` destination rows (``out_cache_loc``); not range-checked.
        value: ``[T, Hkv*Dv]`` or ``[T, Hkv, Dv]`` values of the step's tokens (last dim
            contiguous; e.g. the v part of a fused qkv output).
        k_scale / v_scale: per-tensor dequantisation scales (floats > 0) of an FP8 cache,
            which stores ``saturate(x / scale)`` (`kv_quant.quantize_kv`); ignored by 16/32-bit
            caches.
    """

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor
    value: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """``k_buffer[loc[i]] = k[i]`` and ``v_buffer[loc[i]] = v[i]`` in one Triton launch.

    Args:
        k_buffer: ``[slots, H, Dk]`` cache (last dim contiguous), any float dtype.
        v_buffer: ``[slots, H, Dv]`` cache (last dim contiguous).
        loc: int64 (or int32) ``[T]`` destination rows; must lie in ``[0, slots)`` (not
            checked: no host sync). Duplicate rows get one of the writers (unspecified).
        k: ``[T, H, Dk]`` (or ``[T, H*Dk]``), any dtype castable to ``k_buffer.dtype``;
            may be a strided view (e.g. into a fused qkv output) with last dim contiguous.
        v: ``[T, H, Dv]`` (or ``[T, H*Dv]``), likewise.

    Values go through float32 into the buffer dtype (same rounding as ``Tensor.to``). An
    FP8 buffer (``float8_e4m3fn`` / ``float8_e5m2``, both buffers alike) stores
    ``saturate(x / scale)`` with ``k_scale`` / ``v_scale`` (`kv_quant.quantize_kv`); other
    dtypes ignore the scales. No allocation, no host sync: CUDA-graph capturable.

    Raises:
        ValueError: on shape mismatches or a non-contiguous last dimension.
    """
    num_heads, dk = k_buffer.shape[1], k_buffer.shape[2]
    dv = v_buffer.shape[2]
    if v_buffer.shape[1] != num_heads:
        raise ValueError(f"store_kv: K and V buffers have {num_heads} and {v_buffer.shape[1]} heads")
    k3 = k if k.dim() == 3 else k.view(k.shape[0], num_heads, dk)
    v3 = v if v.dim() == 3 else v.view(v.shape[0], num_heads, dv)
    t = loc.shape[0]
    if tuple(k3.shape) != (t, num_heads, dk) or tuple(v3.shape) != (t, num_heads, dv):
        raise ValueError(
            f"store_kv: k {tuple(k.shape)} / v {tuple(v.shape)} do not match loc [{t}] and buffers "
            f"[*, {num_heads}, {dk}] / [*, {num_heads}, {dv}]"
        )
    for name, x in (("k", k3), ("v", v3), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if x.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must have a contiguous last dimension, strides {x.stride()}")
    if t == 0:
        return
    from attnserve.mem_cache.kv_quant import fp8_max, is_fp8
    from attnserve.mem_cache.store_kv_triton import _store_kv_kernel

    quant = is_fp8(k_buffer.dtype)
    if quant != is_fp8(v_buffer.dtype):
        raise ValueError(f"store_kv: K and V buffers must both be FP8 or neither ({k_buffer.dtype}, {v_buffer.dtype})")

    block_dk, block_dv = _next_pow2(dk), _next_pow2(dv)
    block_h = max(1, min(_next_pow2(num_heads), 4096 // max(block_dk, block_dv)))
    grid = (t, -(-num_heads // block_h))
    _store_kv_kernel[grid](
        loc, k3, v3, k_buffer, v_buffer,
        k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        num_heads, dk, dv, 1.0 / k_scale, 1.0 / v_scale, fp8_max(k_buffer.dtype) if quant else 0.0,
        BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv, QUANT=quant,
        num_warps=4,
    )
