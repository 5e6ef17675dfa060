"""Custom all-reduce for small messages over PyTorch symmetric memory (one node, peer access).

A tensor-parallel decode step runs two all-reduces of a few KB per layer; NCCL's ring or
tree algorithms are latency-bound there. Like SGLang's and vLLM's custom all-reduce (and
TensorRT-LLM's one-shot / two-shot kernels), `CustomAllReduce` keeps one persistent buffer
that every rank of the group can read (``torch.distributed._symmetric_memory``: ``empty`` +
``rendezvous`` map each rank's buffer into its peers' address space and give each
allocation a signal pad for device-side barriers) and runs PyTorch's built-in kernels:

* **one-shot** (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``): copy the local input
  into the own buffer, barrier, every rank reads all ``W`` buffers and sums them
  (``W`` reads of the message per rank; one barrier round).
* **two-shot** (``torch.ops.symm_mem.two_shot_all_reduce_out``): copy in, barrier, each rank
  reduces its ``1/W`` slice of all buffers (reduce-scatter), barrier, every rank gathers the
  reduced slices (all-gather): ``2 (W-1)/W`` of the message per rank, two barrier rounds.
* **NCCL** above ``two_shot_max_bytes`` (measured against two-shot at start-up up to 64 MiB,
  `all_reduce_calibration`: hosts of one kind differ threefold in NCCL's large-message rate),
  for dtypes the kernels lack (only float32 and bfloat16 are built), for non-contiguous
  inputs, and wherever symmetric memory or peer access is missing (CPU / gloo, one GPU,
  several nodes, an old torch): `select_algorithm`.

The ops read no host state after the rendezvous, so they are captured in CUDA graphs (the
decode graphs of ``engine/cuda_graph_runner.py``); every rank must issue the same sequence of
all-reduces (tensor parallelism does). NVLink multicast (NVLS, ``multimem`` operations) is
never used: the machines here forbid it, so ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set
before the rendezvous. For two ranks ``a + b`` has one rounding whatever the order, so the
result is bit-identical to NCCL's.

Past PyTorch's region the buffer also holds the region of the fused all-reduce + residual
add + RMSNorm kernel (`fused_all_reduce`, `CustomAllReduce.fused_all_reduce_add_rmsnorm`)
unless ``--disable-allreduce-fusion``; with ``ATTNSERVE_ALLREDUCE_FUSION_MODE=push`` also the
push-mode kernel's Lamport region (`fused_all_reduce_push`), and the fused calls run that kernel;
with ``twoshot`` the two-shot kernel's region (`fused_all_reduce_two_shot`), and the fused calls
of at least ``two_shot_min_bytes`` run that kernel (smaller ones the pull kernel).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

logger = logging.getLogger(__name__)

ONE_SHOT = "one_shot"
TWO_SHOT = "two_shot"
NCCL = "nccl"
#: `CustomAllReduce.calls` key of the fused all-reduce + add + RMSNorm launches
FUSED = "fused_add_rmsnorm"

#: dtypes PyTorch's symmetric-memory reduction kernels are built for
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
#: world sizes ``two_shot_all_reduce_out`` is built for (one-shot takes any)
TWO_SHOT_WORLD_SIZES = (2, 4, 8)
#: the vector width of the kernels: padded sizes and two-shot alignment (bytes)
_ALIGN = 16


@dataclass(frozen=True)
class CustomAllReduceConfig:
    """Message-size thresholds, in bytes of the input tensor (``numel * element_size``).

    Attributes:
        one_shot_max_bytes: messages of at most this many bytes run one-shot.
        two_shot_max_bytes: larger messages up to this run two-shot (world sizes 2, 4, 8);
            above it NCCL. Also the symmetric buffer's size per rank.
    """

    one_shot_max_bytes: int
    two_shot_max_bytes: int

    def __post_init__(self):
        if self.one_shot_max_bytes < 0 or self.two_shot_max_bytes < 0:
            raise ValueError(f"custom all-reduce thresholds must be >= 0, got {self}")

    @property
    def buffer_bytes(self) -> int:
        """Symmetric buffer bytes per rank (a one-shot message is padded to 16 bytes)."""
        return _round_up(max(self.one_shot_max_bytes, self.two_shot_max_bytes, _ALIGN), _ALIGN)


def default_config(world_size: int) -> CustomAllReduceConfig:
    """Thresholds measured with ``benchmarks/allreduce_bench.py`` (bfloat16, inside CUDA graphs).

    2 ranks: two H100 80GB HBM3 over NVLink (NV18), torch 2.11, NCCL 2.28.9, 2026-11-26
    (``benchmarks/results/h100-80gb-hbm3-allreduce-2026-11-26.json``): one-shot was the fastest
    up to 1 MB (8.1 µs vs NCCL's 12.8 µs at 1 KB, 16.7 vs 24.4 at 1 MB); two-shot from 2 MB
    to 16 MB (75 vs 94 µs at 16 MB); at 32 MB two-shot led by 7%, inside the run-to-run
    spread, and at 64 MB NCCL led, so NCCL takes everything over 16 MB.

    4 ranks: four H200s, same software, 2026-11-26 (``h200-allreduce-2026-11-26.json``, world
    size 4): one-shot fastest up to 512 KB (6.5 µs vs NCCL's 18.6 at 1 KB, 13.3 vs 25.0 at
    512 KB), two-shot from 1 MB to 16 MB (96.7 vs 110.9 µs at 16 MB; at 32 MB 184.5 vs 192.9,
    inside the spread). 8 ranks are not measured: one-shot reads ``W`` times the message per
    rank, so both ranges are taken smaller there until a ``--world-size 8`` run sets them.
    """
    if world_size <= 2:
        return CustomAllReduceConfig(one_shot_max_bytes=1 << 20, two_shot_max_bytes=16 << 20)
    if world_size <= 4:
        return CustomAllReduceConfig(one_shot_max_bytes=512 << 10, two_shot_max_bytes=16 << 20)
    return CustomAllReduceConfig(one_shot_max_bytes=128 << 10, two_shot_max_bytes=4 << 20)


#: environment override of `default_config`'s two-shot ceiling, in MiB (for measuring a
#: larger symmetric buffer against NCCL inside an engine; unset: the measured default)
TWO_SHOT_MAX_ENV = "ATTNSERVE_TWO_SHOT_MAX_MB"


def config_from_env(world_size: int) -> CustomAllReduceConfig:
    """`default_config`, with ``ATTNSERVE_TWO_SHOT_MAX_MB`` (a positive number of MiB) as the
    two-shot ceiling when set.

    Raises:
        ValueError: the variable is set but not a positive number.
    """
    from attnserve.env_options import env_bytes

    config = default_config(world_size)
    size = env_bytes(TWO_SHOT_MAX_ENV, 1 << 20, positive=True)
    if size is None:
        return config
    return CustomAllReduceConfig(one_shot_max_bytes=config.one_shot_max_bytes,
                                 two_shot_max_bytes=size // _ALIGN * _ALIGN)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def select_algorithm(numel: int, dtype: torch.dtype, contiguous: bool, offset_bytes: int, world_size: int,
                     config: CustomAllReduceConfig) -> str:
    """Which all-reduce a message takes: `ONE_SHOT`, `TWO_SHOT` or `NCCL`.

    Args:
        numel / dtype: the message; ``numel * itemsize`` is compared with ``config``.
        contiguous: the kernels take dense tensors only.
        offset_bytes: ``storage_offset * itemsize`` of the output (two-shot writes it with
            16-byte vectors, so it must be 16-byte aligned; one-shot pads through scratch).
        world_size: ranks in the group (two-shot is built for 2, 4 and 8).
    A pure function of its arguments, so every rank of a group picks the same path.
    """
    if dtype not in SUPPORTED_DTYPES or not contiguous or numel == 0 or world_size < 2:
        return NCCL
    nbytes = numel * dtype.itemsize
    if _round_up(nbytes, _ALIGN) <= config.one_shot_max_bytes:
        return ONE_SHOT
    if (nbytes <= config.two_shot_max_bytes and world_size in TWO_SHOT_WORLD_SIZES and nbytes % _ALIGN == 0
            and offset_bytes % _ALIGN == 0):
        return TWO_SHOT
    return NCCL


def local_unavailable_reason(device: torch.device, world_size: int, backend: Optional[str]) -> Optional[str]:
    """Why this rank cannot run the custom all-reduce (None: it can, as far as it alone can tell).

    Checks: a CUDA device, at least 2 ranks, an NCCL device group, and a torch with
    symmetric memory and the ``symm_mem`` one-shot / two-shot ops.
    """
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if world_size < 2:
        return "one rank"
    if backend != "nccl":
        return f"device group backend is {backend!r}, not nccl"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no symmetric memory ({e})"
    ops = getattr(torch.ops, "symm_mem", None)
    for name in ("one_shot_all_reduce_out", "two_shot_all_reduce_out"):
        if ops is None or not hasattr(ops, name):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.{name}"
    return None


def peer_access_reason(places: list, local_device: int) -> Optional[str]:
    """Why the ranks at ``places`` (``(hostname, cuda index)`` of each rank, rank order) cannot
    read each other's memory from ``local_device`` (None: they can)."""
    hosts = {h for h, _ in places}
    if len(hosts) > 1:
        return f"ranks span {len(hosts)} hosts"
    for _, dev in places:
        if dev != local_device and not torch.cuda.can_device_access_peer(local_device, dev):
            return f"cuda:{local_device} has no peer access to cuda:{dev}"
    return None


def agree(reason: Optional[str], cpu_group: Any, rank: int) -> Optional[str]:
    """Every rank's verdict, combined over ``cpu_group`` (a collective of the group): the
    first rank's reason that is not None, as ``"rank R: reason"``, or None when all can."""
    import torch.distributed as dist

    reasons: list = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(reasons, reason, group=cpu_group)
    for r, why in enumerate(reasons):
        if why is not None:
            return f"rank {r}: {why}"
    return None


@dataclass
class CustomAllReduce:
    """One rank's symmetric buffer and the kernels over it. Build with `init_custom_all_reduce`.

    Attributes:
        rank / world_size: in the group.
        group_name: ``ProcessGroup.group_name`` of the NCCL device group.
        config: thresholds.
        buffer: this rank's symmetric buffer, ``config.buffer_bytes`` uint8 on the device.
        scratch: local output for padded one-shot messages (``config.one_shot_max_bytes``).
        calls: Python-level calls per algorithm (a captured graph counts once, at capture);
            ``FUSED``: fused all-reduce + add + RMSNorm launches.
        fusion: the fused kernel's `FusedAllReduce` (None: off, ``--disable-allreduce-fusion``
            or its start-up probe failed).
        calibration: the start-up measurement that set ``config.two_shot_max_bytes``
            (`all_reduce_calibration.Calibration`; None: the thresholds were not measured here).
    """

    rank: int
    world_size: int
    group_name: str
    config: CustomAllReduceConfig
    buffer: torch.Tensor
    scratch: torch.Tensor
    calls: Dict[str, int] = field(default_factory=lambda: {ONE_SHOT: 0, TWO_SHOT: 0, NCCL: 0, FUSED: 0})
    fusion: Optional[Any] = None
    calibration: Optional[Any] = None

    def select(self, x: torch.Tensor) -> str:
        """`select_algorithm` for ``x``."""
        return select_algorithm(x.numel(), x.dtype, x.is_contiguous(), x.storage_offset() * x.element_size(),
                                self.world_size, self.config)

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum ``x`` over the ranks in place if a custom path takes it.

        Returns:
            True when done here; False when the caller must run NCCL (`select` said so).
        Raises:
            RuntimeError from the kernels (e.g. a device on another rank is lost).
        """
        algo = self.select(x)
        self.calls[algo] += 1
        if algo == NCCL:
            return False
        flat = x.view(-1)
        n = flat.numel()
        ops = torch.ops.symm_mem
        if algo == ONE_SHOT:
            aligned = (x.storage_offset() * x.element_size()) % _ALIGN == 0 and (n * x.element_size()) % _ALIGN == 0
            if aligned and hasattr(ops, "one_shot_all_reduce_copy_out"):
                # copy-in and reduction in one kernel (the buffer view and input share alignment)
                ops.one_shot_all_reduce_copy_out(self._view(x.dtype, n), flat, "sum", self.group_name, flat)
                return True
            padded = _round_up(n * x.element_size(), _ALIGN) // x.element_size()
            sym = self._view(x.dtype, padded)
            sym[:n].copy_(flat)  # the tail holds stale values; their sums are dropped
            out = self.scratch.view(x.dtype)[:padded]
            ops.one_shot_all_reduce_out(sym, "sum", self.group_name, out)
            flat.copy_(out[:n])
            return True
        self.two_shot_in_place(flat)
        return True

    def two_shot_in_place(self, x: torch.Tensor) -> None:
        """The two-shot kernel on ``x`` in place, whatever the thresholds (the caller checks
        `select_algorithm`'s conditions: a dense, 16-byte aligned message of a supported dtype
        that fits the buffer; `all_reduce_calibration.measure` times it)."""
        flat = x.view(-1)
        sym = self._view(x.dtype, flat.numel())
        sym.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(sym, "sum", self.group_name, flat)

    def fused_all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                     eps: float, weight_offset: float = 0.0) -> Optional[torch.Tensor]:
        """One kernel for ``residual += all_reduce(x); return rmsnorm(residual)`` when the
        one-shot path would take ``x`` and `fused_all_reduce.fused_unsupported_reason` finds
        nothing; else None (the caller runs `all_reduce` and the norm). A pure function of
        shapes and dtypes, so every rank takes the same branch."""
        f = self.fusion
        if f is None or self.select(x) != ONE_SHOT:
            return None
        from attnserve.distributed.fused_all_reduce import fused_all_reduce_add_rmsnorm, fused_unsupported_reason

        if fused_unsupported_reason(x, residual, weight, f.region) is not None:
            return None
        self.calls[FUSED] += 1
        if f.two_shot is not None and f.two_shot.takes(x):  # twoshot mode, a message large enough
            from attnserve.distributed.fused_all_reduce_two_shot import fused_all_reduce_add_rmsnorm_two_shot

            return fused_all_reduce_add_rmsnorm_two_shot(x, residual, weight, eps, weight_offset, f.buffer_ptrs,
                                                         f.counters[2:], self.rank, f.two_shot)
        return fused_all_reduce_add_rmsnorm(x, residual, weight, eps, weight_offset, f.buffer_ptrs, f.counters,
                                            self.rank, f.region, lamport=f.lamport)

    def _view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        # always from offset 0: the ops find the rendezvous handle by the data pointer
        return self.buffer.view(dtype)[:numel]


def init_custom_all_reduce(rank: int, world_size: int, device_group: Any, cpu_group: Any,
                           device: torch.device, disable: bool = False,
                           config: Optional[CustomAllReduceConfig] = None,
                           disable_fusion: bool = False) -> Optional[CustomAllReduce]:
    """Build this rank's `CustomAllReduce`, or None where NCCL must carry every all-reduce.

    A collective over ``cpu_group`` (every rank calls it with the same ``disable``): the ranks
    agree on availability first, so either all of them get one or none does; the reason is
    logged. Call it before any CUDA graph capture (the rendezvous cannot be captured).

    Args:
        rank / world_size: in the group.
        device_group: the NCCL group the buffer is registered with.
        cpu_group: a gloo group of the same ranks (the agreement).
        device: this rank's CUDA device.
        disable: ``--disable-custom-all-reduce``.
        config: thresholds (default: `config_from_env`, i.e. `default_config` unless
            ``ATTNSERVE_TWO_SHOT_MAX_MB`` is set; without that variable, and unless
            ``ATTNSERVE_ALLREDUCE_CALIBRATE=0``, the two-shot ceiling is then measured up to
            64 MiB on this host, `all_reduce_calibration`, and the buffer sized for 64 MiB).
        disable_fusion: ``--disable-allreduce-fusion`` (no `CustomAllReduce.fusion`). Else
            the fused kernel is compiled and probed on every rank, and turned off on all of
            them (a warning) when any rank fails; which kernel (pull, push or twoshot) is read
            once here from ``ATTNSERVE_ALLREDUCE_FUSION_MODE`` (`fused_all_reduce_push.fusion_mode_from_env`),
            and in twoshot mode its threshold (`fused_all_reduce_two_shot.two_shot_min_bytes`).
    Raises:
        ValueError: ``ATTNSERVE_ALLREDUCE_FUSION_MODE`` is not ``pull``, ``push`` or ``twoshot``,
            or ``ATTNSERVE_TWO_SHOT_FUSED_MIN_KB`` / ``ATTNSERVE_PUSH_ROW_SPLITS`` is bad (on every
            rank alike, before any collective: the ranks inherit one environment).
    """
    import torch.distributed as dist

    from attnserve.distributed.all_reduce_calibration import CALIBRATION_MAX_BYTES, calibration_wanted
    from attnserve.distributed.fused_all_reduce_push import (PULL, PUSH, TWOSHOT, fusion_mode_from_env,
                                                             row_splits_from_env)
    from attnserve.distributed.fused_all_reduce_two_shot import two_shot_min_bytes

    if world_size < 2:
        return None
    fusion_mode = PULL if disable_fusion else fusion_mode_from_env()
    two_shot_min = two_shot_min_bytes(world_size) if fusion_mode == TWOSHOT else None
    max_row_splits = row_splits_from_env() if fusion_mode == PUSH else 1
    if disable:
        logger.info("custom all-reduce off (--disable-custom-all-reduce): NCCL carries every all-reduce")
        return None
    backend = dist.get_backend(device_group) if device_group is not None else None
    reason = local_unavailable_reason(device, world_size, backend)
    places: list = [None] * world_size
    here = (socket.gethostname(), device.index if device.index is not None else -1)
    dist.all_gather_object(places, here, group=cpu_group)
    if reason is None:
        reason = peer_access_reason(places, here[1])
    reason = agree(reason, cpu_group, rank)
    custom = None
    level = logging.INFO
    measured = config is None and calibration_wanted(world_size)
    if config is None:
        config = config_from_env(world_size)
    if reason is None:
        built = config  # with a measurement to come, the buffer holds any ceiling it may choose
        if measured:
            built = CustomAllReduceConfig(config.one_shot_max_bytes, max(config.two_shot_max_bytes,
                                                                         CALIBRATION_MAX_BYTES))
        try:
            custom = _build(rank, world_size, device_group, cpu_group, device, built,
                            fusion=not disable_fusion, fusion_mode=fusion_mode, two_shot_min=two_shot_min,
                            max_row_splits=max_row_splits)
        except Exception as e:  # a torch whose symmetric memory cannot start here; RendezvousSkew
            reason = f"symmetric memory failed: {type(e).__name__}: {e}"
        reason = agree(reason, cpu_group, rank)
        level = logging.WARNING  # available here, yet not for this engine: say so louder
        if reason is None:
            custom.config = config
            if measured:
                _calibrate(custom, device_group, cpu_group)
    if reason is not None:
        if rank == 0:
            logger.log(level, "custom all-reduce off (%s): NCCL carries every all-reduce", reason)
        return None
    fusion = "off (--disable-allreduce-fusion)" if disable_fusion else f"on ({fusion_mode})"
    if fusion_mode == PUSH:
        fusion = f"on (push, rows cut into up to {max_row_splits} programs)"
    if two_shot_min is not None:
        fusion = f"on (twoshot from {two_shot_min // 1024} KB, pull below)"
    if custom.fusion is not None:
        why = _start_fusion(custom, cpu_group)
        if why is not None:
            custom.fusion = None
            fusion = f"off ({why})"
            if rank == 0:
                logger.warning("fused all-reduce + RMSNorm off (%s): all-reduce and norm run apart", why)
    if rank == 0:
        c = custom.config
        logger.info("custom all-reduce on (%d ranks, symmetric memory): one-shot <= %d KB, two-shot <= %d KB, "
                    "NCCL above; fused all-reduce + RMSNorm %s", world_size, c.one_shot_max_bytes // 1024,
                    c.two_shot_max_bytes // 1024, fusion)
    return custom


def _calibrate(custom: CustomAllReduce, device_group: Any, cpu_group: Any) -> None:
    """Set ``custom.config``'s two-shot ceiling by measurement (`all_reduce_calibration`); on a
    failure on any rank every rank keeps the default ceiling (a warning)."""
    from attnserve.distributed.all_reduce_calibration import calibrate

    why, cal = None, None
    try:
        cal = calibrate(custom, device_group, cpu_group, custom.config.two_shot_max_bytes)
    except Exception as e:  # e.g. out of memory for the 64 MiB test messages
        why = f"{type(e).__name__}: {e}"
    why = agree(why, cpu_group, custom.rank)
    custom.calls.update({k: 0 for k in custom.calls})
    if why is not None or cal is None:
        if why is not None and custom.rank == 0:
            logger.warning("all-reduce calibration failed (%s): two-shot up to the default %d KB", why,
                           custom.config.two_shot_max_bytes // 1024)
        return
    custom.calibration = cal
    custom.config = CustomAllReduceConfig(custom.config.one_shot_max_bytes, cal.ceiling)
    if custom.rank == 0:
        table = ", ".join(f"{s >> 20} MiB {t:.0f}/{n:.0f} µs" for s, t, n in zip(cal.sizes, cal.two_shot_us,
                                                                              cal.nccl_us))
        logger.info("all-reduce calibration (two-shot / NCCL, slowest rank): %s -> two-shot up to %d KB", table,
                    cal.ceiling // 1024)


def _start_fusion(custom: CustomAllReduce, cpu_group: Any) -> Optional[str]:
    """Compile the fused kernel on every rank, then (all compiled) run it twice on a probe
    (both halves of the buffer; push mode: four times, every phase and a cleared one again)
    and check the sums; the ranks' joint verdict (None: on).
    A collective over ``cpu_group``: a rank that failed to compile never leaves the others
    waiting inside the kernel."""
    from attnserve.distributed.fused_all_reduce import compile_fused

    f, dev, w = custom.fusion, custom.buffer.device, custom.world_size
    x = torch.full((2, 64), float(custom.rank + 1), dtype=torch.float32, device=dev)
    residual = torch.full_like(x, 0.5)
    weight = torch.ones(64, dtype=torch.float32, device=dev)
    why = None
    try:
        compile_fused(x, residual, weight, f.buffer_ptrs, f.counters, custom.rank, f.region, lamport=f.lamport)
        if f.two_shot is not None:
            from attnserve.distributed.fused_all_reduce_two_shot import compile_two_shot

            compile_two_shot(x, residual, weight, f.buffer_ptrs, f.counters[2:], custom.rank, f.two_shot)
    except Exception as e:  # a Triton without the atomics' scopes, a driver that refuses int_to_ptr...
        why = f"compile failed: {type(e).__name__}: {e}"
    why = agree(why, cpu_group, custom.rank)
    if why is not None:
        return why
    try:
        from attnserve.distributed.fused_all_reduce import fused_all_reduce_add_rmsnorm

        total = w * (w + 1) / 2
        for call in range(1, 3 if f.lamport is None else 5):
            out = fused_all_reduce_add_rmsnorm(x, residual, weight, 1e-6, 0.0, f.buffer_ptrs, f.counters,
                                               custom.rank, f.region, lamport=f.lamport)
            want = call * total + 0.5
            if not (bool((residual == want).all()) and float((out - 1).abs().max()) < 1e-3):
                why = f"probe gave residual {residual.flatten()[:2].tolist()}, expected {want}"
                break
        if why is None and f.two_shot is not None:
            from attnserve.distributed.fused_all_reduce_two_shot import probe_two_shot

            why = probe_two_shot(f.buffer_ptrs, f.counters[2:], custom.rank, f.two_shot, dev)
    except Exception as e:
        why = f"probe failed: {type(e).__name__}: {e}"
    return agree(why, cpu_group, custom.rank)


def _build(rank: int, world_size: int, device_group: Any, cpu_group: Any, device: torch.device,
           config: CustomAllReduceConfig, fusion: bool = False, fusion_mode: str = "pull",
           two_shot_min: Optional[int] = None, max_row_splits: int = 1) -> CustomAllReduce:
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # no NVLink multicast object at the rendezvous
    import torch.distributed._symmetric_memory as symm_mem

    from attnserve.distributed.fused_all_reduce import FusedAllReduce, FusedRegion
    from attnserve.distributed.fused_all_reduce_push import PUSH, PUSH_COUNTERS, TWOSHOT, LamportRegion
    from attnserve.distributed.fused_all_reduce_two_shot import TwoShotRegion, two_shot_min_bytes
    from attnserve.distributed.symm_mem_rendezvous import aligned_rendezvous

    region = FusedRegion.after(config.buffer_bytes, config.one_shot_max_bytes, world_size) if fusion else None
    lamport = None
    if region is not None and fusion_mode == PUSH:
        lamport = LamportRegion.after(region.end, config.one_shot_max_bytes, world_size, max_row_splits)
    two_shot = None
    if region is not None and fusion_mode == TWOSHOT:
        two_shot = TwoShotRegion.after(region.end, config.one_shot_max_bytes, world_size,
                                       two_shot_min_bytes(world_size) if two_shot_min is None else two_shot_min)
    end = lamport.end if lamport is not None else region.end if region is not None else config.buffer_bytes
    end = two_shot.end if two_shot is not None else end
    buffer = symm_mem.empty(end, dtype=torch.uint8, device=device)
    if region is not None:  # flags start at 0 before any peer can learn the address (the rendezvous)
        buffer[region.flags_offset:region.end].zero_()
        if lamport is not None:  # and every push slot at the sentinel
            lamport.fill_sentinels(buffer)
        if two_shot is not None:  # and the two-shot kernel's flags
            buffer[two_shot.flags_offset:two_shot.end].zero_()
        torch.cuda.synchronize(device)
    handle = aligned_rendezvous(buffer, device_group, cpu_group)  # RendezvousSkew: NCCL for this engine
    scratch = torch.empty(_round_up(max(config.one_shot_max_bytes, _ALIGN), _ALIGN), dtype=torch.uint8,
                          device=device)
    custom = CustomAllReduce(rank=rank, world_size=world_size, group_name=device_group.group_name, config=config,
                             buffer=buffer, scratch=scratch)
    probe = torch.full((4,), float(rank + 1), dtype=torch.float32, device=device)
    custom.all_reduce(probe)  # a wrong mapping shows here, not inside a captured graph
    want = world_size * (world_size + 1) / 2
    if not bool((probe == want).all()):
        raise RuntimeError(f"probe all-reduce gave {probe.tolist()}, expected {want}")
    custom.calls[ONE_SHOT] = 0
    if region is not None:
        ptrs = _peer_addresses(handle, buffer, rank, world_size)
        n_counters = PUSH_COUNTERS if lamport is not None else 4 if two_shot is not None else 2
        counters = torch.zeros(n_counters, dtype=torch.int64, device=device)
        custom.fusion = FusedAllReduce(region, torch.tensor(ptrs, dtype=torch.int64, device=device), counters,
                                       lamport=lamport, two_shot=two_shot)
    return custom


def _peer_addresses(handle: Any, buffer: torch.Tensor, rank: int, world_size: int) -> list:
    """Every rank's ``buffer`` as mapped in this process (rank order): ``get_buffer`` views,
    or, where those do not start at our own tensor, the allocations' bases shifted by our
    tensor's offset in its allocation (the same on every rank: same sizes, same order)."""
    try:
        ptrs = [handle.get_buffer(r, (buffer.numel(),), torch.uint8, 0).data_ptr() for r in range(world_size)]
        if ptrs[rank] == buffer.data_ptr():
            return ptrs
    except (RuntimeError, TypeError):  # an older binding
        pass
    bases = list(handle.buffer_ptrs)
    shift = buffer.data_ptr() - bases[rank]
    return [b + shift for b in bases]
