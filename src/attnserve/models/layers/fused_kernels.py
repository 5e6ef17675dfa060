"""Fused Triton kernels of the decoder's small operations (used on CUDA tensors).

Each function replaces a chain of elementwise PyTorch kernels with one Triton launch; the
pure-PyTorch code of the layers (`RMSNorm`, `RotaryEmbedding`, `SiluAndMul`, `GeluAndMul`,
`MHATokenToKVPool.set_kv_buffer`) stays the reference and the CPU path. The layers use
these launchers only for CUDA tensors and only while their ``use_fused`` is on
(`FusedKernelUser`; `set_fused_kernels` turns a whole model's off, ``--disable-fused-kernels``).

* `rmsnorm` / `fused_add_rmsnorm` -- RMSNorm (Zhang & Sennrich, arXiv:1910.07467), also in
  Gemma's ``x * (1 + w)`` form (``weight_offset=1.0``); the residual form adds, stores the
  new residual stream in place and normalises in one kernel. Rows shorter than 1024
  (padded) elements -- the per-head q/k norms of Qwen3 and Gemma 3, rows of
  ``head_dim`` -- are normalised ``4096 // BLOCK`` per program, so those launches move
  several KB per program and stream at the copy rate; longer rows take one program each.
* `rotary_embedding_inplace` -- RoPE (Su et al., RoFormer, arXiv:2104.09864) on q and k in
  one launch, NeoX ("rotate half") or GPT-J (interleaved) pairing, partial ``rotary_dim``;
  optionally with the KV-cache write and with Qwen3's / Gemma 3's per-head q/k RMSNorm
  before the rotation (norm + rotate + store in one launch).
* `silu_and_mul` / `gelu_tanh_and_mul` -- SwiGLU / GeGLU gates (Shazeer,
  arXiv:2002.05202); GELU with the tanh approximation (Hendrycks & Gimpel,
  arXiv:1606.08415).
* `store_kv` -- K and V cache write in one launch (defined in `attnserve.mem_cache.store_kv`).

All math is float32 inside the kernels; inputs may be float16, bfloat16 or float32;
outputs are in the input's dtype. The launchers allocate nothing but their outputs, never
read device values on the host, and are CUDA-graph capturable. On Hopper the RMSNorm and
RoPE kernels launch with programmatic dependent launch (`attnserve.pdl`;
``ATTNSERVE_PDL=0`` turns it off): the norms read their ``weight`` before waiting for the
kernel launched before them, so ``weight`` must not be written by that kernel (module
parameters never are). Algorithms were studied in
SGLang / vLLM / FlashInfer; the code is our own.

Triton is imported lazily (the kernels live in `fused_kernels_triton`; `_kernels` imports
that module once), so this module imports on CPU-only installs without Triton. The host
path of each launcher is kept short because eager prefill and decode call them on every
layer: launch configurations are cached per row width (`_norm_launch`), the device's PDL
facts per device index (`pdl._pdl_capable`), and nothing is imported per call. On CPU the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1``; the tests use it).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional, Tuple

import torch
import torch.nn as nn

from attnserve.mem_cache.kv_quant import check_scale, fp8_max, is_fp8
from attnserve.mem_cache.store_kv import FusedKernelUser, KVStoreTarget, fused_kernels_available, store_kv
from attnserve.pdl import pdl_enabled

__all__ = [
    "FusedKernelUser",
    "fused_kernels_available",
    "set_fused_kernels",
    "rmsnorm",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_supported",
    "fused_add_rmsnorm_unchecked",
    "rope_layout_supported",
    "rotary_embedding_inplace",
    "KVStoreTarget",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "store_kv",
]


def set_fused_kernels(model: nn.Module, enabled: bool) -> int:
    """Turn the fused path of every `FusedKernelUser` in ``model`` on (where supported) or
    off. Returns how many modules take it afterwards."""
    users = [m for m in model.modules() if isinstance(m, FusedKernelUser)]
    for m in users:
        m.set_fused(enabled)
    return sum(m.use_fused for m in users)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 512))


@functools.lru_cache(maxsize=None)
def _kernels() -> ModuleType:
    """`fused_kernels_triton`, imported on the first launch (it imports Triton)."""
    from attnserve.models.layers import fused_kernels_triton

    return fused_kernels_triton


#: elements of one program's ``[BLOCK_M, BLOCK]`` tile when rows are short (8 KB of a
#: 16-bit input, 16 KB of float32): enough bytes in flight per program to stream at the
#: copy rate instead of one launch-bound program per 128-element head
_NORM_TILE = 4096
#: rows of at least this many (padded) elements keep one program per row: the residual
#: add + norm of 1024-wide rows already streams at the copy rate that way (H100 profile
#: of Qwen3-0.6B prefill: 122 MB in 39 us per launch)
_NORM_LONG_ROW = 1024


@functools.lru_cache(maxsize=256)
def _norm_launch(n: int) -> Tuple[int, int, int]:
    """``(BLOCK, BLOCK_M, num_warps)`` of the norm kernels for rows of ``n`` elements: the
    whole row in registers (``BLOCK = next_pow2(n)``); ``BLOCK_M`` rows per program
    (``_NORM_TILE // BLOCK`` for short rows, 1 for long ones); warps by tile size. A
    function of ``n`` alone, so a model compiles one variant per norm width."""
    block = _next_pow2(n)
    block_m = 1 if block >= _NORM_LONG_ROW else _NORM_TILE // block
    return block, block_m, _norm_warps(block * block_m)


def _pdl_args(device: torch.device) -> dict:
    """Launch arguments of a kernel that opts into programmatic dependent launch
    (`attnserve.pdl`): its ``USE_PDL`` constexpr and Triton's ``launch_pdl``."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


def _row_layout(x: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    """Rows of ``x`` ``[..., N]`` as (tensor, stride_outer, stride_inner, inner).

    Row ``r`` starts at ``(r // inner) * stride_outer + (r % inner) * stride_inner``: this
    covers 2-D tensors with any row stride and 3-D views such as ``[T, H, D]`` carved out of
    a fused projection, without a copy. Other layouts (or a strided last dim) are made
    contiguous first.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    dim = x.dim()
    if dim == 2:
        return x, x.stride(0), 0, 1
    if dim == 3:
        s0, s1, _ = x.stride()
        return x, s0, s1, x.shape[1]
    if dim == 1:
        return x, x.shape[0], 0, 1
    if not x.is_contiguous():
        x = x.contiguous()
    return x, x.shape[-1], 0, 1


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * (weight + weight_offset)`` in one launch.

    Args:
        x: ``[..., N]`` float16/bfloat16/float32; 2-D/3-D strided views with a contiguous
            last dim are read in place.
        weight: ``[N]`` any float dtype (converted to float32 in the kernel).
        eps: added to the mean square.
        weight_offset: 0.0 for Llama-style RMSNorm, 1.0 for Gemma's ``(1 + w)`` form.
        out: optional contiguous output of ``x``'s shape (any float dtype).

    Returns:
        ``out`` (or a new contiguous tensor of ``x``'s shape and dtype). The whole row is
        held in registers (``BLOCK = next_pow2(N)``), squares summed in float32 per row, the
        product ``x * rstd * (w + offset)`` formed in float32 and rounded once to ``out``'s
        dtype. Rows shorter than 1024 padded elements are processed ``4096 // BLOCK`` per
        program (e.g. 32 heads of 128 for a per-head q/k norm); longer rows one per program
        (`_norm_launch`).

    Raises:
        ValueError: ``out`` has another shape or is not contiguous.
    """
    shape = x.shape
    n = shape[-1]
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or not out.is_contiguous():
        raise ValueError(f"rmsnorm: out must be contiguous with shape {tuple(shape)}")
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out
    xs, s0, s1, inner = _row_layout(x)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    block, block_m, warps = _norm_launch(n)
    _kernels()._rmsnorm_kernel[(-(-rows // block_m),)](
        xs, s0, s1, inner, weight, out, n, n, float(eps), float(weight_offset),
        BLOCK=block, num_warps=warps, n_rows=rows, BLOCK_M=block_m, **_pdl_args(x.device),
    )
    return out


def fused_add_rmsnorm_supported(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether `fused_add_rmsnorm` accepts ``(x, residual)``: same shape and dtype, and a
    ``residual`` it can update in place (contiguous last dim; 1-3 dims or contiguous)."""
    return (
        x.shape == residual.shape
        and x.dtype == residual.dtype
        and residual.stride(-1) == 1
        and (residual.dim() <= 3 or residual.is_contiguous())
    )


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """``residual += x`` (in place, in ``residual``'s dtype) and return ``rmsnorm(residual)``.

    One launch. Matches the PyTorch reference ``s = x + residual; norm(s)``: the sum is
    rounded to the storage dtype before it is normalised in float32. Short rows are
    processed several per program, as in `rmsnorm`.

    Args:
        x: ``[..., N]`` block output, same shape and dtype as ``residual``.
        residual: ``[..., N]`` residual stream; overwritten with ``x + residual`` (callers
            must not need the old value: the decoder layers pass a stream they own).
        weight / eps / weight_offset: as in `rmsnorm`.

    Returns:
        new contiguous ``[..., N]`` tensor ``norm(x + residual)`` in ``residual``'s dtype.

    Raises:
        ValueError: shapes or dtypes differ, or ``residual`` has a strided last dimension
            or more than 3 dims without being contiguous (it must be updated in place).
    """
    if not fused_add_rmsnorm_supported(x, residual):
        raise ValueError(
            f"fused_add_rmsnorm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
            f"{residual.dtype} strides {residual.stride()}: shapes and dtypes must match and residual "
            "must be updatable in place"
        )
    return fused_add_rmsnorm_unchecked(x, residual, weight, eps, weight_offset)


def fused_add_rmsnorm_unchecked(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """`fused_add_rmsnorm` for callers that have just seen `fused_add_rmsnorm_supported`
    return True for ``(x, residual)`` (`RMSNorm.forward`): the same launch without
    checking it again. Anything else is undefined."""
    shape = x.shape
    n = shape[-1]
    out = torch.empty(shape, dtype=residual.dtype, device=residual.device)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out
    xs, xs0, xs1, inner = _row_layout(x)
    rs, rs0, rs1, r_inner = _row_layout(residual)
    assert inner == r_inner  # same shape, and neither is re-laid-out when > 3-D (checked above)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    block, block_m, warps = _norm_launch(n)
    _kernels()._fused_add_rmsnorm_kernel[(-(-rows // block_m),)](
        xs, xs0, xs1, rs, rs0, rs1, inner, weight, out, n, n, float(eps), float(weight_offset),
        BLOCK=block, num_warps=warps, n_rows=rows, BLOCK_M=block_m, **_pdl_args(x.device),
    )
    return out


def _rope_heads(x: torch.Tensor, head_dim: int) -> Optional[Tuple[int, int, int]]:
    """(num_heads, stride_t, stride_h) of a ``[T, H*D]`` / ``[T, H, D]`` tensor, or None."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2 and x.shape[1] % head_dim == 0:
        return x.shape[1] // head_dim, x.stride(0), head_dim
    if x.dim() == 3 and x.shape[2] == head_dim:
        return x.shape[1], x.stride(0), x.stride(1)
    return None


def _rope_layouts(query: torch.Tensor, key: Optional[torch.Tensor], head_dim: int):
    """``(query's, key's or None)`` `_rope_heads`, or None where `rotary_embedding_inplace`
    cannot rotate the tensors where they lie (`rope_layout_supported`)."""
    q_heads = _rope_heads(query, head_dim)
    if q_heads is None or key is None:
        return None if q_heads is None else (q_heads, None)
    k_heads = _rope_heads(key, head_dim)
    return None if k_heads is None or key.shape[0] != query.shape[0] else (q_heads, k_heads)


def rope_layout_supported(query: torch.Tensor, key: Optional[torch.Tensor], head_dim: int) -> bool:
    """Whether `rotary_embedding_inplace` can rotate these tensors where they lie: 2-D
    ``[T, H*D]`` or 3-D ``[T, H, D]`` with a contiguous last dimension (any row/head
    stride), and ``key`` (if any) with the same number of tokens."""
    return _rope_layouts(query, key, head_dim) is not None


def rotary_embedding_inplace(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    is_neox: bool,
    kv_store: Optional[KVStoreTarget] = None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
) -> None:
    """Rotate ``q`` and ``k`` in place by their tokens' positions (one launch for both).

    Args:
        positions: int64 (or int32) ``[T]``; must index ``cos_sin_cache`` (not checked).
        q: ``[T, Hq*D]`` or ``[T, Hq, D]``, float16/bfloat16/float32, last dim contiguous;
            may be a strided view (e.g. the q part of a fused qkv output).
        k: ``[T, Hk*D]`` / ``[T, Hk, D]`` likewise, or None.
        cos_sin_cache: float32 ``[max_pos, rotary_dim]`` = ``[cos | sin]`` halves of
            ``position * inv_freq`` (`RotaryEmbedding.cos_sin_cache`; any scale is baked in).
        head_dim: ``D``.
        rotary_dim: leading channels of each head that rotate (even, ``<= D``); the others
            are left untouched.
        is_neox: True pairs channel ``i`` with ``i + rotary_dim/2``; False pairs ``2i`` with
            ``2i+1`` (GPT-J interleaving). Pair ``i`` uses ``cos[i]``, ``sin[i]``:
            ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` in float32.

        kv_store: also write the rotated ``k`` and ``kv_store.value`` into the KV cache
            rows ``kv_store.loc`` (see `KVStoreTarget`), replacing a separate
            `store_kv` launch; needs ``k``. The cache receives exactly the values left in
            ``k`` (rounded to its dtype, then converted to the cache dtype; an FP8 cache
            gets ``saturate(x / scale)`` with ``kv_store.k_scale`` / ``v_scale``, the bytes
            `kv_quant.quantize_kv` gives).
        q_norm_weight / k_norm_weight: ``[head_dim]`` gains (any float dtype) of a per-head
            RMSNorm applied to every q / k head before the rotation (Qwen3's and Gemma 3's
            QK-norm), in the same launch; both or neither, with ``k``, and only for
            ``rotary_dim == head_dim``. Each head becomes ``x * rsqrt(mean(x**2) + eps) *
            (w + weight_offset)`` (float32, rounded to q's / k's dtype) exactly as
            `rmsnorm` computes it, and is then rotated and stored as above: the result is
            `rmsnorm` then this function without the norm, bit for bit where both reduce
            the sum of squares in the same order (the tile is sized for that).
        eps / weight_offset: the norm's epsilon and gain offset (0.0, or 1.0 for Gemma's
            ``(1 + w)``); ignored without norm weights.

    Grid ``(T, q head blocks + k head blocks [+ v head blocks])``.

    Raises:
        ValueError: unsupported layout (see `rope_layout_supported`), table shape, or a
            ``kv_store`` whose shapes do not match ``k`` (or with one FP8 and one non-FP8
            cache, or an FP8 scale <= 0 / non-finite); norm weights given for one of q / k
            only, without ``k``, with ``rotary_dim < head_dim`` or not of shape ``[head_dim]``.
    """
    layouts = _rope_layouts(q, k, head_dim)
    if layouts is None:
        raise ValueError(f"rotary_embedding_inplace: unsupported q {tuple(q.shape)}/{q.stride()} or k layout")
    if rotary_dim % 2 or rotary_dim > head_dim or cos_sin_cache.shape[-1] != rotary_dim:
        raise ValueError(
            f"rotary_embedding_inplace: rotary_dim={rotary_dim}, head_dim={head_dim}, "
            f"cos_sin_cache {tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding_inplace: cos_sin_cache must have a contiguous last dim")
    t = q.shape[0]
    if t == 0:
        return
    (hq, q_st, q_sh), k_heads = layouts
    quant = {}
    if k is not None:
        hk, k_st, k_sh = k_heads
    else:
        k, hk, k_st, k_sh = q, 0, 0, 0
    half = rotary_dim // 2
    block_r = _next_pow2(half)
    block_h = max(1, min(_next_pow2(max(hq, hk)), 1024 // block_r))
    norm = {}
    if q_norm_weight is not None or k_norm_weight is not None:
        norm = _qk_norm_args(q_norm_weight, k_norm_weight, hk, head_dim, rotary_dim, eps, weight_offset)
        block_h = max(block_h, _QK_NORM_TILE // norm["BLOCK_D"])
    nq = -(-hq // block_h)
    nk = -(-hk // block_h)
    if kv_store is None:
        store_args = (q, q, q, q, 0, 0, 0, 0, 0, 0)
        nv, dv, block_pass, block_dv = 0, 0, 0, 1
    else:
        if hk == 0:
            raise ValueError("rotary_embedding_inplace: kv_store needs k")
        value, k_buf, v_buf, loc = kv_store.value, kv_store.k_buffer, kv_store.v_buffer, kv_store.loc
        dv = v_buf.shape[-1]
        vl = _rope_heads(value, dv)
        if (
            vl is None or vl[0] != hk or value.shape[0] != t or k_buf.dim() != 3 or v_buf.dim() != 3
            or tuple(k_buf.shape[1:]) != (hk, head_dim) or v_buf.shape[1] != hk or k_buf.stride(-1) != 1
            or v_buf.stride(-1) != 1 or loc.dim() != 1 or loc.shape[0] != t or loc.device != q.device
        ):
            raise ValueError(
                f"rotary_embedding_inplace: kv_store does not match k ({hk} heads of {head_dim}, {t} tokens): "
                f"value {tuple(value.shape)}, k_buffer {tuple(k_buf.shape)}, v_buffer {tuple(v_buf.shape)}, "
                f"loc {tuple(loc.shape)}"
            )
        store_args = (loc, value, k_buf, v_buf, vl[1], vl[2], k_buf.stride(0), k_buf.stride(1),
                      v_buf.stride(0), v_buf.stride(1))
        block_dv = _next_pow2(dv)
        nv = -(-hk // block_h)
        block_pass = _next_pow2(head_dim - rotary_dim) if head_dim > rotary_dim else 0
        quant = _quant_args(k_buf.dtype, v_buf.dtype, kv_store.k_scale, kv_store.v_scale)
    _kernels()._rope_kernel[(t, nq + nk + nv)](
        positions, q, k, cos_sin_cache, q_st, q_sh, k_st, k_sh, cos_sin_cache.stride(0), hq, hk, nq,
        *store_args, nk, head_dim, dv,
        HALF=half, BLOCK_R=block_r, BLOCK_H=block_h, IS_NEOX=bool(is_neox), STORE_KV=kv_store is not None,
        BLOCK_PASS=block_pass, BLOCK_DV=block_dv, num_warps=4, **quant, **norm, **_pdl_args(q.device),
    )


#: least elements of the fused QK-norm's ``[BLOCK_H, BLOCK_D]`` row tile: with the rope
#: kernel's 4 warps that is 8 elements a thread, so a 16-bit row is read in 8-element
#: vectors and summed in the per-row order of the stand-alone `rmsnorm` tiles (4096
#: elements over 8 warps: 16 a thread, vectors of 8 as well), which gives bit-identical
#: norms; fewer elements would shorten the vectors and change that order
_QK_NORM_TILE = 1024


def _qk_norm_args(q_w: Optional[torch.Tensor], k_w: Optional[torch.Tensor], hk: int, head_dim: int,
                  rotary_dim: int, eps: float, weight_offset: float) -> dict:
    """The rope kernel's QK-norm arguments, after checking them (see
    `rotary_embedding_inplace` for the rules and errors)."""
    if q_w is None or k_w is None or hk == 0:
        raise ValueError("rotary_embedding_inplace: the fused QK-norm needs q_norm_weight, k_norm_weight and k")
    if rotary_dim != head_dim:
        raise ValueError(f"rotary_embedding_inplace: the fused QK-norm needs rotary_dim == head_dim "
                         f"({rotary_dim} != {head_dim})")
    if tuple(q_w.shape) != (head_dim,) or tuple(k_w.shape) != (head_dim,):
        raise ValueError(f"rotary_embedding_inplace: norm weights {tuple(q_w.shape)} / {tuple(k_w.shape)} "
                         f"must be [{head_dim}]")
    return dict(q_norm_ptr=q_w.contiguous(), k_norm_ptr=k_w.contiguous(), eps=float(eps),
                w_offset=float(weight_offset), HAS_QK_NORM=True, BLOCK_D=_next_pow2(head_dim))


def _quant_args(k_dtype: torch.dtype, v_dtype: torch.dtype, k_scale: float, v_scale: float) -> dict:
    """The fused RoPE + store kernel's quantisation arguments for caches of ``k_dtype`` /
    ``v_dtype``: none for 16/32-bit caches; inverse scales and the saturation bound for FP8.

    Raises:
        ValueError: only one of the two caches is FP8, or a scale <= 0 / non-finite.
    """
    if is_fp8(k_dtype) != is_fp8(v_dtype):
        raise ValueError(f"rotary_embedding_inplace: K and V caches must both be FP8 or neither ({k_dtype}, {v_dtype})")
    if not is_fp8(k_dtype):
        return {}
    return dict(k_inv_scale=1.0 / check_scale("k_scale", k_scale), v_inv_scale=1.0 / check_scale("v_scale", v_scale),
                max_val=fp8_max(k_dtype), QUANT=True)


def _act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1 or (x.dim() != 2 and not x.is_contiguous()):
        x = x.contiguous()
    rows = out.numel() // d
    row_stride = x.stride(0) if x.dim() == 2 else x.shape[-1]
    block = min(_next_pow2(d), 1024)
    _kernels()._act_and_mul_kernel[(rows, -(-d // block))](x, row_stride, out, d, d, BLOCK=block, ACT=act, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: ``[..., 2I]`` = ``[gate | up]`` -> ``silu(gate) * up`` ``[..., I]``.

    One launch, float32 math, output in ``x``'s dtype. 2-D inputs may have any row stride.
    """
    return _act_and_mul(x, 0)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU gate with GELU's tanh approximation (Hendrycks & Gimpel, arXiv:1606.08415):
    ``[..., 2I]`` = ``[gate | up]`` -> ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up``.

    One launch, float32 math, output in ``x``'s dtype.
    """
    return _act_and_mul(x, 1)
