"""Gluon stage 1 of paged decode attention over an fp8 (e4m3) KV cache on Hopper (opt-in).

`gluon_fp8_decode_stage1` computes what stage 1 of `decode_attention` computes (``o`` for
requests of one split, ``attn_logits`` / ``attn_lse`` otherwise, split bounds of
`decode_splits._split_bounds` with ``split_align`` keys), so stage 2 (`decode_merge`) is
reused unchanged. The kernel (`decode_fp8_gluon_kernel`) gathers K/V rows with cp.async into
a multi-buffered shared ring and computes with keys as the MMA's M dimension; its module doc
gives the design. `decode_attention.decode_attention_fwd` routes to it when
``ATTNSERVE_DECODE_FP8_GLUON=1`` (`FP8_GLUON_ENV`, default off) and
`gluon_fp8_decode_supported` holds (e4m3 cache, head size 128, no logit cap, sm_90,
non-deterministic launches).

Nothing here synchronises with the host; split counts stay on the device, so a launch is
CUDA-graph capturable. Gluon (Triton >= 3.6) is imported only when a kernel is launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from attnserve.env_options import OFF_VALUES

#: environment switch read at every call (`gluon_config_from_env`): unset, empty or an off
#: value: off; ``1`` / ``true`` / ``on`` / ``yes``: `DEFAULT_CONFIG`; ``<block_n>x<buffers>``
#: (e.g. ``64x3``, ``128x2``), optionally with ``-bytes`` (``pairs=False``): that tile
FP8_GLUON_ENV = "ATTNSERVE_DECODE_FP8_GLUON"
_ON_VALUES = ("1", "true", "on", "yes")
#: opt-in shared memory per block on H100 / H200 (bytes)
_HOPPER_SMEM = 227 * 1024
#: largest GQA group (query heads per KV head) the kernel takes (MMA N = 16 at most)
MAX_GROUP = 16


@dataclass(frozen=True)
class GluonFp8DecodeConfig:
    """Launch parameters of the Gluon fp8 stage 1.

    block_n: keys per tile (64 or 128: 4 warps along the MMA's M dimension, 16 keys each at
    least); num_buffers: depth of the shared K/V ring (2..8; ``num_buffers - 1`` tiles are in
    flight while one is computed); num_warps: 4 (one warpgroup; the layouts assume it);
    split_align: keys to which split lengths are rounded (stage 2 must use the same; 128 =
    the Triton fp8 tiles', so both paths cut requests identically; a multiple of block_n);
    pairs: read the K and V tiles from shared memory as int16 pairs of adjacent head dims with
    16-bit ``ldmatrix`` (V: ``.trans``) and split them into even / odd dims in registers (one
    ``prmt`` + two conversions per 4 bytes; the dots run as even + odd halves), instead of
    2-byte (K) and 1-byte (V^T) shared loads of the fp8 entries (offline sm_90a: the byte
    loads are 96 of the ~420 instructions a warp issues per 64-key tile).

    Shared memory: ``2 * num_buffers * block_n * 128`` bytes (default 64 KB: 3 programs per
    SM on an H100 by shared memory, 96 registers leave room for 5; offline sm_90a compile,
    `scripts/decode_fp8_gluon_offline.py`).

    Raises:
        ValueError: (on construction) any field out of range.
    """

    block_n: int = 64
    num_buffers: int = 4
    num_warps: int = 4
    split_align: int = 128
    pairs: bool = True

    def __post_init__(self) -> None:
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n must be 64 or 128, got {self.block_n}")
        if not 2 <= self.num_buffers <= 8:
            raise ValueError(f"num_buffers must be in 2..8, got {self.num_buffers}")
        if self.num_warps != 4:
            raise ValueError(f"num_warps must be 4 (one warpgroup), got {self.num_warps}")
        if self.split_align < self.block_n or self.split_align % self.block_n:
            raise ValueError(
                f"split_align ({self.split_align}) must be a positive multiple of block_n ({self.block_n})")
        if self.shared_bytes > _HOPPER_SMEM:
            raise ValueError(f"{self.shared_bytes} B of shared memory exceed {_HOPPER_SMEM}")

    @property
    def shared_bytes(self) -> int:
        """Shared memory of the K and V rings (bytes, head size 128, 1-byte entries)."""
        return 2 * self.num_buffers * self.block_n * 128


DEFAULT_CONFIG = GluonFp8DecodeConfig()


def gluon_config_from_env(raw: Optional[str]) -> Optional[GluonFp8DecodeConfig]:
    """The configuration that a value of `FP8_GLUON_ENV` selects (None: the Triton kernel).

    Raises:
        ValueError: a value that is neither an on/off word nor ``<block_n>x<buffers>[-bytes]``
            of a valid `GluonFp8DecodeConfig`.
    """
    v = (raw or "").strip().lower()
    if not v or v in OFF_VALUES:
        return None
    if v in _ON_VALUES:
        return DEFAULT_CONFIG
    body, bytes_suffix = (v[:-len("-bytes")], True) if v.endswith("-bytes") else (v, False)
    parts = body.split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{FP8_GLUON_ENV}={raw!r}: expected 1/0 or <block_n>x<buffers>[-bytes], e.g. 64x4")
    return GluonFp8DecodeConfig(block_n=int(parts[0]), num_buffers=int(parts[1]), pairs=not bytes_suffix)


def gluon_fp8_decode_supported(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
    v_head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    logit_cap: float,
    capability: Optional[Tuple[int, int]],
    *,
    batch_invariant: bool = False,
) -> bool:
    """Whether the Gluon fp8 stage 1 computes this decode call (pure Python, host values).

    True for an e4m3 cache (``torch.float8_e4m3fn``), bf16 / fp16 queries, head sizes
    ``Dk = Dv = 128``, ``Hq`` a multiple of ``Hkv`` with a group of at most `MAX_GROUP`, no
    logit cap, a device of compute capability 9.x (``capability``; None = no CUDA device) and
    non-deterministic launches (the batch-invariant mode keeps the Triton kernel, whose
    rounding its guarantees were checked with). Tensor layout (strides, alignment) is checked
    by `gluon_fp8_decode_stage1`."""
    if capability is None or capability[0] != 9 or batch_invariant or logit_cap > 0:
        return False
    if kv_dtype != torch.float8_e4m3fn or q_dtype not in (torch.bfloat16, torch.float16):
        return False
    if head_dim != 128 or v_head_dim != 128 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        return False
    return num_q_heads // num_kv_heads <= MAX_GROUP


def gluon_fp8_operands_ok(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                          kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_kv_splits: torch.Tensor) -> bool:
    """The tensor layout `gluon_fp8_decode_stage1` needs: int32 ``kv_indptr`` / ``kv_indices`` /
    ``num_kv_splits``, contiguous last dimensions, and 16-byte aligned K/V rows (cp.async of 16 B)."""
    if any(t.dtype != torch.int32 for t in (kv_indptr, kv_indices, num_kv_splits)):
        return False
    for t in (k_buffer, v_buffer):
        if t.stride(2) != 1 or t.stride(0) % 16 or t.stride(1) % 16 or t.data_ptr() % 16:
            return False
    return q.stride(2) == 1


def gluon_fp8_decode_stage1(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    grid_splits: int,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    config: GluonFp8DecodeConfig = DEFAULT_CONFIG,
) -> None:
    """Stage 1 of fp8 decode attention with the Gluon kernel (arguments as in
    `decode_attention.decode_attention_fwd`, already validated there).

    Shapes: q ``[bs, Hq, 128]`` bf16/fp16; k_buffer / v_buffer ``[slots, Hkv, 128]``
    ``float8_e4m3fn``; o ``[bs, Hq, 128]`` (written for requests of one split);
    attn_logits float32 ``[>= bs, Hq, >= max_kv_splits, 128]`` and attn_lse float32 ``[>= bs,
    Hq, >= max_kv_splits]`` (written for requests of several splits); kv_indptr / kv_indices /
    num_kv_splits int32. ``grid_splits`` is the split grid axis (`decode_grid_splits`);
    program ``(b, kv_head, z)`` computes splits ``z, z + grid_splits, ...``. Scales as in
    `decode_attention_fwd` (``k_scale`` folded into the softmax scale, ``v_scale`` applied to
    each split's output). Stage 2 must be launched with ``split_align=config.split_align``.

    Raises:
        ValueError: index tensors not int32, or K/V rows not 16-byte aligned.
    """
    from attnserve.attention.triton_ops.decode_fp8_gluon_kernel import _fp8_decode_stage1_kernel

    bs, hq, _ = q.shape
    hkv = k_buffer.shape[1]
    group = hq // hkv
    if not gluon_fp8_operands_ok(q, k_buffer, v_buffer, kv_indptr, kv_indices, num_kv_splits):
        raise ValueError("the Gluon fp8 decode kernel takes int32 kv_indptr / kv_indices / num_kv_splits and "
                         "contiguous, 16-byte aligned k_buffer / v_buffer rows")
    if bs == 0:
        return
    hp = 8 if group <= 8 else 16
    log2e = 1.4426950408889634
    _fp8_decode_stage1_kernel[(bs, hkv, max(1, int(grid_splits)))](
        q, k_buffer, v_buffer,
        kv_indptr, kv_indices, num_kv_splits,
        attn_logits, attn_lse, o,
        float(sm_scale) * float(k_scale) * log2e, float(v_scale),
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1),
        o.stride(0), o.stride(1),
        max(1, int(grid_splits)),
        int(max_kv_splits),
        GROUP=group,
        HP=hp,
        BLOCK_N=config.block_n,
        NUM_BUF=config.num_buffers,
        SPLIT_ALIGN=config.split_align,
        V_SCALED=float(v_scale) != 1.0,
        PAIRS=bool(config.pairs),
        SAME_STRIDE=k_buffer.stride(0) == v_buffer.stride(0),
        num_warps=config.num_warps,
    )
