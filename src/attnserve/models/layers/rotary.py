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
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

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


#: rope_type -> function(rotary_dim, base, params) -> float32 ``[rotary_dim // 2]`` inverse
#: frequencies in radians per position. Static table; add a schedule with one line.
ROPE_INV_FREQ: Dict[str, Callable[[int, float, Mapping[str, Any]], torch.Tensor]] = {
    "default": _inv_freq_default,
    "linear": _inv_freq_linear,
    "llama3": _inv_freq_llama3,
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


class RotaryEmbedding(nn.Module):
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

    Buffer ``cos_sin_cache``: float32 ``[max_position, rotary_dim]`` = ``[cos | sin]`` of
    ``position * inv_freq``; not saved in ``state_dict``. It stays float32 when the module
    is cast (``.to(torch.bfloat16)`` moves it between devices but keeps its dtype).
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        inv_freq: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_dim={head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = float(base)
        self.is_neox_style = is_neox_style
        if inv_freq is None:
            inv_freq = _inv_freq_default(rotary_dim, self.base, {})
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device=t.device, dtype=torch.float32))
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        # `.to(bfloat16)` / `.half()` on the model must not round the table: keep float32 and
        # follow only device moves.
        table = self.cos_sin_cache
        super()._apply(fn, *args, **kwargs)
        if self.cos_sin_cache.dtype != torch.float32 and table.dtype == torch.float32:
            self.cos_sin_cache = table.to(self.cos_sin_cache.device)
        return self

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
        self, positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Rotate ``query`` and ``key`` by their tokens' positions.

        Args:
            positions: int64 ``[T]`` absolute positions.
            query: ``[T, Hq * head_dim]`` or ``[T, Hq, head_dim]``.
            key: ``[T, Hk * head_dim]`` or ``[T, Hk, head_dim]``, or None.

        Returns:
            ``(query, key)`` rotated, same shapes and dtypes (new tensors; math in float32).
        """
        cos_sin = self.cos_sin_cache.index_select(0, positions).float()
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim // 2] each
        query = self._rotate(query, cos, sin)
        if key is not None:
            key = self._rotate(key, cos, sin)
        return query, key

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"base={self.base}, neox={self.is_neox_style}"
        )


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
            ``high_freq_factor``, ``original_max_position_embeddings``).
        rotary_dim: rotated channels per head (default ``head_dim``; with
            ``partial_rotary_factor`` in the parameters, ``head_dim * factor``).
        is_neox_style: see `RotaryEmbedding`.

    Raises:
        ValueError: for an unsupported ``rope_type`` (the message lists supported ones).
    """
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type")) or "default"
    if rope_type not in ROPE_INV_FREQ:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(sorted(ROPE_INV_FREQ))}")
    if rotary_dim is None:
        rotary_dim = int(head_dim * float(rope_parameters.get("partial_rotary_factor", 1.0)))
    base = float(rope_parameters.get("rope_theta", DEFAULT_ROPE_THETA))
    inv_freq = ROPE_INV_FREQ[rope_type](rotary_dim, base, rope_parameters)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, is_neox_style, inv_freq)
