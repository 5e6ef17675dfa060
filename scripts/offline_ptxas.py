"""``ptxas -v`` on a PTX string: registers and spills of an offline sm_90a compile.

Shared by the offline compile scripts (``extend_variants_offline.py``, ``fp8_mid_offline.py``),
which build kernels through Triton without a GPU and then ask ptxas what the device's
compile would use (``ptxas -v`` prints ``Used N registers`` and ``B bytes spill stores, L
bytes spill loads`` on stderr; NVIDIA's ptxas documentation, "--verbose").
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from typing import Optional, Tuple


def ptxas_report(ptx: str, ptxas: str, gpu_name: str = "sm_90a") -> Tuple[Optional[str], Optional[Tuple[str, str]]]:
    """``(registers, (spill store bytes, spill load bytes))`` from ``ptxas -v`` on ``ptx``
    (strings as ptxas prints them; None where ptxas printed no such line, e.g. on a crash)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([ptxas, "-v", "--gpu-name", gpu_name, f.name, "-o", f.name + ".o"],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return (regs.group(1) if regs else None), (spill.groups() if spill else None)
