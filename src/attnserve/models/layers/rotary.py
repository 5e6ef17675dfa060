"""Rotary position embedding (RoPE; Su et al., RoFormer, arXiv:2104.09864).

A `RotaryEmbedding` builds its cos/sin table once, for positions ``0 .. max_position-1``,
and applies it by gathering rows with the step's ``positions`` tensor: no host sync and no
data-dependent Python branching, so it can be captured in a CUDA graph.

Frequency schedules (``rope_type``):

* ``default`` -- ``inv_freq[i] = base ** (-2i / rotary_dim)``.
* ``linear`` -- position interpolation (Chen et al., arXiv:2306.15595): ``inv_freq / factor``.
* ``llama3`` -- Llama 3.1's wavelength-dependent scaling, as in Meta's reference
  implementation (``apply_scaling`` in meta-llama/llama-models): wavelengths shorter than
  ``original_max_position_embeddings / high_freq_factor`` are kept, those longer than
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and
  the band between is interpolated linearly in ``original_max / wavelength``.
* ``yarn`` -- YaRN (Peng et al., arXiv:2309.00071), as DeepSeek-V2/V3 configure it: the
  inverse frequencies blend interpolation (``inv_freq / factor``) and extrapolation
  (``inv_freq``) with a linear ramp over the channels whose number of rotations within
  ``original_max_position_embeddings`` lies between ``beta_slow`` and ``beta_fast``; the
  cos/sin table is multiplied by an attention factor (`yarn_attention_factor`), and
  DeepSeek additionally multiplies the softmax scale by ``yarn_get_mscale(factor,
  mscale_all_dim) ** 2`` (`yarn_softmax_mscale`; applied by the model, not here).
* ``longrope`` -- LongRoPE (Ding et al., arXiv:2402.13753), as Phi-3/3.5/4 configure it:
  ``inv_freq[i] = 1 / (ext[i] * base ** (2i / rotary_dim))`` with ``ext`` the config's
  ``short_factor`` or ``long_factor`` list, the cos/sin table multiplied by
  `longrope_attention_factor`. HF transformers picks the long factors for a whole forward
  when its sequence is longer than ``original_max_position_embeddings``
  (``dynamic_rope_update``); `LongRoPERotaryEmbedding` holds both tables and
  `LongRoPERotaryEmbedding.table_positions` makes the same choice per request.

A ``rope_type`` outside these (``dynamic``, ``su`` outside Phi-3 ...) is refused by `get_rope`
with the list of supported ones: a scaling the table does not apply is never ignored.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from attnserve.mem_cache.kv_quant import quantize_kv
from attnserve.models.layers.fused_kernels import (
    KVStoreTarget,
    FusedKernelUser,
    rope_layout_supported,
    rotary_embedding_inplace,
)

DEFAULT_ROPE_THETA = 10000.0


def _inv_freq_default(rotary_dim: int, base: float, params: Mapping[str, Any]) -> torch.Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponent)


def _inv_freq_linear(rotary_dim: int, base: float, params: Mapping[str, Any]) -> torch.Tensor:
    return _inv_freq_default(rotary_dim, base, params) / float(params["factor"])


def _inv_freq_llama3(rotary_dim: int, base: float, params: Mapping[str, Any]) -> torch.Tensor:
    inv_freq = _inv_freq_default(rotary_dim, base, params)
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_ctx = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(in_band, blended, out)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``).

    arXiv:2309.00071 eq. for ``sqrt(1/t)``; DeepSeek-V2 passes its ``mscale`` /
    ``mscale_all_dim`` config values as ``mscale``.
    """
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(params: Mapping[str, Any]) -> Tuple[float, float]:
    """(factor, original_max_position_embeddings); a missing factor is
    ``max_position_embeddings / original_max_position_embeddings`` (as transformers does)."""
    orig = params.get("original_max_position_embeddings") or params.get("max_position_embeddings")
    if orig is None:
        raise ValueError("yarn RoPE needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = float(params["max_position_embeddings"]) / float(orig)
    return float(factor), float(orig)


def yarn_attention_factor(params: Mapping[str, Any]) -> float:
    """Multiplier of YaRN's cos/sin table (so of both q and k): ``attention_factor`` when
    given; else ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)``
    when both are set (DeepSeek), else ``yarn_get_mscale(factor)``. Follows transformers'
    ``_compute_yarn_parameters`` (read, not copied)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, _ = _yarn_factor(params)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(factor, float(mscale_all_dim))
    return yarn_get_mscale(factor)


def yarn_softmax_mscale(params: Mapping[str, Any]) -> float:
    """Factor DeepSeek-V2/V3 apply to the softmax scale: ``yarn_get_mscale(factor,
    mscale_all_dim) ** 2`` for a scaled RoPE (``rope_type != "default"``) with a non-zero
    ``mscale_all_dim``, else 1 (DeepSeek's reference ``softmax_scale *= mscale * mscale``)."""
    rope_type = params.get("rope_type", params.get("type")) or "default"
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if rope_type == "default" or not mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(_yarn_factor(params)[0], float(mscale_all_dim))
    return m * m


def _inv_freq_yarn(rotary_dim: int, base: float, params: Mapping[str, Any]) -> torch.Tensor:
    factor, orig = _yarn_factor(params)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def channel(num_rotations: float) -> float:
        # channel pair whose wavelength fits ``num_rotations`` times into ``orig`` tokens
        return rotary_dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = channel(beta_fast), channel(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (fast channels), 0: interpolate
    pos_freq = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim)
    return (1.0 / (factor * pos_freq)) * (1 - extrapolate) + (1.0 / pos_freq) * extrapolate


def _longrope_factor_list(params: Mapping[str, Any], key: str, rotary_dim: int) -> torch.Tensor:
    values = params.get(key)
    if values is None or len(values) != rotary_dim // 2:
        got = "missing" if values is None else f"{len(values)} values"
        raise ValueError(f"longrope RoPE needs {key} with rotary_dim / 2 = {rotary_dim // 2} values; {got}")
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


def _longrope_original_max(params: Mapping[str, Any]) -> int:
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise ValueError("longrope RoPE needs original_max_position_embeddings")
    return int(orig)


def _inv_freq_longrope(rotary_dim: int, base: float, params: Mapping[str, Any],
                       key: str = "short_factor") -> torch.Tensor:
    # same operation order as transformers' _compute_longrope_parameters (read, not copied), so
    # the float32 frequencies are bit-identical: 1 / (ext * base ** (2i / d))
    ext = _longrope_factor_list(params, key, rotary_dim)
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (ext * base**exponent)


def longrope_attention_factor(params: Mapping[str, Any]) -> float:
    """Multiplier of LongRoPE's cos/sin tables (both): ``attention_factor`` when given; else
    with ``factor`` (default ``max_position_embeddings / original_max_position_embeddings``,
    as Phi-3 configs leave it out) ``sqrt(1 + ln(factor) / ln(original_max))``, or 1 for
    ``factor <= 1`` (transformers' ``_compute_longrope_parameters``; LongRoPE paper)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    orig = _longrope_original_max(params)
    factor = params.get("factor")
    if factor is None:
        factor = float(params["max_position_embeddings"]) / orig
    factor = float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


#: rope_type -> function(rotary_dim, base, params) -> float32 ``[rotary_dim // 2]`` inverse
#: frequencies in radians per position. Static table; add a schedule with one line.
ROPE_INV_FREQ: Dict[str, Callable[[int, float, Mapping[str, Any]], torch.Tensor]] = {
    "default": _inv_freq_default,
    "linear": _inv_freq_linear,
    "llama3": _inv_freq_llama3,
    "yarn": _inv_freq_yarn,
    # the short-factor table; `get_rope` builds a `LongRoPERotaryEmbedding` with both
    "longrope": _inv_freq_longrope,
}

#: rope_type -> function(params) -> multiplier of the cos/sin table (1 when absent).
ROPE_ATTENTION_FACTOR: Dict[str, Callable[[Mapping[str, Any]], float]] = {
    "yarn": yarn_attention_factor,
    "longrope": longrope_attention_factor,
}


def rope_parameters_from_config(config: Any, layer_type: Optional[str] = None) -> Dict[str, Any]:
    """RoPE settings of an HF config as one flat dict with ``rope_theta`` and ``rope_type``.

    Handles transformers >= 5 (``config.rope_parameters``, possibly keyed by layer type as
    in Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``) and older
    configs (``config.rope_theta`` + ``config.rope_scaling`` with ``type`` or ``rope_type``).

    Args:
        config: an HF ``PretrainedConfig`` or any object with those attributes.
        layer_type: key into per-layer-type ``rope_parameters`` (e.g. ``"full_attention"``).

    Returns:
        dict with at least ``rope_theta`` (float) and ``rope_type`` (str), plus the
        schedule's own keys (``factor``, ``low_freq_factor`` ...).

    Raises:
        ValueError: when the parameters are keyed by layer type and ``layer_type`` is
            missing or unknown.
    """
    params = getattr(config, "rope_parameters", None)
    if params and all(isinstance(v, Mapping) for v in params.values()):
        if layer_type not in params:
            raise ValueError(f"rope_parameters are per layer type {sorted(params)}; got layer_type={layer_type!r}")
        params = params[layer_type]
    out: Dict[str, Any] = {}
    scaling = getattr(config, "rope_scaling", None)
    if not params and scaling:
        out.update(scaling)
    if params:
        out.update(params)
    if "rope_theta" not in out:
        theta = getattr(config, "rope_theta", None)
        out["rope_theta"] = float(theta) if theta is not None else DEFAULT_ROPE_THETA
    out["rope_type"] = out.get("rope_type", out.get("type")) or "default"
    return out


class RotaryEmbedding(nn.Module, FusedKernelUser):
    """Applies RoPE to query and key heads, gathering a precomputed cos/sin table.

    Args:
        head_dim: size of each head.
        rotary_dim: leading channels of each head that are rotated (``<= head_dim``;
            the rest pass through).
        max_position: table length; positions must lie in ``[0, max_position)``
            (out-of-range positions raise on CPU and are undefined on GPU).
        base: RoPE base (``rope_theta``).
        is_neox_style: True pairs channel ``i`` with ``i + rotary_dim/2`` ("rotate_half",
            HF Llama after llama.cpp's permutation is undone); False pairs ``2i`` with
            ``2i+1`` (GPT-J / RoFormer's original interleaving).
        inv_freq: optional float32 ``[rotary_dim // 2]`` inverse frequencies (radians per
            position); default ``base ** (-2i / rotary_dim)``.
        cos_sin_scale: multiplier of the cos/sin table (YaRN's attention factor; 1.0 = plain
            rotation).

    Buffer ``cos_sin_cache``: float32 ``[max_position, rotary_dim]`` = ``[cos | sin]`` of
    ``position * inv_freq``; not saved in ``state_dict``. It stays float32 when the module
    is cast (``.to(torch.bfloat16)`` moves it between devices but keeps its dtype).

    On CUDA tensors (``use_fused``, `FusedKernelUser`) one
    Triton launch rotates q and k in place (`fused_kernels.rotary_embedding_inplace`); the
    PyTorch code is the reference and the CPU path.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        inv_freq: Optional[torch.Tensor] = None,
        cos_sin_scale: float = 1.0,
    ):
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_dim={head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = float(base)
        self.is_neox_style = is_neox_style
        self.cos_sin_scale = float(cos_sin_scale)
        if inv_freq is None:
            inv_freq = _inv_freq_default(rotary_dim, self.base, {})
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device=t.device, dtype=torch.float32))
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if self.cos_sin_scale != 1.0:
            cache = cache * self.cos_sin_scale
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._cos_sin_last = None  # (key, (cos, sin)) of the last `_cos_sin` lookup
        self.init_fused(True)

    def _apply(self, fn, *args, **kwargs):
        # `.to(bfloat16)` / `.half()` on the model must not round the table: keep float32 and
        # follow only device moves.
        table = self.cos_sin_cache
        super()._apply(fn, *args, **kwargs)
        if self.cos_sin_cache.dtype != torch.float32 and table.dtype == torch.float32:
            self.cos_sin_cache = table.to(self.cos_sin_cache.device)
        return self

    def _cos_sin(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` ``[T, 1, rotary_dim // 2]`` of ``positions``; every layer of a
        step passes the same positions tensor (one table shared by the model), so the last
        lookup is reused while that tensor is unchanged. CPU only: on CUDA a reused lookup
        would leave the lookup out of a CUDA graph captured after an eager warm-up."""
        key = None
        if not positions.is_cuda:
            key = (positions, positions._version, self.cos_sin_cache.data_ptr())
            cached = self._cos_sin_last
            if cached is not None and cached[0][0] is key[0] and cached[0][1:] == key[1:]:
                return cached[1]
        cos, sin = self.cos_sin_cache.index_select(0, positions).float().unsqueeze(1).chunk(2, dim=-1)
        if key is not None:
            self._cos_sin_last = (key, (cos, sin))
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_dim)
        rot = x[..., : self.rotary_dim].float()
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        out = out.to(x.dtype)
        if self.rotary_dim < self.head_dim:
            out = torch.cat([out, x[..., self.rotary_dim :]], dim=-1)
        return out.reshape(shape)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        kv_store: Optional[KVStoreTarget] = None,
        q_norm_weight: Optional[torch.Tensor] = None,
        k_norm_weight: Optional[torch.Tensor] = None,
        eps: float = 1e-6,
        weight_offset: float = 0.0,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Rotate ``query`` and ``key`` by their tokens' positions.

        Args:
            positions: int64 ``[T]`` absolute positions.
            query: ``[T, Hq * head_dim]`` or ``[T, Hq, head_dim]``.
            key: ``[T, Hk * head_dim]`` or ``[T, Hk, head_dim]``, or None.
            kv_store: also write the rotated key and ``kv_store.value`` into the KV cache
                rows ``kv_store.loc`` (`RadixAttention.kv_store_target`; an FP8 cache is
                quantised with ``kv_store.k_scale`` / ``v_scale``); needs ``key``. On the
                fused path this is the same launch as the rotation; otherwise the rows are
                written after it with ``index_put``.
            q_norm_weight / k_norm_weight / eps / weight_offset: normalise every q and k
                head with this per-head RMSNorm (``x * rsqrt(mean(x**2) + eps) * (w +
                weight_offset)``, Qwen3's / Gemma 3's QK-norm) before rotating it, in the
                same launch (`fused_kernels.rotary_embedding_inplace`). Fused path only:
                callers check `qk_norm_fusable` first and otherwise run their norm modules
                and then this method without these arguments.

        Returns:
            ``(query, key)`` rotated, same shapes and dtypes (math in float32): new tensors on
            the PyTorch path; on the fused CUDA path the given tensors (or the views into a
            fused qkv output) rotated in place and returned.
        """
        if kv_store is not None and key is None:
            raise ValueError("RotaryEmbedding: kv_store needs a key to store")
        if q_norm_weight is not None or k_norm_weight is not None:
            if not self.qk_norm_fusable(query, key):
                raise ValueError("RotaryEmbedding: norm weights need the fused path (see qk_norm_fusable)")
            rotary_embedding_inplace(
                positions, query, key, self.cos_sin_cache, self.head_dim, self.rotary_dim, self.is_neox_style,
                kv_store=kv_store, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps,
                weight_offset=weight_offset,
            )
            return query, key
        if self.use_fused and query.is_cuda and rope_layout_supported(query, key, self.head_dim):
            rotary_embedding_inplace(
                positions, query, key, self.cos_sin_cache, self.head_dim, self.rotary_dim, self.is_neox_style,
                kv_store=kv_store,
            )
            return query, key
        cos, sin = self._cos_sin(positions)
        if key is not None and _adjacent_columns(query, key):
            # q and k side by side in one qkv output: one rotation over both (half the ops)
            qk = query.as_strided((query.shape[0], query.shape[1] + key.shape[1]), query.stride())
            query, key = self._rotate(qk, cos, sin).split([query.shape[1], key.shape[1]], dim=-1)
            if query.is_cuda:  # the Triton backends want dense rows; the CPU path views them
                query, key = query.contiguous(), key.contiguous()
        else:
            query = self._rotate(query, cos, sin)
            if key is not None:
                key = self._rotate(key, cos, sin)
        if kv_store is not None:
            k_buf, v_buf = kv_store.k_buffer, kv_store.v_buffer
            k_rows = key.reshape(key.shape[0], *k_buf.shape[1:])
            v_rows = kv_store.value.reshape(key.shape[0], *v_buf.shape[1:])
            k_buf[kv_store.loc] = quantize_kv(k_rows, kv_store.k_scale, k_buf.dtype)
            v_buf[kv_store.loc] = quantize_kv(v_rows, kv_store.v_scale, v_buf.dtype)
        return query, key

    def qk_norm_fusable(self, query: torch.Tensor, key: Optional[torch.Tensor]) -> bool:
        """Whether `forward` can normalise ``query`` / ``key`` per head in its rotation launch:
        the fused path is on, the tensors are on CUDA in a layout the kernel rotates in place
        (`fused_kernels.rope_layout_supported`), there is a key, and every channel rotates
        (``rotary_dim == head_dim``; a partial rotation would leave normalised pass-through
        channels to write)."""
        return (self.use_fused and query.is_cuda and key is not None and self.rotary_dim == self.head_dim
                and rope_layout_supported(query, key, self.head_dim))

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"base={self.base}, neox={self.is_neox_style}"
            + (f", cos_sin_scale={self.cos_sin_scale}" if self.cos_sin_scale != 1.0 else "")
        )


def _adjacent_columns(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether 2-D ``a`` and ``b`` are consecutive column blocks of one row-major tensor
    (``b``'s columns start right after ``a``'s in every row), e.g. q and k of a fused qkv."""
    return (
        a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[0] and a.dtype == b.dtype
        and a.device == b.device and a.stride() == b.stride() and a.stride(1) == 1
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # not two tensors side by side
        and b.data_ptr() == a.data_ptr() + a.shape[1] * a.element_size()
    )


class LongRoPERotaryEmbedding(RotaryEmbedding):
    """LongRoPE: a `RotaryEmbedding` whose table holds the short-factor rotation of positions
    ``0 .. max_position-1`` in rows ``0 .. max_position-1`` and the long-factor rotation of
    the same positions in rows ``max_position .. 2*max_position-1``.

    Args:
        head_dim, rotary_dim, max_position, base, is_neox_style: as `RotaryEmbedding`.
        short_inv_freq / long_inv_freq: float32 ``[rotary_dim // 2]``.
        original_max_position: ``original_max_position_embeddings``: a request whose
            sequence is longer uses the long factors.
        cos_sin_scale: `longrope_attention_factor` (both tables).

    Buffer ``cos_sin_cache``: float32 ``[2 * max_position, rotary_dim]``. The model passes
    `table_positions` (not the token positions) to `forward`; both the PyTorch path and the
    fused kernel only gather rows, so nothing else changes (CUDA-graph safe).
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 short_inv_freq: torch.Tensor, long_inv_freq: torch.Tensor, original_max_position: int,
                 cos_sin_scale: float = 1.0, is_neox_style: bool = True):
        super().__init__(head_dim, rotary_dim, max_position, base, is_neox_style, short_inv_freq, cos_sin_scale)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, long_inv_freq.to(device=t.device, dtype=torch.float32))
        long_table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if self.cos_sin_scale != 1.0:
            long_table = long_table * self.cos_sin_scale
        self.cos_sin_cache = torch.cat([self.cos_sin_cache, long_table.to(self.cos_sin_cache.device)])
        self.original_max_position = int(original_max_position)

    def use_long_factors(self, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        """bool ``[T]``: whether each token is rotated with the long factors.

        transformers (``dynamic_rope_update`` -> ``longrope_frequency_update``) uses the long
        factors for every position of a forward whose ``max(position_ids) + 1`` exceeds
        ``original_max_position_embeddings``; with its KV cache, keys keep the rotation of
        the forward that computed them (HF's Phi-3 ``generate`` then recomputes the cache
        once at the crossing; see `attnserve.models.phi3`). Per request of the step this
        is: extend (prefill, mixed, draft extend) tokens use the long factors iff their
        request's ``seq_lens`` (cached + new tokens) exceeds it; decode and verify tokens
        iff their own ``position + 1`` does (one token per request in decode; no host sync,
        so decode steps can be captured in CUDA graphs).
        """
        mode = forward_batch.forward_mode
        seq_lens, extend_lens = forward_batch.seq_lens, forward_batch.extend_seq_lens
        if mode.is_decode_or_idle() or mode.is_target_verify() or seq_lens is None or extend_lens is None:
            seq_end = positions + 1
        else:
            seq_end = torch.repeat_interleave(seq_lens.to(positions.device), extend_lens.to(positions.device),
                                              output_size=positions.shape[0])
        return seq_end > self.original_max_position

    def table_positions(self, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        """int64 ``[T]`` rows of ``cos_sin_cache`` for ``positions`` (int64 ``[T]``):
        ``position`` (short factors) or ``max_position + position`` (long factors), chosen by
        `use_long_factors`."""
        # a normal tensor even under inference mode: `_cos_sin` keys its per-step reuse on the
        # version counter, which inference tensors lack (reading them here is allowed)
        with torch.inference_mode(False):
            long = self.use_long_factors(positions, forward_batch)
            return positions + long.to(positions.dtype) * self.max_position

    def extra_repr(self) -> str:
        return super().extra_repr() + f", longrope original_max_position={self.original_max_position}"


def get_rope(
    head_dim: int,
    max_position: int,
    rope_parameters: Mapping[str, Any],
    rotary_dim: Optional[int] = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """Build a `RotaryEmbedding` from flat RoPE parameters (see `rope_parameters_from_config`).

    Args:
        head_dim: size of each head.
        max_position: cos/sin table length (the model's context length).
        rope_parameters: ``rope_theta``, ``rope_type`` (one of `ROPE_INV_FREQ`) and the
            schedule's keys (``factor``; for llama3 also ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``; for yarn
            ``original_max_position_embeddings`` (default ``max_position``),
            ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
            ``attention_factor``, ``truncate``; for longrope ``short_factor``,
            ``long_factor``, ``original_max_position_embeddings``, optionally ``factor`` /
            ``attention_factor``: a `LongRoPERotaryEmbedding` is returned).
        rotary_dim: rotated channels per head (default ``head_dim``; with
            ``partial_rotary_factor`` in the parameters, ``head_dim * factor``).
        is_neox_style: see `RotaryEmbedding`.

    Raises:
        ValueError: for an unsupported ``rope_type`` (the message lists supported ones), or
            longrope parameters that are missing or of the wrong length.
    """
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type")) or "default"
    if rope_type not in ROPE_INV_FREQ:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(sorted(ROPE_INV_FREQ))}")
    if rotary_dim is None:
        rotary_dim = int(head_dim * float(rope_parameters.get("partial_rotary_factor", 1.0)))
    base = float(rope_parameters.get("rope_theta", DEFAULT_ROPE_THETA))
    params = dict(rope_parameters)
    params.setdefault("max_position_embeddings", max_position)
    inv_freq = ROPE_INV_FREQ[rope_type](rotary_dim, base, params)
    scale = ROPE_ATTENTION_FACTOR[rope_type](params) if rope_type in ROPE_ATTENTION_FACTOR else 1.0
    if rope_type == "longrope":
        long_inv_freq = _inv_freq_longrope(rotary_dim, base, params, key="long_factor")
        return LongRoPERotaryEmbedding(head_dim, rotary_dim, max_position, base, inv_freq, long_inv_freq,
                                       _longrope_original_max(params), scale, is_neox_style)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, is_neox_style, inv_freq, cos_sin_scale=scale)
