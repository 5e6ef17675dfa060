"""Mid-size decode GEMM: ``y = x @ W^T (+ b)`` for ``16 < M <= 256`` rows, one Triton launch.

Past the skinny kernel's 16 rows (`attnserve.models.layers.skinny_gemm`) a decode step's
projections still stream their weight once per step, but cuBLAS reaches only 2.1-2.55 of
an H100's 3.0 TB/s copy rate on the Llama-3-8B shapes at 144 rows (gate_up ``nvjet
256x144``: 112 tiles for 132 SMs; down: split-K plus a separate reduce kernel;
benchmarks/results/h100-80gb-hbm3-profile-step-2026-11-27.json). Here:

* `mid_linear` -- ``F.linear`` for ``MIN_MID_M < M <= MAX_MID_M`` (swapped-operand
  tensor-core tiles over all rows; `mid_gemm_triton` explains the kernel);
* `mid_linear_gated` -- the fused ``gate_up`` projection with its SwiGLU / GeGLU gate
  (as `skinny_linear_gated`), replacing ``F.linear`` + the act-and-mul kernel;
* `MidGemmConfig` -- the launch parameters; `mid_gemm_config` -- the tuned choice for a
  shape, or None (cuBLAS).

**Selection by tuned table only.** A layer takes this path only for a ``(N, K, gated,
M-bucket)`` entry of the device's table in which the kernel beat cuBLAS by at least
`MIN_GAIN` (written by ``benchmarks/midgemm.py --table-out``); without a table (any GPU
not measured, or ``ATTNSERVE_MID_GEMM=0``), behaviour is unchanged: cuBLAS. Tables are
JSON files named ``device_name=<tag>,dtype=<dtype>.json`` in ``mid_gemm_configs/``
(package data) or in ``$ATTNSERVE_MID_GEMM_CONFIG_DIR`` (searched first), as the fused
MoE tables are (`attnserve.models.layers.moe.tuned_configs`). Schema::

    {"meta": {...},
     "entries": {"N=28672,K=4096,gated=1": {"144": {"block_n": 64, "block_k": 64, "num_warps": 4,
                                                     "num_stages": 4, "split_k": 1, "use_tma": false,
                                                     "pdl": true, "prefetch": 0,
                                                     "us": 80.1, "cublas_us": 92.0}, ...}, ...}}

An entry measured at ``M`` serves every ``M'`` of its bucket: ``prev < M' <= M`` for the
next measured value ``prev`` below it (the smallest bucket starts at `MIN_MID_M`). Entries
may hold ``"cublas"`` instead of a config (measured, not faster); those select cuBLAS.

A config with ``pdl`` launches with programmatic dependent launch (`attnserve.pdl`; off with
``ATTNSERVE_PDL=0`` and where PDL is unsupported, then the plain kernel runs): chosen per
shape and ``M`` by the sweep, which times every candidate behind the kernel that produces
its input, as in a decode step.

Launchers allocate only their output (and, with split-K, a zeroed float32 workspace and
counters: two memsets), never read device values on the host and are CUDA-graph
capturable (``M`` is static per decode graph). Triton is imported lazily.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from attnserve.models.layers.skinny_gemm import MAX_SKINNY_M, SKINNY_ACTIVATIONS, gemm_operands_supported
from attnserve.pdl import pdl_enabled

__all__ = [
    "CONFIG_DIR_ENV",
    "MAX_MID_M",
    "MIN_GAIN",
    "MIN_MID_M",
    "MidGemmConfig",
    "m_pieces",
    "mid_gemm_config",
    "mid_gemm_supported",
    "mid_linear",
    "mid_linear_gated",
    "load_mid_gemm_table",
    "package_table_dir",
    "select_from_table",
    "table_file_name",
    "table_key",
]

#: rows below which the skinny kernel is used (exclusive lower bound of this path)
MIN_MID_M = MAX_SKINNY_M
#: largest number of activation rows (one program covers them all; wgmma's N is <= 256)
MAX_MID_M = 256
#: a table entry selects the kernel only when cuBLAS takes at least this much longer
MIN_GAIN = 1.03
#: environment variable naming a directory of tables searched before the package's own
CONFIG_DIR_ENV = "ATTNSERVE_MID_GEMM_CONFIG_DIR"
#: environment switch: ``0`` disables the path (tables ignored)
ENABLE_ENV = "ATTNSERVE_MID_GEMM"

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def m_pieces(m: int) -> Tuple[int, int]:
    """``(BLOCK_M1, BLOCK_M2)``: power-of-two row pieces covering ``m`` rows with little
    padding (``BLOCK_M2`` 0: one piece), each ``>= 16``: the largest power of two ``<= m``
    plus the next power of two of the rest (merged into one piece when they are equal).
    E.g. 144 -> (128, 16), 96 -> (64, 32), 200 -> (256, 0), 17 -> (32, 0).

    Raises:
        ValueError: ``m`` outside ``1..MAX_MID_M``.
    """
    if not 1 <= m <= MAX_MID_M:
        raise ValueError(f"m_pieces: m={m} outside 1..{MAX_MID_M}")
    first = max(16, 1 << (int(m).bit_length() - 1))
    rest = m - first
    if rest <= 0:
        return first, 0
    second = max(16, _next_pow2(rest))
    if second >= first:
        return 2 * first, 0
    return first, second


@dataclass(frozen=True)
class MidGemmConfig:
    """Launch parameters of the mid-size GEMM kernel.

    Attributes:
        block_n: weight rows (output columns) per program; gated: gate rows, plus as many up
            rows. Power of two >= 16 (64 per warpgroup fills a wgmma).
        block_k: ``K`` per loop step, power of two >= 16.
        num_warps: warps per program (power of two, 1..16).
        num_stages: software-pipelining depth of the ``K`` loop (>= 1).
        split_k: programs sharing a column block's ``K`` range (>= 1); > 1 adds float32
            atomics into a workspace, finished by the last program to arrive.
        use_tma: load the weight with TMA (host tensor descriptor; sm_90+, not the
            interpreter), else pointer loads.
        pdl: launch with programmatic dependent launch (`attnserve.pdl`): the first ``K``
            step's weight tile is loaded while the kernel before (which writes ``x``) still
            runs. The bf16 kernel: only with ``split_k == 1`` (its split-K workspace and
            counters are written by memsets launched right before the kernel); the FP8 one
            (`fp8_mid_gemm`) with any ``split_k``. Used only where `pdl.pdl_enabled`
            (Hopper+, ``ATTNSERVE_PDL`` not 0); elsewhere the plain kernel runs. A per-shape
            choice: PDL is not a gain everywhere (the skinny ``tl.dot`` form lost with it).
        prefetch: with ``pdl``, also hint the L2 to fetch the weight of this many further
            ``K`` steps before the wait (rounded up to a power of two of 128-byte lines per
            weight row); 0: none.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    use_tma: bool = False
    pdl: bool = False
    prefetch: int = 0

    def validate(self, pdl_with_split_k: bool = False) -> None:
        """Raise ValueError when the kernel cannot be compiled with these parameters.
        ``pdl_with_split_k``: the caller's split-K buffers are not zeroed by a launch right
        before the kernel (the FP8 mid GEMM's persistent `SplitKWorkspace`), so ``pdl`` may
        combine with ``split_k > 1``."""
        problems = []
        if not _is_pow2(self.block_n) or not _is_pow2(self.block_k) or self.block_n < 16 or self.block_k < 16:
            problems.append("block_n and block_k must be powers of two >= 16")
        if not _is_pow2(self.num_warps) or self.num_warps > 16:
            problems.append("num_warps must be a power of two in 1..16")
        if self.num_stages < 1 or self.split_k < 1:
            problems.append("num_stages and split_k must be >= 1")
        if self.pdl and self.split_k != 1 and not pdl_with_split_k:
            problems.append("pdl needs split_k == 1 (split-K writes a workspace zeroed just before the kernel)")
        if self.prefetch < 0 or (self.prefetch and not self.pdl):
            problems.append("prefetch must be >= 0 and needs pdl")
        if problems:
            raise ValueError(f"invalid {self}: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MidGemmConfig":
        """Table entry -> validated config (extra keys such as ``us`` are ignored; tables
        written before ``pdl`` / ``prefetch`` existed load with False / 0).

        Raises:
            ValueError: missing or invalid keys.
        """
        try:
            cfg = cls(block_n=int(d["block_n"]), block_k=int(d["block_k"]), num_warps=int(d.get("num_warps", 4)),
                      num_stages=int(d.get("num_stages", 4)), split_k=int(d.get("split_k", 1)),
                      use_tma=bool(d.get("use_tma", False)), pdl=bool(d.get("pdl", False)),
                      prefetch=int(d.get("prefetch", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"mid GEMM config {d!r}: missing or bad key ({e})") from e
        cfg.validate()
        return cfg

    def smem_bytes(self, m: int, gated: bool, itemsize: int = 2) -> int:
        """Shared memory of the pipelined ``K`` loop for ``m`` rows: ``num_stages`` x (weight
        tile(s) + activation pieces) x ``itemsize``; with ``pdl`` one stage more (the peeled
        first step's operands: Triton 3.9 sm_90 compiles allocate them apart from the loop's)."""
        m1, m2 = m_pieces(m)
        stages = self.num_stages + int(self.pdl)
        return stages * ((2 if gated else 1) * self.block_n + m1 + m2) * self.block_k * itemsize

    def acc_per_thread(self, m: int, gated: bool) -> int:
        """float32 accumulator values per thread for ``m`` rows."""
        m1, m2 = m_pieces(m)
        return (2 if gated else 1) * self.block_n * (m1 + m2) // (32 * self.num_warps)


def table_key(n: int, k: int, gated: bool) -> str:
    """Key of a weight shape in a table: ``"N=<n>,K=<k>,gated=<0|1>"`` (``n``: all weight
    rows, ``2I`` for a gated ``gate_up``)."""
    return f"N={n},K={k},gated={int(bool(gated))}"


def table_file_name(device_name: str, dtype: torch.dtype) -> str:
    """``device_name=<tag>,dtype=<dtype>.json`` (tag as `tuned_configs.device_name_tag`)."""
    from attnserve.models.layers.moe.tuned_configs import device_name_tag

    return f"device_name={device_name_tag(device_name)},dtype={_DTYPE_NAMES[dtype]}.json"


def package_table_dir() -> Path:
    """The ``mid_gemm_configs/`` directory shipped with this package."""
    return Path(__file__).resolve().parent / "mid_gemm_configs"


@functools.lru_cache(maxsize=16)
def _read_table(path: str) -> Optional[Dict[str, Tuple[Tuple[int, Optional[MidGemmConfig]], ...]]]:
    """Parsed table at ``path`` (key -> ((M, config or None), ...) sorted by M), or None if
    absent. Memoised: a pure function of the file (package data or a sweep's output)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    out = {}
    for key, per_m in data.get("entries", {}).items():
        rows = []
        for m, v in per_m.items():
            rows.append((int(m), None if v == "cublas" or v is None else MidGemmConfig.from_dict(v)))
        out[key] = tuple(sorted(rows, key=lambda r: r[0]))
    return out


def load_mid_gemm_table(device_name: str, dtype: torch.dtype):
    """The table for this device and dtype (``$ATTNSERVE_MID_GEMM_CONFIG_DIR`` first, then
    the package's), or None.

    Raises:
        ValueError: a table exists but holds an invalid entry.
    """
    if dtype not in _DTYPE_NAMES:
        return None
    name = table_file_name(device_name, dtype)
    for d in (os.environ.get(CONFIG_DIR_ENV, "").strip(), str(package_table_dir())):
        if d:
            table = _read_table(os.path.join(d, name))
            if table is not None:
                return table
    return None


def mid_gemm_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                    gated: bool = False) -> Optional[MidGemmConfig]:
    """The tuned config for ``x [m, k] @ W[n, k]^T`` on ``device``, or None (use cuBLAS).

    None when: ``ATTNSERVE_MID_GEMM=0``; ``m`` outside ``MIN_MID_M < m <= MAX_MID_M``; not
    a CUDA device; no table for the device and dtype, no entry for ``(n, k, gated)``, or
    the bucket of ``m`` (see the module doc) says ``"cublas"`` / lies past the largest
    measured ``M``.
    """
    if os.environ.get(ENABLE_ENV, "1").strip() == "0" or not MIN_MID_M < m <= MAX_MID_M:
        return None
    if device.type != "cuda":
        return None
    table = load_mid_gemm_table(torch.cuda.get_device_name(device), dtype)
    return select_from_table(table, m, n, k, gated) if table else None


def select_from_table(table: dict, m: int, n: int, k: int, gated: bool) -> Optional[MidGemmConfig]:
    """The entry of a parsed table (`load_mid_gemm_table`) for ``m`` rows: the config of the
    smallest measured ``M >= m`` of ``(n, k, gated)``, or None (no entry, ``"cublas"``, or
    ``m`` past the largest measured ``M``)."""
    for measured_m, cfg in table.get(table_key(n, k, gated), ()):  # sorted by M
        if m <= measured_m:
            return cfg
    return None


def mid_gemm_supported(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether `mid_linear` accepts ``(x, weight, bias)``: `skinny_gemm.gemm_operands_supported`
    with ``1 <= M <= MAX_MID_M`` rows of float16 / bfloat16."""
    return gemm_operands_supported(x, weight, bias, MAX_MID_M, _DTYPES)


_DTYPES = (torch.float16, torch.bfloat16)


def _launch(x, weight, bias, act: Optional[int], config: MidGemmConfig) -> torch.Tensor:
    from attnserve.models.layers import mid_gemm_triton as kt

    config.validate()
    m, k = x.shape
    rows = weight.shape[0]
    gated = act is not None
    n = rows // 2 if gated else rows
    m1, m2 = m_pieces(m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    interpret = x.device.type == "cpu"
    use_tma = bool(config.use_tma) and not interpret
    # the interpreter runs the PDL form's peeled first step without the griddepcontrol /
    # prefetch instructions (and launches plainly); a GPU uses it only where PDL is on
    use_pdl = bool(config.pdl) and (interpret or pdl_enabled(x.device))
    pdl_args = {"launch_pdl": True} if use_pdl and not interpret else {}
    prefetch_lines = _next_pow2(-(-config.prefetch * config.block_k // 64)) if use_pdl and config.prefetch else 0
    blocks = -(-n // config.block_n)
    if config.split_k > 1:
        ws = torch.zeros((m, rows), dtype=torch.float32, device=x.device)
        cnt = torch.zeros((blocks,), dtype=torch.int32, device=x.device)
    else:
        ws, cnt = out, out  # never read
    desc = weight
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor(weight, [rows, k], [k, 1], [config.block_n, config.block_k])
    kt._mid_gemm_kernel[(blocks * config.split_k,)](
        x, weight, desc, bias if bias is not None else weight, out, ws, cnt,
        m, n, k, x.stride(0), out.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_M1=m1, BLOCK_M2=max(m2, 16), HAS_M2=m2 > 0,
        SPLIT_K=config.split_k, USE_TMA=use_tma, DOT_UPCAST=interpret and x.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None, GATED=gated, ACT=act if gated else 0,
        USE_PDL=use_pdl, PREFETCH_LINES=prefetch_lines, INTERPRET=interpret,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args,
    )
    return out


def _check(name: str, x, weight, bias) -> None:
    if not mid_gemm_supported(x, weight, bias):
        raise ValueError(
            f"{name}: unsupported x {tuple(x.shape)} {x.dtype} {x.device} / weight {tuple(weight.shape)} "
            f"{weight.dtype} {weight.device} / bias {None if bias is None else tuple(bias.shape)}: need 2-D "
            f"float16/bfloat16 x with 1..{MAX_MID_M} rows and a contiguous last dim on CUDA (or CPU under "
            "TRITON_INTERPRET=1), a contiguous [N, K] weight and an optional unit-stride [N] bias of x's dtype")


def mid_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               config: MidGemmConfig) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in one launch (float32 accumulation, one rounding).

    Args:
        x: ``[M, K]`` float16/bfloat16, ``1 <= M <= MAX_MID_M`` (meant for ``M > 16``),
            contiguous last dim (any row stride).
        weight: contiguous ``[N, K]`` of ``x``'s dtype and device.
        bias: optional unit-stride ``[N]``.
        config: launch parameters (`mid_gemm_config` gives the tuned one).

    Returns:
        new contiguous ``[M, N]`` in ``x``'s dtype.

    Raises:
        ValueError: anything `mid_gemm_supported` rejects, or an invalid ``config``.
    """
    _check("mid_linear", x, weight, bias)
    return _launch(x, weight, bias, None, config)


def mid_linear_gated(x: torch.Tensor, weight: torch.Tensor, activation: str, *,
                     bias: Optional[torch.Tensor] = None, config: MidGemmConfig) -> torch.Tensor:
    """Fused ``gate_up`` projection and gate: ``act(x W_g^T + b_g) * (x W_u^T + b_u)``.

    Args:
        x: as `mid_linear`.
        weight: contiguous ``[2I, K]`` = ``[gate rows | up rows]``.
        activation: ``"silu"`` or ``"gelu_tanh"`` (as `skinny_linear_gated`).
        bias: optional ``[2I]``.
        config: launch parameters (``block_n`` counts gate rows).

    Returns:
        new ``[M, I]`` in ``x``'s dtype (gate and up kept in float32 through the gate).

    Raises:
        ValueError: unknown activation, odd row count, or as `mid_linear`.
    """
    if activation not in SKINNY_ACTIVATIONS:
        raise ValueError(f"mid_linear_gated: activation must be one of {', '.join(map(repr, SKINNY_ACTIVATIONS))}, "
                         f"got {activation!r}")
    _check("mid_linear_gated", x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"mid_linear_gated: weight {tuple(weight.shape)} must have an even number of rows")
    return _launch(x, weight, bias, SKINNY_ACTIVATIONS[activation], config)
