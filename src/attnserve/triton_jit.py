"""Small ``@triton.jit`` device functions shared by kernels of several packages.

Imports Triton: only kernel modules import this (they already need Triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh from one exp of a non-positive argument: exact +-1 limits, no overflow
    (``tanh|x| = (1 - e) / (1 + e)`` with ``e = exp(-2|x|)``, sign restored)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)
