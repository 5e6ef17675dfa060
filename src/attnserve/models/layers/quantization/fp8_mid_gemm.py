"""FP8-weight mid-size GEMM for ``16 < M <= 256`` rows (decode batches; issue 37).

At 64 rows ``torch._scaled_mm`` streams an FP8 weight at only 0.35-0.46 of an H100's 3.0
TB/s copy rate (o_proj 4096 x 4096: 16.2 µs for 16.8 MB): cuBLAS launches too few CTAs at
these shapes. `fp8_mid_linear` runs the swapped-operand tile of `mid_gemm` (every weight
byte read once, the rows as the narrow tensor-core operand) on the e4m3 weight, with split-K
so that a projection covers the 132 SMs several times (`fp8_mid_gemm_triton` has the
kernel). Two operand modes:

* ``"w8a16"``: 16-bit activations, the weight widened in registers (no quantiser launch);
* ``"w8a8"``: e4m3 activations with a per-token float32 scale (from `quantize_activation`,
  or fused into the producer: `fused_inputs`), e4m3 x e4m3 ``tl.dot``.

Weight scales: one per output row (``[N]``, a per-tensor checkpoint's scale repeated, as
`Fp8LinearMethod` stores them) or one scalar; applied in the epilogue with the token scale,
then the optional bias and gate (``[gate | up]`` weight, SiLU / GELU-tanh), output 16-bit.

**Routing** (`fp8_mid_route`, through `fp8_mid_apply`, called from `Fp8LinearMethod`), by
``ATTNSERVE_FP8_MID_GEMM`` (`fp8_mid_setting`):

* unset / ``auto`` (the default): W8A8 for ``33 <= M <= 64`` rows (`DEFAULT_MIN_M` ..
  `DEFAULT_MAX_M`) of the weight shapes measured faster than ``_scaled_mm`` on this GPU
  (`FP8_MID_DEFAULT_W8A8`: exact ``[N, K]`` per device; H100 80GB HBM3: the four
  Llama-3-8B projections, H200: its ``qkv`` and ``gate_up``); everything else keeps
  ``_scaled_mm``. Measured on one H100
  (``fp8_bench.py --parts gemm --sweep``, CUDA-graph replay over rotating weights, µs at 64
  rows, ``_scaled_mm`` on producer-quantised rows vs this kernel's best tile on the same):
  qkv 15.4 / 14.3, o 13.9 / 12.7, gate_up 54.9 / 47.8 (SiLU-and-mul fused here; ``_scaled_mm``
  leaves it to a separate kernel), down 37.9 / 29.3. From 128 rows on the kernel loses
  (qkv 14.7 / 19.9, down 37.1 / 34.4 but gate_up 53.8 / 58.1), so the default stops at 64;
  17..32 rows were not measured.
* ``off`` / ``0`` / ``none``: never.
* ``w8a16`` / ``w8a8``: that mode for ``16 < M <= 256`` rows and every shape, tiles from
  `FP8_MID_TABLE` (for A/B runs). ``w8a16`` also keeps the fused producers from quantising
  those batches (`fused_inputs.emits_fp8`).

Either way only for dynamic activation scales with fused kernels on. The route is a pure
function of the environment, the device and the shapes, so a CUDA graph captured at ``M``
rows takes the path an eager step of ``M`` rows takes. A gated ``gate_up`` (``[gate | up]``
weight) returns ``act(gate) * up`` from the epilogue; `Fp8LinearMethod` then quantises it per
token for ``down_proj`` (`quantize_activation`) where ``_scaled_mm`` would run the fused
SiLU-and-mul quantiser.

**PDL form** (``MidGemmConfig.pdl`` / ``prefetch``, any split-K; a table tuple's 7th / 8th
fields): the first ``K`` step's weight tiles are loaded, and the L2 hinted, while the kernel
before it still runs (`attnserve.pdl`; same bits). Opt-in per tile and in no default entry:
timed behind the real producers on one H200 it gained at most 0.5 µs a call and lost on
``down`` (``benchmarks/fp8_routes.py``, benchmarks/NOTES.md 2026-11-28, seventeenth).

**Configs**: `FP8_MID_TABLE`, by weight shape class (`fp8_mid_shape_class`) and ``M``
bucket (smallest of 32 / 64 / 128 / 256 at least ``M``), with `FP8_MID_MODE_OVERRIDES`
per mode; ``benchmarks/fp8_bench.py --parts gemm --sweep`` times `fp8_mid_candidates`
and prints the best per shape, M and mode in this table's form (``--sweep wide``: a wider
W8A8 grid, ``benchmarks/fp8_mid_sweep.py``). The launcher allocates its output; with
split-K it takes its float32 workspace and counters from a `SplitKWorkspace` (the model's,
through `Fp8LinearMethod`: allocated zeroed once, left zeroed by every launch, so no memset
per call) or, without one, allocates a zeroed buffer (one memset). It never reads device
values on the host and is CUDA-graph capturable. Triton is imported lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Dict, List, Optional, Tuple

import torch

from attnserve.models.layers.mid_gemm import MAX_MID_M, MIN_MID_M, MidGemmConfig, _next_pow2, m_pieces, table_key
from attnserve.models.layers.skinny_gemm import SKINNY_ACTIVATIONS
from attnserve.models.layers.split_k_workspace import SplitKWorkspace
from attnserve.pdl import pdl_enabled
from attnserve.triton_env import triton_interpreting

__all__ = [
    "DEFAULT_MAX_M",
    "DEFAULT_MIN_M",
    "FP8_MID_DEFAULT_W8A8",
    "FP8_MID_ENV",
    "FP8_MID_MODES",
    "FP8_MID_TABLE",
    "fp8_mid_apply",
    "fp8_mid_candidates",
    "fp8_mid_config",
    "fp8_mid_default_config",
    "fp8_mid_device_tag",
    "fp8_mid_gemm_mode",
    "fp8_mid_route",
    "fp8_mid_setting",
    "fp8_mid_linear",
    "fp8_mid_shape_class",
    "fp8_mid_supported",
]

#: environment switch (`fp8_mid_setting`): unset / ``auto``: the measured default route;
#: ``off`` / ``0`` / ``none``: never; ``w8a16`` / ``w8a8``: that mode for ``16 < M <= 256`` rows
FP8_MID_ENV = "ATTNSERVE_FP8_MID_GEMM"
FP8_MID_MODES = ("w8a16", "w8a8")
#: rows the default (``auto``) route takes: ``DEFAULT_MIN_M <= M <= DEFAULT_MAX_M``
DEFAULT_MIN_M = 33
DEFAULT_MAX_M = 64
#: M buckets of the table (an entry at ``b`` serves ``previous bucket < M <= b``)
M_BUCKETS = (32, 64, 128, 256)
#: shared-memory budget of the pipelined K loop (bytes; H100/H200 allow 227 KB per block,
#: the rest left to the epilogue's layout conversion)
SMEM_BUDGET = 160 * 1024

#: shape class -> M bucket -> (block_n, block_k, num_warps, num_stages, split_k[, use_tma[, pdl[,
#: prefetch]]]) (`_config_from_row`; ``pdl``: the kernel's PDL form, ``prefetch``: its L2 hints). Unmeasured
#: starting points (2026-11-27), chosen so that a projection launches >= 2 CTAs per H100 SM:
#: o (4096 x 4096): 64 column blocks x 4; qkv (6144 x 4096): 96 x 3; down (4096 x 14336):
#: 64 x 8; gate_up (2 x 14336 x 4096, a program reads gate and up tiles): 224 x 2. From 128
#: rows on, 128-row weight tiles halve the activation re-reads (each column block reads all
#: of x over its K range) and 8 warps hold the wider accumulators.
FP8_MID_TABLE: Dict[str, Dict[int, tuple]] = {
    "n<=4096": {32: (64, 128, 4, 4, 4), 64: (64, 128, 4, 4, 4), 128: (128, 128, 8, 3, 2), 256: (128, 64, 8, 3, 4)},
    "n<=16384": {32: (64, 128, 4, 4, 3), 64: (64, 128, 4, 4, 3), 128: (128, 128, 8, 3, 2), 256: (128, 64, 8, 3, 2)},
    "k>=8192": {32: (64, 128, 4, 4, 8), 64: (64, 128, 4, 4, 8), 128: (128, 128, 8, 3, 4), 256: (128, 64, 8, 3, 4)},
    "gated": {32: (64, 128, 4, 4, 2), 64: (64, 128, 4, 4, 2), 128: (64, 128, 8, 3, 2), 256: (64, 64, 8, 3, 2)},
    "wide": {32: (64, 128, 4, 4, 1), 64: (64, 128, 4, 4, 1), 128: (128, 128, 8, 3, 1), 256: (128, 64, 8, 3, 1)},
}
#: per mode, entries replacing `FP8_MID_TABLE`'s (filled from ``--sweep`` results). W8A8 at 64
#: and 128 rows: the best tiles of one H100 sweep on producer-quantised rows (2026-11-27,
#: ``benchmarks/results/h100-80gb-hbm3-fp8-bench-mid-sweep-*-2026-11-27.json``, Llama-3-8B
#: shapes, µs table's tile -> best: M 64 qkv 16.8 -> 14.3, o 12.9 -> 12.7, gate_up 60.5 -> 47.8,
#: down 32.1 -> 29.3; M 128 qkv 21.0 -> 19.9, o 18.4 -> 15.2, gate_up 84.7 -> 58.1, down 36.3 -> 34.4)
FP8_MID_MODE_OVERRIDES: Dict[str, Dict[str, Dict[int, tuple]]] = {
    "w8a16": {},
    "w8a8": {
        "n<=16384": {64: (64, 128, 4, 4, 1), 128: (64, 128, 8, 3, 2)},
        "n<=4096": {64: (64, 128, 4, 4, 2), 128: (64, 128, 8, 3, 2)},
        "gated": {64: (64, 128, 4, 4, 1), 128: (64, 128, 8, 3, 1)},
        "k>=8192": {64: (64, 128, 4, 4, 4), 128: (64, 128, 8, 3, 4)},
    },
}
#: the default route (`fp8_mid_route`, W8A8, `DEFAULT_MIN_M` .. `DEFAULT_MAX_M` rows): CUDA
#: device tag (`tuned_configs.device_name_tag`) -> weight shape (`mid_gemm.table_key`: all
#: ``N`` rows, ``2I`` gated) -> a `FP8_MID_TABLE`-style tuple, only
#: where the kernel beat ``_scaled_mm`` on producer-quantised rows. H100 80GB HBM3, Llama-3-8B
#: projections, measured at 64 rows (sweep JSON above; µs ``_scaled_mm`` / this tile): qkv
#: 15.4 / 14.3, o 13.9 / 12.7, gate_up 54.9 / 47.8 (gate fused), down 37.9 / 29.3. The wide
#: sweep of 2026-11-27 (``fp8_bench.py --parts gemm --sweep wide --ms 64``, 99 tiles,
#: ``benchmarks/results/h100-80gb-hbm3-fp8-mid-wide-sweep-m64-2026-11-27.json``, split-K on the
#: persistent workspace) moved gate_up to 3 stages (47.9 -> 47.0 µs) and down to a 256-wide K
#: step, 3 splits (27.5 -> 27.2); qkv and o kept their tiles (14.4, 11.5 µs). H200: the same
#: wide sweep (2026-11-28, ``benchmarks/results/h200-fp8-mid-wide-sweep-m64-2026-11-28.json``,
#: µs ``_scaled_mm`` row-wise / best tile) qkv 14.5 / 12.5, o 13.8 / 10.4, gate_up 45.5 / 33.9,
#: down 37.0 / 21.6; but there (no entry until then) ``o`` and ``down`` already ran the folded
#: tensor-wise routes of `Fp8LinearMethod`, and ``gate_up`` the folded GEMM plus the SiLU-and-mul
#: quantiser (32.9 + 6.6 µs in the 64-request step's profile), so only ``qkv`` and ``gate_up``
#: are listed (engine A/B in benchmarks/NOTES.md, 2026-11-28 sixteenth). Other GPUs and
#: shapes: no entry, ``_scaled_mm``.
FP8_MID_DEFAULT_W8A8: Dict[str, Dict[str, tuple]] = {
    "NVIDIA_H100_80GB_HBM3": {
        table_key(6144, 4096, False): (64, 128, 4, 4, 1),
        table_key(4096, 4096, False): (64, 128, 4, 4, 2),
        table_key(28672, 4096, True): (64, 128, 4, 3, 1),
        table_key(4096, 14336, False): (64, 256, 4, 3, 3),
    },
    "NVIDIA_H200": {
        table_key(6144, 4096, False): (64, 128, 4, 6, 2, True),
        table_key(28672, 4096, True): (64, 128, 4, 4, 1),
    },
}


def fp8_mid_setting() -> str:
    """``ATTNSERVE_FP8_MID_GEMM`` as ``"auto"`` (unset, empty or ``auto``), ``"off"`` (``off``,
    ``0``, ``none``), ``"w8a16"`` or ``"w8a8"``; read at every call (CUDA graphs bake the
    choice in at capture).

    Raises:
        ValueError: any other value.
    """
    raw = os.environ.get(FP8_MID_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("0", "off", "none"):
        return "off"
    if raw not in FP8_MID_MODES:
        raise ValueError(f"{FP8_MID_ENV} must be one of auto, off, {', '.join(FP8_MID_MODES)} (or unset), got {raw!r}")
    return raw


def fp8_mid_gemm_mode() -> Optional[str]:
    """The explicitly requested mode, ``"w8a16"`` or ``"w8a8"``, or None (``auto`` or ``off``).

    Raises:
        ValueError: as `fp8_mid_setting`.
    """
    setting = fp8_mid_setting()
    return setting if setting in FP8_MID_MODES else None


@functools.lru_cache(maxsize=16)
def _cuda_device_tag(index: int) -> str:
    from attnserve.models.layers.moe.tuned_configs import device_name_tag

    return device_name_tag(torch.cuda.get_device_name(index))


def fp8_mid_device_tag(device: torch.device) -> Optional[str]:
    """The `FP8_MID_DEFAULT_W8A8` key of ``device``: its CUDA name as a file-name tag
    (``"NVIDIA_H100_80GB_HBM3"``), None for other devices. Memoised per device index."""
    if device.type != "cuda":
        return None
    return _cuda_device_tag(device.index if device.index is not None else torch.cuda.current_device())


def fp8_mid_shape_class(n: int, k: int, gated: bool) -> str:
    """Class of an e4m3 weight ``[N, K]`` (``gated``: ``N = 2I``): ``gated``, ``k>=8192``,
    ``n<=4096``, ``n<=16384`` or ``wide``, the skinny kernels' classes (`skinny_gemm._shape_class`)."""
    from attnserve.models.layers.skinny_gemm import _shape_class

    return _shape_class(n, k, gated)


