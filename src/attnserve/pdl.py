"""When the decode kernels use programmatic dependent launch (PDL).

PDL (CUDA 11.8+, sm_90+; CUDA programming guide, "Programmatic Dependent Launch and
Synchronization") lets a kernel launched with the ``PROGRAMMATIC_STREAM_SERIALIZATION``
attribute start while the kernel before it in the stream is still running: its programs
run up to ``griddepcontrol.wait`` (Triton: ``tl.extra.cuda.gdc_wait``), which returns once
that kernel has completed and its writes are visible; the earlier kernel may let it start
sooner with ``griddepcontrol.launch_dependents`` (``gdc_launch_dependents``). Inside a CUDA
graph the attribute becomes a programmatic edge, so a replay keeps the overlap.

The attnserve kernels that opt in (the skinny GEMMs, RMSNorm, fused add + RMSNorm and the
RoPE kernel) obey one rule: before the wait they read only parameters (weights, norm
gains), never an activation or anything a kernel writes, and they write nothing. So a
kernel launched early computes what it would have computed launched late, whatever ran
before it (an un-opted kernel, a copy, a collective). In a decode step this overlaps each
weight stream's launch and first loads with the tail of the kernel before it.

``ATTNSERVE_PDL=0`` (or ``false``/``no``/``off``) turns it off everywhere; it is also off on
CPUs, under the Triton interpreter, before Hopper (compute capability < 9) and with a
Triton without the ``gdc_*`` intrinsics (< 3.3).
"""

from __future__ import annotations

import functools

import torch

from attnserve.env_options import env_flag
from attnserve.triton_env import triton_interpreting

__all__ = ["pdl_enabled", "pdl_supported"]



def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with PDL (see the module doc). The
    device's facts are looked up once per device index (`_pdl_capable`); the interpreter
    switch is read at every call."""
    if device.type != "cuda" or triton_interpreting():
        return False
    index = device.index
    if index is None:
        if not torch.cuda.is_available():
            return False
        index = torch.cuda.current_device()
    return _pdl_capable(index)


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    """CUDA device ``index`` exists, is Hopper or newer (compute capability >= 9), and this
    Triton has the ``gdc_*`` intrinsics (>= 3.3). Cached: none of these change in a process."""
    if not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def pdl_enabled(device: torch.device) -> bool:
    """`pdl_supported` and not switched off by ``ATTNSERVE_PDL`` (read at every call, so a
    benchmark can capture graphs with and without it in one process)."""
    if not env_flag("ATTNSERVE_PDL"):
        return False
    return pdl_supported(device)
