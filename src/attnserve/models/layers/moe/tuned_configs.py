"""Launch configurations of the fused MoE GEMMs: tuned tables per shape and device, and a default rule.

A table is one JSON file in ``configs/`` (package data) per ``(E, N, K, dtype, device)``:
``E`` experts, ``N`` = the intermediate size per rank (``w2.shape[2]``), ``K`` = the
hidden size (``w13.shape[2]``), the weights' dtype and the CUDA device name. It maps
token counts (the ``T`` of the layer's input) to a `FusedMoEConfig`; a call with ``T``
tokens uses the entry of the nearest token count, as SGLang's tuned tables are used. The
tables are written by ``benchmarks/moe_tune.py`` from measurements; file names follow
SGLang's pattern, ``E=128,N=768,K=2048,device_name=NVIDIA_H100_80GB_HBM3,dtype=bfloat16.json``.

Without a table, `default_config` gives a rule of thumb (see there). The environment
variable ``ATTNSERVE_MOE_CONFIG_DIR`` names a directory searched before the package's own
(read at every lookup; used by the benchmarks right after a sweep).

JSON schema (``configs`` keys are token counts)::

    {"meta": {...},
     "configs": {"1": {"BLOCK_SIZE_M": 16,
                       "gemm1": {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                                 "num_warps": 4, "num_stages": 4},
                       "gemm2": {...}}, ...}}

``gemm1`` is the gate-up GEMM (``BLOCK_SIZE_N`` counts weight rows of ``w13``: half gate,
half up, so a program writes ``BLOCK_SIZE_N / 2`` intermediate columns), ``gemm2`` the
down GEMM. A flat SGLang-style dict (``BLOCK_SIZE_M/N/K``, ``GROUP_SIZE_M``,
``num_warps``, ``num_stages``) is accepted too and used for both GEMMs.

Imports neither Triton nor CUDA state at import time.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import torch

__all__ = [
    "CONFIG_DIR_ENV",
    "FusedMoEConfig",
    "MoEGemmConfig",
    "config_file_name",
    "default_config",
    "default_config_fp8_w8a8",
    "device_name_tag",
    "get_fused_moe_config",
    "load_tuned_configs",
    "package_config_dir",
]

#: environment variable naming an extra directory of tuned tables, searched first
CONFIG_DIR_ENV = "ATTNSERVE_MOE_CONFIG_DIR"

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class MoEGemmConfig:
    """Launch parameters of one grouped GEMM (the M tile is `FusedMoEConfig.block_m`).

    Attributes:
        block_n: weight rows per program (power of two >= 16); for the gated gate-up GEMM
            half are gate rows and half up rows.
        block_k: reduction step (power of two >= 16).
        group_m: M blocks scheduled together per column band (L2 reuse of weight tiles by
            consecutive blocks of one expert), >= 1.
        num_warps: warps per program (power of two, 1..16).
        num_stages: software-pipelining depth of the K loop (>= 1).
    """

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def to_dict(self) -> Dict[str, int]:
        return {"BLOCK_SIZE_N": self.block_n, "BLOCK_SIZE_K": self.block_k, "GROUP_SIZE_M": self.group_m,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def from_dict(cls, d: Mapping[str, int]) -> "MoEGemmConfig":
        return cls(block_n=int(d["BLOCK_SIZE_N"]), block_k=int(d["BLOCK_SIZE_K"]), group_m=int(d.get("GROUP_SIZE_M", 1)),
                   num_warps=int(d.get("num_warps", 4)), num_stages=int(d.get("num_stages", 3)))

    def problems(self) -> list:
        out = []
        if not _is_pow2(self.block_n) or self.block_n < 16 or not _is_pow2(self.block_k) or self.block_k < 16:
            out.append("BLOCK_SIZE_N and BLOCK_SIZE_K must be powers of two >= 16")
        if self.group_m < 1:
            out.append("GROUP_SIZE_M must be >= 1")
        if not _is_pow2(self.num_warps) or self.num_warps > 16:
            out.append("num_warps must be a power of two in 1..16")
        if self.num_stages < 1:
            out.append("num_stages must be >= 1")
        return out


@dataclass(frozen=True)
class FusedMoEConfig:
    """Configuration of one fused MoE call: the M tile (= ``moe_align_block_size``'s
    ``block_size``, shared by both GEMMs) and each GEMM's own parameters."""

    block_m: int
    gemm1: MoEGemmConfig
    gemm2: MoEGemmConfig

    def to_dict(self) -> dict:
        return {"BLOCK_SIZE_M": self.block_m, "gemm1": self.gemm1.to_dict(), "gemm2": self.gemm2.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> "FusedMoEConfig":
        """Nested (``gemm1`` / ``gemm2``) or flat SGLang-style dict -> validated config.

        Raises:
            ValueError: missing keys or invalid values (the message names them).
        """
        try:
            if "gemm1" in d:
                cfg = cls(int(d["BLOCK_SIZE_M"]), MoEGemmConfig.from_dict(d["gemm1"]), MoEGemmConfig.from_dict(d["gemm2"]))
            else:
                g = MoEGemmConfig.from_dict(d)
                cfg = cls(int(d["BLOCK_SIZE_M"]), g, g)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"fused MoE config {dict(d)!r}: missing or bad key ({e})") from e
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming what the kernels cannot compile."""
        problems = [] if _is_pow2(self.block_m) and self.block_m >= 16 else ["BLOCK_SIZE_M must be a power of two >= 16"]
        problems += [f"gemm1: {p}" for p in self.gemm1.problems()] + [f"gemm2: {p}" for p in self.gemm2.problems()]
        if problems:
            raise ValueError(f"invalid fused MoE config {self.to_dict()}: " + "; ".join(problems))


def device_name_tag(name: str) -> str:
    """CUDA device name as used in file names: runs of other characters than letters,
    digits, ``.`` and ``-`` become ``_`` (``"NVIDIA H100 80GB HBM3"`` ->
    ``"NVIDIA_H100_80GB_HBM3"``)."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", name.strip())