def _bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if m <= b)


def _fit_stages(cfg: MidGemmConfig, m: int, gated: bool, x_itemsize: int) -> MidGemmConfig:
    """``cfg`` with ``num_stages`` lowered until the K loop's buffers fit `SMEM_BUDGET` (with
    ``pdl``, one stage's worth is kept for the peeled first step's operands)."""
    m1, m2 = m_pieces(m)
    per_stage = ((2 if gated else 1) * cfg.block_n + (m1 + m2) * x_itemsize) * cfg.block_k
    stages = max(1, min(cfg.num_stages, SMEM_BUDGET // per_stage - int(cfg.pdl)))
    return dataclasses.replace(cfg, num_stages=stages)


def _config_from_row(row: tuple, m: int, k: int, gated: bool, mode: str) -> MidGemmConfig:
    """A table tuple ``(block_n, block_k, warps, stages, split_k[, use_tma[, pdl[, prefetch]]])``
    -> config, ``block_k`` capped at ``next_pow2(k)``, stages fitted (``prefetch`` only with ``pdl``)."""
    bn, bk, warps, stages, split, *rest = row
    tma, pdl, prefetch = (list(rest) + [False, False, 0])[:3]
    bk = max(32, min(bk, 1 << max(k - 1, 0).bit_length()))
    cfg = MidGemmConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split,
                        use_tma=bool(tma), pdl=bool(pdl), prefetch=int(prefetch) if pdl else 0)
    return _fit_stages(cfg, m, gated, 1 if mode == "w8a8" else 2)


def fp8_mid_config(m: int, n: int, k: int, mode: str, gated: bool = False) -> MidGemmConfig:
    """The table's launch parameters for ``m`` rows (``MIN_MID_M < m <= MAX_MID_M``) of a
    weight ``[n, k]`` in ``mode``, ``block_k`` capped at ``next_pow2(k)`` and stages fitted
    to shared memory.

    Raises:
        ValueError: ``m`` out of range or an unknown mode.
    """
    if not 1 <= m <= MAX_MID_M or mode not in FP8_MID_MODES:
        raise ValueError(f"fp8_mid_config: m={m} (1..{MAX_MID_M}), mode={mode!r} ({FP8_MID_MODES})")
    cls = fp8_mid_shape_class(n, k, gated)
    row = {**FP8_MID_TABLE[cls], **FP8_MID_MODE_OVERRIDES[mode].get(cls, {})}
    return _config_from_row(row[_bucket(m)], m, k, gated, mode)


def fp8_mid_default_config(m: int, n: int, k: int, gated: bool, device: torch.device) -> Optional[MidGemmConfig]:
    """The default route's W8A8 config for ``m`` rows of an e4m3 weight ``[n, k]`` (``n``: all
    rows, ``2I`` gated) on ``device``, or None: ``m`` outside `DEFAULT_MIN_M` ..
    `DEFAULT_MAX_M`, or no `FP8_MID_DEFAULT_W8A8` entry for the device and shape."""
    if not DEFAULT_MIN_M <= m <= DEFAULT_MAX_M:
        return None
    row = FP8_MID_DEFAULT_W8A8.get(fp8_mid_device_tag(device) or "", {}).get(table_key(n, k, gated))
    return None if row is None else _config_from_row(row, m, k, gated, "w8a8")


def fp8_mid_route(m: int, n: int, k: int, gated: bool, device: torch.device
                  ) -> Optional[Tuple[str, MidGemmConfig]]:
    """``(mode, config)`` for ``m`` rows of an e4m3 weight ``[n, k]`` on ``device`` by
    `fp8_mid_setting` (see the module doc), or None (``_scaled_mm``). Depends on nothing
    but its arguments and the environment.

    Raises:
        ValueError: a bad ``ATTNSERVE_FP8_MID_GEMM``.
    """
    setting = fp8_mid_setting()
    if setting == "off":
        return None
    if setting == "auto":
        cfg = fp8_mid_default_config(m, n, k, gated, device)
        return None if cfg is None else ("w8a8", cfg)
    if not MIN_MID_M < m <= MAX_MID_M:
        return None
    return setting, fp8_mid_config(m, n, k, setting, gated)


def fp8_mid_candidates(m: int, n: int, k: int, mode: str, gated: bool = False) -> List[MidGemmConfig]:
    """The benchmark's sweep: the table's config first, then its neighbours (split-K x2 / /2,
    the other ``block_n`` of 64 / 128, ``block_k`` x2 / /2, the other warp count, TMA loads),
    stages fitted to shared memory, duplicates removed."""
    base = fp8_mid_config(m, n, k, mode, gated)
    rep = dataclasses.replace
    cands = [base, rep(base, split_k=base.split_k * 2), rep(base, split_k=max(1, base.split_k // 2)),
             rep(base, block_n=192 - base.block_n), rep(base, block_k=base.block_k * 2),
             rep(base, block_k=max(32, base.block_k // 2)), rep(base, num_warps=12 - base.num_warps),
             rep(base, use_tma=True), rep(base, use_tma=True, split_k=base.split_k * 2)]
    out: List[MidGemmConfig] = []
    for c in cands:
        c = _fit_stages(c, m, gated, 1 if mode == "w8a8" else 2)
        if c not in out:
            out.append(c)
    return out


def fp8_mid_supported(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, x_scale: Optional[torch.Tensor] = None,
                      out_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether `fp8_mid_linear` accepts its arguments: ``x`` 2-D ``[M, K]`` with ``1 <= M <=
    MAX_MID_M`` and unit stride along ``K``, on CUDA (or CPU under the Triton interpreter),
    either float16/bfloat16 (W8A16; ``x_scale`` None) or e4m3 with a float32 ``x_scale
    [M, 1]`` / ``[M]`` and a 16-bit ``out_dtype`` (W8A8); a contiguous e4m3 ``weight [N, K]``
    on ``x``'s device; a contiguous float32 ``weight_scale`` ``[N]`` or of one element; an
    optional unit-stride ``bias [N]`` of the output dtype."""
    if x.dim() != 2 or weight.dim() != 2 or weight.device != x.device:
        return False
    if not (x.is_cuda or (x.device.type == "cpu" and triton_interpreting())):
        return False
    m, k = x.shape
    n = weight.shape[0]
    if not (1 <= m <= MAX_MID_M) or k < 1 or n < 1 or weight.shape[1] != k or (x.stride(1) != 1 and k > 1):
        return False
    if weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous():
        return False
    if x.dtype == torch.float8_e4m3fn:
        if x_scale is None or out_dtype not in (torch.float16, torch.bfloat16):
            return False
        if x_scale.dtype != torch.float32 or x_scale.device != x.device or x_scale.shape[0] != m or x_scale.numel() != m:
            return False
        dtype = out_dtype
    elif x.dtype in (torch.float16, torch.bfloat16) and x_scale is None:
        dtype = out_dtype or x.dtype
        if dtype != x.dtype:
            return False
    else:
        return False
    ws = weight_scale
    if ws.dtype != torch.float32 or ws.device != x.device or not ws.is_contiguous() or ws.numel() not in (1, n):
        return False
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype or bias.device != x.device
                             or (bias.stride(0) != 1 and n > 1)):
        return False
    return True


def fp8_mid_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, activation: Optional[str] = None, *,
                   x_scale: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                   config: Optional[MidGemmConfig] = None,
                   workspace: Optional[SplitKWorkspace] = None) -> torch.Tensor:
    """``(x * s_x) @ (W_q * s_w)^T (+ b)`` in one launch (float32 accumulation, one rounding).

    Args:
        x: ``[M, K]``, ``1 <= M <= MAX_MID_M`` (meant for ``M > 16``): float16/bfloat16
            (W8A16) or ``float8_e4m3fn`` (W8A8, with ``x_scale``).
        weight: contiguous ``float8_e4m3fn`` ``[N, K]`` (``[2I, K]`` = ``[gate | up]`` with
            an ``activation``).
        weight_scale: float32 ``[N]`` (per output row) or one element (per tensor).
        bias: optional ``[N]`` of the output dtype.
        activation: None, ``"silu"`` or ``"gelu_tanh"``: return ``act(gate) * up``.
        x_scale: W8A8 only: float32 ``[M, 1]`` (or ``[M]``) per-token scales, ``x ~= q * s``.
        out_dtype: W8A8 only (required): float16/bfloat16 output; W8A16: ``x``'s dtype.
        config: launch parameters (default `fp8_mid_config`).
        workspace: where a split-K launch takes its zeroed buffer (and leaves it zeroed);
            None: a fresh zeroed buffer per call (one memset). Same results either way.

    Returns:
        new contiguous ``[M, N]`` (``[M, N / 2]`` gated) in the output dtype.

    Raises:
        ValueError: arguments `fp8_mid_supported` rejects, an unknown activation, an odd
            number of weight rows for a gated call, or an invalid ``config``.
    """
    if not fp8_mid_supported(x, weight, weight_scale, bias, x_scale, out_dtype):
        raise ValueError(
            f"fp8_mid_linear: unsupported x {tuple(x.shape)} {x.dtype} {x.device}, weight {tuple(weight.shape)} "
            f"{weight.dtype}, weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype}, x_scale "
            f"{None if x_scale is None else (tuple(x_scale.shape), x_scale.dtype)}, out_dtype {out_dtype}: need "
            f"1..{MAX_MID_M} rows of 16-bit x (or e4m3 x with float32 [M, 1] scales and a 16-bit out_dtype), a "
            "contiguous float8_e4m3fn [N, K] weight, a float32 [N] or 1-element weight scale, a [N] bias, on "
            "CUDA (or CPU under TRITON_INTERPRET=1)")
    gated = activation is not None
    if gated:
        if activation not in SKINNY_ACTIVATIONS:
            raise ValueError(f"fp8_mid_linear: activation must be one of "
                             f"{', '.join(map(repr, SKINNY_ACTIVATIONS))}, got {activation!r}")
        if weight.shape[0] % 2:
            raise ValueError(f"fp8_mid_linear: weight {tuple(weight.shape)} must have an even number of rows")
    w8a8 = x.dtype == torch.float8_e4m3fn
    m, k = x.shape
    rows = weight.shape[0]
    n = rows // 2 if gated else rows
    if config is None:
        config = fp8_mid_config(m, rows, k, "w8a8" if w8a8 else "w8a16", gated)
    config.validate(pdl_with_split_k=True)
    dtype = out_dtype if w8a8 else x.dtype
    m1, m2 = m_pieces(m)
    out = torch.empty((m, n), dtype=dtype, device=x.device)
    interpret = x.device.type == "cpu"
    use_tma = bool(config.use_tma) and not interpret
    # the interpreter runs the PDL form's peeled first step (without the griddepcontrol and
    # prefetch instructions) and launches plainly; a GPU uses it only where PDL is on
    use_pdl = bool(config.pdl) and (interpret or pdl_enabled(x.device))
    prefetch_lines = _next_pow2(-(-config.prefetch * config.block_k // 128)) if use_pdl and config.prefetch else 0
    blocks = -(-n // config.block_n)
    if config.split_k > 1:  # float32 workspace [M, rows] then int32 counters, all zero
        need = m * rows + blocks
        buf = workspace.get(need, x.device) if workspace is not None else None
        if buf is None:  # no workspace, or none allocated yet while a graph is captured: one memset
            buf = torch.zeros(need, dtype=torch.float32, device=x.device)
        wk, cnt = buf[: m * rows], buf[m * rows:].view(torch.int32)
    else:
        wk, cnt = out, out  # never read
    desc = weight
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor(weight, [rows, k], [k, 1], [config.block_n, config.block_k])
    from attnserve.models.layers.quantization import fp8_mid_gemm_triton as kt

    xs = x_scale if w8a8 else weight_scale
    kt._fp8_mid_gemm_kernel[(blocks * config.split_k,)](
        x, xs, weight, desc, weight_scale, bias if bias is not None else weight_scale, out, wk, cnt,
        m, n, k, x.stride(0), xs.stride(0) if w8a8 else 0, out.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_M1=m1, BLOCK_M2=max(m2, 16), HAS_M2=m2 > 0,
        SPLIT_K=config.split_k, USE_TMA=use_tma, UPCAST=interpret, W8A8=w8a8,
        WS_PER_TENSOR=weight_scale.numel() == 1 and rows > 1, HAS_BIAS=bias is not None, GATED=gated,
        ACT=SKINNY_ACTIVATIONS[activation] if gated else 0,
        USE_PDL=use_pdl, PREFETCH_LINES=prefetch_lines, INTERPRET=interpret,
        num_warps=config.num_warps, num_stages=1 if interpret else config.num_stages,
        **({"launch_pdl": True} if use_pdl and not interpret else {}),
    )
    return out


def fp8_mid_apply(layer, x: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str] = None, *,
                  x_scale: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                  workspace: Optional[SplitKWorkspace] = None) -> Optional[torch.Tensor]:
    """`Fp8LinearMethod`'s route: ``fp8_mid_linear`` of ``x [M, K]`` (16-bit, or e4m3 with
    ``x_scale`` / ``out_dtype`` when its producer quantised it) with ``layer.weight`` /
    ``layer.weight_scale`` (and the gate ``activation``: output ``[M, N / 2]``), or None when
    it does not apply: `fp8_mid_route` says no, a static activation scale, fused kernels
    off, an e4m3 input in ``w8a16`` mode, an odd gated weight or unknown activation, or
    operands `fp8_mid_supported` rejects. In ``w8a8`` mode a 16-bit ``x`` is quantised per
    token first (`quantize_activation`). ``workspace``: the split-K buffers (the caller's
    `SplitKWorkspace`; None: one memset per split-K call).

    Raises:
        ValueError: a bad ``ATTNSERVE_FP8_MID_GEMM``.
    """
    if x.dim() != 2 or not MIN_MID_M < x.shape[0] <= MAX_MID_M:
        return None
    if getattr(layer, "input_scale", None) is not None or not getattr(layer, "use_fused", False):
        return None
    gated = activation is not None
    if gated and (activation not in SKINNY_ACTIVATIONS or layer.weight.shape[0] % 2):
        return None
    route = fp8_mid_route(x.shape[0], layer.weight.shape[0], x.shape[1], gated, x.device)
    if route is None:
        return None
    mode, config = route
    prequantized = x.dtype == torch.float8_e4m3fn
    if prequantized and mode != "w8a8":
        return None
    if mode == "w8a8" and not prequantized:
        if not fp8_mid_supported(x, layer.weight, layer.weight_scale, bias):
            return None
        from attnserve.models.layers.quantization.fp8_kernels import quantize_activation

        out_dtype = x.dtype
        x, x_scale = quantize_activation(x)
    if not fp8_mid_supported(x, layer.weight, layer.weight_scale, bias, x_scale, out_dtype):
        return None
    return fp8_mid_linear(x, layer.weight, layer.weight_scale, bias, activation, x_scale=x_scale,
                          out_dtype=out_dtype, config=config, workspace=workspace)
