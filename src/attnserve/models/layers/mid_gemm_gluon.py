"""Warp-specialized, persistent stream-K swap-AB GEMM (Gluon, Hopper) for ``16 < M <= 256`` rows.

``gluon_mid_linear(x, w, bias)`` = ``F.linear`` for a decode batch on sm_90 in one launch;
`mid_gemm_gluon_kernel` explains the kernel (swap-AB wgmma tiles, TMA ring fed by a 1-warp
loader, 1-2 consumer warpgroups, stream-K or split-K with partial tiles fixed up through
float32 workspace slots, optional PDL). This module holds the launch parameters
(`GluonMidGemmConfig`), the pure Python mirrors of the stream-K partition and of the slot fixup (`stream_k_segments`,
`slot_plan`, tested on the CPU), the caller-owned workspace (`GluonMidGemmWorkspace`) and
the launcher.

Determinism: every config is bit-reproducible (a split tile's partial sums are added in
a fixed CTA order, whichever CTA finishes it); different grids may differ in low bits.
`gluon_mid_linear_gated` is the fused ``gate_up``
form with its SiLU / GELU-tanh gate.
Measured against cuBLAS by ``benchmarks/midgemm_gluon.py``; compiled offline (no GPU) by
``scripts/midgemm_gluon_offline.py``.

Not selected by the engine: a caller opts in. Triton (3.6's Gluon API) is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from attnserve.models.layers.mid_gemm import MAX_MID_M, m_pieces
from attnserve.models.layers.skinny_gemm import SKINNY_ACTIVATIONS

__all__ = [
    "GluonMidGemmConfig",
    "ACTIVATIONS",
    "GluonMidGemmWorkspace",
    "REGISTER_PLAN",
    "default_gluon_config",
    "fit_stages",
    "gluon_mid_gemm_supported",
    "gluon_mid_linear",
    "gluon_mid_linear_gated",
    "launch_geometry",
    "operand_problems",
    "slot_plan",
    "stream_k_segments",
]

#: shared memory a CTA may use on sm_90 (227 KB opt-in), less barriers and slack
SMEM_LIMIT = 227 * 1024 - 1024
#: K columns of one TMA box / shared tile (128 bytes of 16-bit values)
CHUNK = 64
#: consumers -> (maxnreg at launch, setmaxnreg of a consumer, of the loader, accumulator registers a
#: consumer may hold). Two consumers: 12 warps (the loader's warpgroup padded) x 168 <= 65,536 at
#: launch, then 240 / 240 / 24 (3 x 168 >= 504). ptxas allocates the whole kernel within the launch
#: maxnreg (a 3-consumer, 16-warp form at 128 failed to compile: a wgmma needed 154), so a consumer's
#: code really has 168. One consumer: ptxas's own choice (8 warps, <= 255 a thread; 192 of them accumulators).
REGISTER_PLAN = {1: (None, 240, 24, 192), 2: (168, 240, 24, 160)}
#: gate activations of `gluon_mid_linear_gated` (the kernel's ``ACT``): `skinny_gemm`'s table
ACTIVATIONS = SKINNY_ACTIVATIONS
_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GluonMidGemmConfig:
    """Launch parameters of `gluon_mid_linear`.

    Attributes:
        block_n: weight rows (output columns) of a CTA tile: 64 or 128 per consumer
            warpgroup (wgmma ``M`` is 64 a warpgroup; 128 rows are two of them).
        block_k: ``K`` columns per unit (stream-K's unit of work), a multiple of 64.
        num_stages: depth of the TMA ring (stages of ``block_n`` weight rows plus the
            activation pieces, ``block_k`` columns each).
        num_consumers: consumer warpgroups (1 or 2); each owns ``block_n / num_consumers``
            rows of every tile (the activation tile is loaded once for both: more rows a tile,
            fewer activation bytes from L2 per weight byte).
        grid: CTAs (0: the device's SM count); capped at the number of units. ``grid ==
            cdiv(N, block_n)`` is a data-parallel launch (no workspace traffic).
        pdl: launch with programmatic dependent launch (weight copies of the first stages
            before ``griddepcontrol.wait``); used only where `attnserve.pdl.pdl_enabled`.
        split_k: when > 0, overrides ``grid`` with ``split_k * cdiv(N, block_n)`` CTAs (a
            split-K by ``split_k``: each tile's K steps shared by ``split_k`` CTAs, one
            segment each where ``split_k`` divides the K steps; 1 is data-parallel).
    """

    block_n: int = 128
    block_k: int = 64
    num_stages: int = 5
    num_consumers: int = 2
    grid: int = 0
    pdl: bool = False
    split_k: int = 0

    @property
    def wg_rows(self) -> int:
        return self.block_n // self.num_consumers

    def validate(self, m: Optional[int] = None, gated: bool = False) -> None:
        """Raise ValueError when the kernel cannot be built with these parameters (for ``m``
        rows, plain or gated: shared memory and accumulator registers too)."""
        problems = []
        if self.num_consumers not in REGISTER_PLAN:
            problems.append("num_consumers must be 1 or 2")
        elif self.block_n % self.num_consumers or self.wg_rows not in (64, 128) or self.block_n > 256:
            problems.append("block_n / num_consumers must be 64 or 128, block_n <= 256 (a TMA box)")
        if self.block_k < CHUNK or self.block_k % CHUNK:
            problems.append(f"block_k must be a positive multiple of {CHUNK}")
        if self.num_stages < 2:
            problems.append("num_stages must be >= 2")
        if self.grid < 0:
            problems.append("grid must be >= 0 (0: SM count)")
        if self.split_k < 0:
            problems.append("split_k must be >= 0 (0: use grid)")
        if m is not None and not problems:
            if not 1 <= m <= MAX_MID_M:
                problems.append(f"m={m} outside 1..{MAX_MID_M}")
            else:
                if self.smem_bytes(m, gated) > SMEM_LIMIT:
                    problems.append(f"shared memory {self.smem_bytes(m, gated)} B > {SMEM_LIMIT} B at m={m}")
                limit = REGISTER_PLAN[self.num_consumers][3]
                if self.acc_regs(m, gated) > limit:
                    problems.append(f"{self.acc_regs(m, gated)} accumulator registers a thread at m={m} (> {limit})")
        if problems:
            raise ValueError(f"invalid {self}: " + "; ".join(problems))

    def smem_bytes(self, m: int, gated: bool = False, itemsize: int = 2) -> int:
        """Bytes of the TMA ring for ``m`` rows: stages x (weight tile(s) + activation pieces)."""
        m1, m2 = m_pieces(m)
        return self.num_stages * ((1 + gated) * self.block_n + m1 + m2) * self.block_k * itemsize

    def acc_regs(self, m: int, gated: bool = False) -> int:
        """float32 accumulator registers a consumer thread holds for ``m`` rows (gated: gate
        and up)."""
        m1, m2 = m_pieces(m)
        return (1 + gated) * self.wg_rows * (m1 + m2) // 128


def fit_stages(config: GluonMidGemmConfig, m: int, gated: bool = False) -> Optional[GluonMidGemmConfig]:
    """``config`` with as many of its stages as fit shared memory at ``m`` rows (>= 2), or
    None when it cannot run there (accumulators over the register plan, or no ring fits)."""
    config = _trim_stages(config, m, gated)
    try:
        config.validate(m, gated)
    except ValueError:
        return None
    return config


def default_gluon_config(m: int, gated: bool = False) -> GluonMidGemmConfig:
    """A config that fits ``m`` rows (before tuning): 2 x 64 rows, ``block_k`` 64, as many
    stages (<= 6) as shared memory allows; gated above 160 rows (gate and up accumulators
    over two consumers' registers): one consumer of 64 rows."""
    cfg = GluonMidGemmConfig(block_n=128, block_k=64, num_stages=6, num_consumers=2)
    if gated and cfg.acc_regs(m, gated) > REGISTER_PLAN[2][3]:
        cfg = GluonMidGemmConfig(block_n=64, block_k=64, num_stages=6, num_consumers=1)
    return _trim_stages(cfg, m, gated)


def _trim_stages(config: GluonMidGemmConfig, m: int, gated: bool) -> GluonMidGemmConfig:
    """``config`` with stages dropped (down to 2) until its ring fits shared memory at ``m`` rows."""
    while config.num_stages > 2 and config.smem_bytes(m, gated) > SMEM_LIMIT:
        config = replace(config, num_stages=config.num_stages - 1)
    return config


def stream_k_segments(n_tiles: int, k_steps: int, grid: int) -> List[List[Tuple[int, int, int]]]:
    """The kernel's stream-K partition, in Python: for each of ``grid`` CTAs the list of its
    ``(tile, k_lo, k_hi)`` segments (K steps ``k_lo <= k < k_hi`` of ``tile``). CTA ``c``
    owns units ``[c * T // grid, (c + 1) * T // grid)`` of the ``T = n_tiles * k_steps``
    units (unit ``u``: tile ``u // k_steps``, step ``u % k_steps``); Osama et al., "Stream-K"
    (PPoPP 2023), basic variant. Mirrors `_consumer`'s loop bounds exactly.

    Raises:
        ValueError: a non-positive argument or ``grid > T`` (the launcher caps the grid).
    """
    total = n_tiles * k_steps
    if n_tiles < 1 or k_steps < 1 or not 1 <= grid <= total:
        raise ValueError(f"stream_k_segments: need n_tiles, k_steps >= 1 and 1 <= grid <= {total}, got "
                         f"{n_tiles}, {k_steps}, {grid}")
    out = []
    for c in range(grid):
        u0, u1 = c * total // grid, (c + 1) * total // grid
        segs = []
        for t in range(u0 // k_steps, (u1 + k_steps - 1) // k_steps):
            segs.append((t, max(u0 - t * k_steps, 0), min(u1 - t * k_steps, k_steps)))
        out.append(segs)
    return out


@dataclass
class GluonMidGemmWorkspace:
    """Caller-owned stream-K / split-K workspace: float32 partial-tile slots and int32 tile
    counters, shared by every launch on one device (each launch takes a prefix of the
    newest, largest pair). The slots need no zeroing (a launch overwrites a slot before
    reading it); the counters are zeroed once when created and left zero by every launch
    (the last CTA of a tile resets its counter), so a CUDA graph replays without memsets.
    Create the buffers before capturing a graph (call once eagerly, e.g. in warm-up, with
    the largest launch first): a buffer created inside a capture is allocated from the
    graph's pool. A launch needing more than the newest pair holds gets a new, larger pair;
    old ones are kept (captured graphs hold their addresses) until the object is dropped.
    One object per stream: two launches sharing a workspace must not run concurrently
    (stream order or PDL's wait orders consecutive ones).

    Kept in an object the caller owns (a model runner, a benchmark) rather than in module
    state: its lifetime is the caller's and tests get fresh ones.

    Attributes:
        buffers: ``str(device) -> [(slots float32 [n], counters int32 [c]), ...]``, oldest
            first.
    """

    buffers: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def get(self, device: torch.device, rows: int, cols: int, counters: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(slots [rows, cols] float32, counters [counters] int32 zeros)`` views on ``device``."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" share buffers
            device = torch.device("cuda", torch.cuda.current_device())
        pairs = self.buffers.setdefault(str(device), [])
        if not pairs or pairs[-1][0].numel() < rows * cols or pairs[-1][1].numel() < counters:
            have = (pairs[-1][0].numel(), pairs[-1][1].numel()) if pairs else (0, 0)
            pairs.append((torch.empty((max(rows * cols, have[0]),), dtype=torch.float32, device=device),
                          torch.zeros((max(counters, have[1]),), dtype=torch.int32, device=device)))
        slots, cnt = pairs[-1]
        return slots[:rows * cols].view(rows, cols), cnt[:counters]

    def counters(self) -> List[torch.Tensor]:
        """Every counter buffer held (all zero between launches)."""
        return [cnt for pairs in self.buffers.values() for _, cnt in pairs]


def operand_problems(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     check_device: bool = True) -> List[str]:
    """Why `gluon_mid_linear` would refuse the operands (empty list: accepted). With
    ``check_device`` False the device (CUDA, sm_90) is not examined (CPU tests)."""
    problems = []
    if x.dim() != 2 or w.dim() != 2:
        return ["x and w must be 2-D"]
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        problems.append("x and w must both be bfloat16 or float16")
    m, k = x.shape
    if not 1 <= m <= MAX_MID_M:
        problems.append(f"M={m} outside 1..{MAX_MID_M}")
    if w.shape[1] != k:
        problems.append(f"w {tuple(w.shape)} does not match K={k}")
    if k % 8:
        problems.append(f"K={k} must be a multiple of 8 (TMA: 16-byte row pitch)")
    if not w.is_contiguous():
        problems.append("w must be contiguous")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or w.data_ptr() % 16:
        problems.append("x needs unit stride along K, a row stride that is a multiple of 8 and 16-byte aligned data")
    if bias is not None and (tuple(bias.shape) != (w.shape[0],) or bias.dtype != x.dtype or bias.device != x.device
                             or bias.stride(0) != 1):
        problems.append("bias must be a unit-stride [N] tensor of x's dtype and device")
    if check_device and (x.device.type != "cuda" or w.device != x.device
                         or torch.cuda.get_device_capability(x.device)[0] != 9):
        problems.append("x and w must be on one sm_90 (Hopper) CUDA device")
    return problems


def gluon_mid_gemm_supported(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether `gluon_mid_linear` accepts the operands: CUDA sm_90 tensors, ``x [M, K]``
    (``1 <= M <= 256``, unit stride along ``K``, 16-byte aligned rows), contiguous ``w
    [N, K]`` of ``x``'s dtype (float16/bfloat16), ``K % 8 == 0`` (TMA: 16-byte row
    pitch; any ``K`` and ``N`` otherwise: the TMA boxes are zero-filled past them), an
    optional unit-stride ``[N]`` bias of that dtype (`operand_problems` says why not)."""
    return not operand_problems(x, w, bias)


def _descriptor(t: torch.Tensor, rows: int, box_rows: int):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return TensorDescriptor(t, [rows, t.shape[1]], [t.stride(0), 1], [box_rows, CHUNK], layout)


def launch_geometry(m: int, n: int, k: int, config: GluonMidGemmConfig, sm_count: int, gated: bool = False) -> dict:
    """Grid and workspace geometry of a launch for ``n`` output columns (pure arithmetic;
    the benchmark and the tests use it too): ``grid``, ``n_tiles``, ``k_steps``, row pieces
    ``m1``/``m2``, ``partials`` (some tile is split between CTAs: ``grid`` does not divide
    ``n_tiles``), the slot workspace ``ws_rows x ws_cols`` (``2 grid`` slots of ``(1 +
    gated) block_n`` rows; 1 row when no tile is split) and ``counters``.

    Raises:
        ValueError: a slot workspace past 2**31 elements or units x grid past 2**31 (the
            kernel's int32 offsets and owner arithmetic).
    """
    m1, m2 = m_pieces(m)
    n_tiles = -(-n // config.block_n)
    k_steps = -(-k // config.block_k)
    grid = min(config.split_k * n_tiles or config.grid or sm_count, n_tiles * k_steps)
    partials = n_tiles % grid != 0
    ws_rows = 2 * grid * (1 + gated) * config.block_n if partials else 1
    if ws_rows * (m1 + m2) >= 2**31 or (n_tiles * k_steps + 1) * grid >= 2**31:
        raise ValueError(f"launch_geometry: {ws_rows} x {m1 + m2} workspace slots or {n_tiles * k_steps} units x "
                         f"grid {grid} overflow the kernel's int32 arithmetic; use a smaller grid")
    return dict(grid=grid, n_tiles=n_tiles, k_steps=k_steps, m1=m1, m2=m2, partials=partials,
                ws_rows=ws_rows, ws_cols=m1 + m2, counters=n_tiles * config.num_consumers)


def slot_plan(n_tiles: int, k_steps: int, grid: int) -> Dict[int, List[Tuple[int, int, int]]]:
    """The kernel's fixup plan, in Python: for each split tile, its contributors in the
    order the finisher sums them, as ``(cta, slot, k_steps_of_the_share)``. Mirrors
    `mid_gemm_gluon_kernel._gather` (contributors ``((u + 1) G - 1) // T`` for the tile's
    first and last unit ``u``, slot ``2 c`` if the CTA's range starts inside the tile, else
    ``2 c + 1``) and `_consumer`'s choice of its own slot; whole tiles are absent."""
    total = n_tiles * k_steps
    plan = {}
    for t in range(n_tiles):
        c_first = ((t * k_steps + 1) * grid - 1) // total
        c_last = ((t + 1) * k_steps * grid - 1) // total
        if c_first == c_last:
            continue  # one CTA holds all of it: written directly
        parts = []
        for c in range(c_first, c_last + 1):
            u0, u1 = c * total // grid, (c + 1) * total // grid
            share = min(u1, (t + 1) * k_steps) - max(u0, t * k_steps)
            parts.append((c, 2 * c + int(u0 < t * k_steps), share))
        plan[t] = parts
    return plan


def _launch(x, w, bias, config, workspace, act: Optional[int]) -> torch.Tensor:
    from attnserve.models.layers import mid_gemm_gluon_kernel as kern
    from attnserve.pdl import pdl_enabled

    gated = act is not None
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    config = config or default_gluon_config(m, gated)
    config.validate(m, gated)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    geo = launch_geometry(m, n, k, config, sms, gated)
    if workspace is None:
        workspace = GluonMidGemmWorkspace()
    ws, cnt = workspace.get(x.device, geo["ws_rows"], geo["ws_cols"], geo["counters"])
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    m1, m2 = geo["m1"], geo["m2"]
    w_desc = _descriptor(w, w.shape[0], config.wg_rows)
    x1_desc = _descriptor(x, m, m1)
    x2_desc = _descriptor(x, m, m2) if m2 else x1_desc
    use_pdl = bool(config.pdl) and pdl_enabled(x.device)
    extra = {"launch_pdl": True} if use_pdl else {}
    maxnreg, consumer_regs, loader_regs, _ = REGISTER_PLAN[config.num_consumers]
    if maxnreg:
        extra["maxnreg"] = maxnreg
    kern._gluon_mid_gemm_kernel[(geo["grid"],)](
        w_desc, x1_desc, x2_desc, bias if bias is not None else w, y, ws, cnt, m, n, k, y.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_M1=m1, BLOCK_M2=max(m2, 16), HAS_M2=m2 > 0,
        NUM_STAGES=config.num_stages, NUM_CONSUMERS=config.num_consumers, HAS_BIAS=bias is not None,
        USE_PDL=use_pdl, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, GATED=gated, ACT=act or 0,
        num_warps=4, **extra,
    )
    return y


def _refuse(name: str, x, w, bias) -> None:
    problems = operand_problems(x, w, bias)
    if problems:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} {x.device} / w {tuple(w.shape)} {w.dtype}: "
                         + "; ".join(problems))


def gluon_mid_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     config: Optional[GluonMidGemmConfig] = None,
                     workspace: Optional[GluonMidGemmWorkspace] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` in one persistent launch (float32 accumulation; bias added
    in float32; one rounding to ``x.dtype``).

    Args:
        x: ``[M, K]`` bfloat16/float16 on an sm_90 GPU, ``1 <= M <= 256`` (meant for
            ``M > 16``), unit stride along ``K``, ``K % 8 == 0``.
        w: contiguous ``[N, K]`` of ``x``'s dtype.
        bias: optional ``[N]`` of ``x``'s dtype.
        config: launch parameters (default: `default_gluon_config`).
        workspace: the caller's `GluonMidGemmWorkspace`; needed for CUDA-graph capture of a
            config whose tiles are shared between CTAs (else a fresh one is made per call:
            two allocations and a memset of the counters).

    Returns:
        new ``[M, N]`` tensor of ``x``'s dtype, bit-reproducible for a given config and
        grid (split tiles are summed in a fixed order).

    Raises:
        ValueError: operands `gluon_mid_gemm_supported` rejects, or an invalid config.
    """
    _refuse("gluon_mid_linear", x, w, bias)
    return _launch(x, w, bias, config, workspace, None)


def gluon_mid_linear_gated(x: torch.Tensor, w: torch.Tensor, activation: str, bias: Optional[torch.Tensor] = None,
                           config: Optional[GluonMidGemmConfig] = None,
                           workspace: Optional[GluonMidGemmWorkspace] = None) -> torch.Tensor:
    """Fused ``gate_up`` projection and gate: ``act(x W_g^T + b_g) * (x W_u^T + b_u)``.

    Args:
        x: as `gluon_mid_linear`.
        w: contiguous ``[2I, K]`` = ``[gate rows | up rows]``.
        activation: ``"silu"`` or ``"gelu_tanh"`` (float32 math).
        bias: optional ``[2I]``.
        config: launch parameters (``block_n`` counts gate rows; a stage holds as many up
            rows, and each consumer twice the accumulators).
        workspace: as `gluon_mid_linear`.

    Returns:
        new ``[M, I]`` in ``x``'s dtype (gate and up kept in float32 through the gate).

    Raises:
        ValueError: unknown activation, odd row count, or as `gluon_mid_linear`.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"gluon_mid_linear_gated: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    _refuse("gluon_mid_linear_gated", x, w, bias)
    if w.shape[0] % 2:
        raise ValueError(f"gluon_mid_linear_gated: weight {tuple(w.shape)} must have an even number of rows")
    return _launch(x, w, bias, config, workspace, ACTIVATIONS[activation])
