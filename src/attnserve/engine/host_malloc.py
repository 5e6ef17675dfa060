"""Host allocator tuning for CPU inference (glibc ``mallopt``).

PyTorch's CPU tensors come from ``malloc``. glibc serves blocks above its mmap threshold
(128 KiB at start, raised dynamically up to the largest block freed so far) with a fresh
``mmap``, whose pages the kernel zero-fills on first touch, and returns them with
``munmap`` on free. A decode loop whose gathered K/V blocks grow by one token a step asks
for a larger block than ever before nearly every step, so it pays that page-fault cost
each step until the threshold has caught up: the first 128-token run of 16 requests of
SmolLM2 on 2 cores was ~7% slower than later ones (benchmarks/NOTES.md, session 11).
Fixing the thresholds (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``; glibc manual,
"Malloc Tunable Parameters") keeps such blocks on the heap and reuses them; CPU serving
guides reach the same end by preloading tcmalloc or jemalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3


def tune_glibc_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Set glibc's mmap and trim thresholds for this process (bytes).

    Blocks below ``mmap_threshold`` come from the heap and are reused after ``free``; free
    heap memory is returned to the OS once more than ``trim_threshold`` accumulates at its
    top. Larger blocks (weights, KV pools) are still mapped and unmapped individually.

    Returns:
        True when both settings were applied; False on a non-glibc platform (nothing changed).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1 and mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    if ok:
        logger.info("glibc malloc: mmap threshold %d MiB, trim threshold %d MiB", mmap_threshold >> 20,
                    trim_threshold >> 20)
    return ok
