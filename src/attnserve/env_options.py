"""Settings read from environment variables: on/off switches of optional paths and byte
sizes (thresholds that benchmarks override)."""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["env_bytes", "env_flag", "env_float", "env_int"]

#: values that turn a switch off (any case, surrounding spaces ignored)
OFF_VALUES = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = True) -> bool:
    """Switch ``name`` (read at every call, so one process can time both settings): unset or
    empty gives ``default``; set, it is on unless one of `OFF_VALUES`."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    return raw not in OFF_VALUES


def env_bytes(name: str, unit: int, *, positive: bool = False,
              environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The size that variable ``name`` gives as a number of ``unit`` bytes (e.g. ``1 << 20``
    for MiB; fractions allowed), truncated to whole bytes; None when it is unset or empty.

    Raises:
        ValueError: set but not a number ``>= 0`` (``> 0`` with ``positive``), naming the
            variable and the unit.
    """
    env = os.environ if environ is None else environ
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 if positive else value >= 0):
        what = "> 0" if positive else ">= 0"
        units = {1 << 10: "KiB", 1 << 20: "MiB"}.get(unit, f"{unit}-byte units")
        raise ValueError(f"{name}={raw!r}: expected a number {what} of {units}")
    return int(value * unit)


def _env_number(name: str, default, lo, hi, note: str, parse, what: str):
    """``parse`` of variable ``name`` (read at every call), ``default`` when unset or empty;
    a ValueError naming the variable, ``what`` it should be, the range and ``note`` otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:  # NaN fails both comparisons
        raise ValueError(f"{name}={raw!r}: expected {what} in {lo}..{hi}" + (f" ({note})" if note else ""))
    return value


def env_int(name: str, default: int, lo: int, hi: int, note: str = "") -> int:
    """The integer variable ``name`` gives (read at every call, so one process can time
    several values), ``default`` when it is unset or empty.

    Raises:
        ValueError: set but not an integer in ``lo..hi``, naming the variable, the range and
            ``note`` (what a value means).
    """
    return _env_number(name, default, lo, hi, note, int, "an integer")


def env_float(name: str, default: float, lo: float, hi: float, note: str = "") -> float:
    """The number variable ``name`` gives (read at every call), ``default`` when it is unset
    or empty.

    Raises:
        ValueError: set but not a number in ``lo..hi``, naming the variable, the range and
            ``note`` (what a value means).
    """
    return _env_number(name, default, lo, hi, note, float, "a number")
