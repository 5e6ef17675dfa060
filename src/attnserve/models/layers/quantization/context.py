"""The construction-time switch that defers `Linear` weights while a quantised model is built.

`Linear.__init__` asks `deferring_linear_weights`; inside `quantized_construction` its
weight is created on the ``meta`` device (no memory) and the layer is marked
``quant_pending``, so the bf16 model never exists. `apply.quantize_model_linears` then
gives each pending layer its FP8 parameters (or, for skipped layers, its ordinary weight)
on the real device, by module name. The switch is a `contextvars.ContextVar`: it is set
only inside the ``with`` block of the thread (or task) that builds the model.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

_DEFER: contextvars.ContextVar[bool] = contextvars.ContextVar("attnserve_defer_linear_weights", default=False)


def deferring_linear_weights() -> bool:
    """True inside `quantized_construction` (with a config)."""
    return _DEFER.get()


@contextlib.contextmanager
def quantized_construction(config: Optional[object]) -> Iterator[None]:
    """Defer `Linear` weights while the block runs, when ``config`` is not None."""
    token = _DEFER.set(config is not None)
    try:
        yield
    finally:
        _DEFER.reset(token)