def config_file_name(E: int, N: int, K: int, dtype: torch.dtype, device_name: str, quant: Optional[str] = None,
                     block_shape: Optional[Tuple[int, int]] = None) -> str:
    """File name of the table for ``E`` experts, intermediate ``N``, hidden ``K``, ``dtype``, device.

    ``quant`` ``"fp8_w8a8"`` (FP8 experts with FP8 activations, `fp8_w8a8`) replaces the
    dtype, and ``block_shape`` adds ``,block_shape=[128,128]`` (SGLang's naming)."""
    name = f"E={E},N={N},K={K},device_name={device_name_tag(device_name)},dtype={quant or _DTYPE_NAMES[dtype]}"
    if quant and block_shape is not None:
        name += f",block_shape=[{int(block_shape[0])},{int(block_shape[1])}]"
    return name + ".json"


def package_config_dir() -> Path:
    """The ``configs/`` directory shipped with this package."""
    return Path(__file__).resolve().parent / "configs"


@functools.lru_cache(maxsize=128)
def _read_table(path: str) -> Optional[Tuple[Tuple[int, FusedMoEConfig], ...]]:
    """The parsed table at ``path`` sorted by token count, or None if there is no such file
    (memoised: a pure function of the file, which is package data or a sweep's output)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    configs = data.get("configs", data)
    return tuple(sorted((int(k), FusedMoEConfig.from_dict(v)) for k, v in configs.items()))


def load_tuned_configs(E: int, N: int, K: int, dtype: torch.dtype, device_name: str, quant: Optional[str] = None,
                       block_shape: Optional[Tuple[int, int]] = None) -> Optional[Dict[int, FusedMoEConfig]]:
    """Tuned table ``{token count: config}`` for this shape and device (and ``quant`` /
    ``block_shape``, see `config_file_name`), or None.

    Searched in ``$ATTNSERVE_MOE_CONFIG_DIR`` (if set) then in `package_config_dir`.

    Raises:
        ValueError: a table exists but holds an invalid entry.
    """
    if dtype not in _DTYPE_NAMES:
        return None
    name = config_file_name(E, N, K, dtype, device_name, quant, block_shape)
    dirs = [os.environ.get(CONFIG_DIR_ENV, "").strip(), str(package_config_dir())]
    for d in dirs:
        if d:
            table = _read_table(os.path.join(d, name))
            if table is not None:
                return dict(table)
    return None


def default_config_fp8_w8a8(num_tokens: int, E: int, N: int, K: int, top_k: int) -> FusedMoEConfig:
    """Rule of thumb for the W8A8 FP8 GEMMs (e4m3 x e4m3 ``tl.dot``; H100, untuned): ``BLOCK_SIZE_K``
    128 (one activation / weight scale group a K step; an FP8 tile of 128 x 128 is the bytes of
    a 16-bit 128 x 64 one), M tile by the mean slots per expert ``a = T * top_k / E`` as
    `default_config`: 16 rows up to 12 (``BLOCK_SIZE_N`` 64, 4 warps, 4 stages), 32 up to 48
    (128 / 4 warps / 4 stages), 64 up to 160 (128 / 4 warps / 4 stages), 128 above
    (128 / 8 warps / 4 stages: ``4 x 32`` KiB of shared memory); ``GROUP_SIZE_M`` 8 (16 at 128
    rows). The candidates ``benchmarks/moe_layer.py --sweep-w8a8`` times are
    ``moe_tune.FP8_W8A8_CANDIDATES``."""
    a = num_tokens * top_k / max(E, 1)
    if a <= 12:
        bm, g = 16, MoEGemmConfig(64, 128, 1, 4, 4)
    elif a <= 48:
        bm, g = 32, MoEGemmConfig(128, 128, 8, 4, 4)
    elif a <= 160:
        bm, g = 64, MoEGemmConfig(128, 128, 8, 4, 4)
    else:
        bm, g = 128, MoEGemmConfig(128, 128, 16, 8, 4)

    def fit(rows: int, red: int) -> MoEGemmConfig:
        return MoEGemmConfig(min(g.block_n, max(16, _next_pow2(rows))), min(g.block_k, max(16, _next_pow2(red))),
                             g.group_m, g.num_warps, g.num_stages)

    return FusedMoEConfig(bm, fit(2 * N, K), fit(K, N))


def default_config(num_tokens: int, E: int, N: int, K: int, top_k: int, dtype: torch.dtype,
                   interpret: bool = False) -> FusedMoEConfig:
    """Rule of thumb when no tuned table matches (every value a power of two).

    The M tile follows the mean slots per expert ``a = T * top_k / E``: 16 rows up to 12,
    32 up to 48, 64 up to 160, 128 above (fewer padded rows when experts get few tokens,
    larger tensor-core tiles when they get many). 16-bit weights: ``BLOCK_SIZE_N`` 64 /
    ``BLOCK_SIZE_K`` 128 / 4 warps / 4 stages for the 16- and 32-row tiles (a stream over
    the weights: long contiguous K runs), 128 / 64 with ``GROUP_SIZE_M`` 8 (64 rows) or 16
    with 8 warps (128 rows). float32: ``BLOCK_SIZE_K`` 32 and 2 stages (twice the bytes a
    tile). Under the Triton interpreter: 16-row tiles, one stage, tiles no larger than the
    problem. ``BLOCK_SIZE_N`` never exceeds the next power of two of the GEMM's weight rows
    (``2N`` for gate-up, ``K`` for down), nor ``BLOCK_SIZE_K`` that of its reduction.
    """
    a = num_tokens * top_k / max(E, 1)
    if interpret:
        bm, g = 16, MoEGemmConfig(64, 64, 1, 4, 1)
        g1 = g2 = g
    elif dtype == torch.float32:
        bm = 16 if a <= 12 else (32 if a <= 48 else 64)
        g1 = g2 = MoEGemmConfig(64, 32, 1 if bm == 16 else 8, 4, 2)
    elif a <= 12:
        bm, g1 = 16, MoEGemmConfig(64, 128, 1, 4, 4)
        g2 = g1
    elif a <= 48:
        bm, g1 = 32, MoEGemmConfig(64, 128, 8, 4, 4)
        g2 = g1
    elif a <= 160:
        bm, g1 = 64, MoEGemmConfig(128, 64, 8, 4, 4)
        g2 = g1
    else:
        bm, g1 = 128, MoEGemmConfig(128, 64, 16, 8, 4)
        g2 = g1

    def fit(g: MoEGemmConfig, rows: int, red: int) -> MoEGemmConfig:
        return MoEGemmConfig(min(g.block_n, max(16, _next_pow2(rows))), min(g.block_k, max(16, _next_pow2(red))),
                             g.group_m, g.num_warps, g.num_stages)

    return FusedMoEConfig(bm, fit(g1, 2 * N, K), fit(g2, K, N))


def get_fused_moe_config(num_tokens: int, E: int, N: int, K: int, top_k: int, dtype: torch.dtype,
                         device: torch.device, quant: Optional[str] = None,
                         block_shape: Optional[Tuple[int, int]] = None) -> FusedMoEConfig:
    """The tuned entry nearest to ``num_tokens`` for this shape on ``device`` (CUDA), else
    `default_config` (always for CPU tensors, which run under the Triton interpreter).
    ``quant`` ``"fp8_w8a8"``: the W8A8 table (`config_file_name`) or `default_config_fp8_w8a8`."""
    if device.type == "cuda":
        table = load_tuned_configs(E, N, K, dtype, torch.cuda.get_device_name(device), quant, block_shape)
        if table:
            key = min(table, key=lambda k: (abs(k - num_tokens), k))
            return table[key]
        if quant == "fp8_w8a8":
            return default_config_fp8_w8a8(num_tokens, E, N, K, top_k)
    return default_config(num_tokens, E, N, K, top_k, dtype, interpret=device.type != "cuda")
