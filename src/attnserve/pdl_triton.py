"""Device side of `attnserve.pdl`: the grid-dependency intrinsics.

``gdc_wait`` / ``gdc_launch_dependents`` are Triton's (``triton.language.extra.cuda``,
Triton >= 3.3; PTX ``griddepcontrol.wait`` / ``.launch_dependents``). With an older Triton
they are replaced by no-ops, and `pdl.pdl_supported` is False, so no kernel is launched
with PDL there: a kernel must call them only under a ``USE_PDL`` constexpr that the host
sets from `pdl.pdl_enabled`. Imports Triton: only kernel modules import this.
"""

from __future__ import annotations

import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton < 3.3

    @triton.jit
    def gdc_wait():
        """No-op stand-in (no PDL launches happen with this Triton)."""
        pass

    @triton.jit
    def gdc_launch_dependents():
        """No-op stand-in (no PDL launches happen with this Triton)."""
        pass


__all__ = ["gdc_launch_dependents", "gdc_wait"]
