"""Whether Triton kernels run under Triton's CPU interpreter (``TRITON_INTERPRET``).

One rule for the whole package, Triton's own (``triton.knobs.getenv_bool``: the value,
lower-cased, is one of ``1``/``true``/``yes``/``on``). Imports nothing heavy.
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def triton_interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value (kernels run on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE
