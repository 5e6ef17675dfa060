"""Shared pieces of the offline sm_90a compile scripts (no GPU needed).

Used by ``prefill_gluon_offline.py``, ``decode_fp8_gluon_offline.py``, ``midgemm_gluon_offline.py``,
``extend_variants_offline.py`` and ``fp8_mid_offline.py``, which build kernels through Triton
(``ASTSource`` / ``GluonASTSource``, ``GPUTarget("cuda", 90, 32)``) and then ask ptxas what the
device's compile would use (``ptxas -v`` prints ``Used N registers`` and ``B bytes spill
stores, L bytes spill loads`` on stderr; NVIDIA's ptxas documentation, "--verbose").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import subprocess
import tempfile
from typing import Callable, Collection, Dict, Mapping, Optional, Tuple


def ptxas_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first paragraph, with ``--ptxas``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--ptxas", help="ptxas for the -v report (default: Triton's)")
    return ap


def ptxas_path(arg: Optional[str]) -> str:
    """``arg``, or the ptxas Triton itself uses (``triton.knobs.nvidia.ptxas.path``)."""
    from triton import knobs

    return arg or knobs.nvidia.ptxas.path


def ptxas_verbose(ptx: str, ptxas: str, gpu_name: str = "sm_90a") -> str:
    """stderr of ``ptxas -v --gpu-name gpu_name`` on ``ptx`` (compiled to a temporary file)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    return subprocess.run([ptxas, "-v", "--gpu-name", gpu_name, f.name, "-o", f.name + ".o"],
                          capture_output=True, text=True).stderr


def ptxas_report(ptx: str, ptxas: str, gpu_name: str = "sm_90a") -> Tuple[Optional[str], Optional[Tuple[str, str]]]:
    """``(registers, (spill store bytes, spill load bytes))`` from ``ptxas -v`` on ``ptx``
    (strings as ptxas prints them; None where ptxas printed no such line, e.g. on a crash)."""
    out = ptxas_verbose(ptx, ptxas, gpu_name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return (regs.group(1) if regs else None), (spill.groups() if spill else None)


def compile_sm90a(fn, const: Mapping[str, object], types: Mapping[str, str], options: Dict[str, object],
                  divisible: Optional[Collection[str]] = None, gluon: bool = False):
    """Triton's sm_90a compile of the JIT function ``fn`` as a launch would specialise it.

    ``const``: the constexpr arguments' values; ``types``: the other arguments' signature types
    (Triton's strings: ``"*bf16"``, ``"fp32"``, ``"tensordesc<...>"``; absent: ``"i32"``);
    ``divisible``: the arguments assumed 16-divisible (``tt.divisibility``, as the JIT
    specialises pointers and strides; None: the pointers of ``types`` and the ``stride*``
    arguments); ``options``: ``num_warps``, ``num_stages``, ...;
    ``gluon``: a ``@gluon.jit`` function. Returns the compiled kernel (``asm["ptx"]``, ``metadata``);
    raises what ``triton.compile`` raises."""
    import triton
    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    names = fn.arg_names
    if divisible is None:
        divisible = {n for n, t in types.items() if t.startswith("*")} | {n for n in names if n.startswith("stride")}
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
            continue
        sig[n] = types.get(n, "i32")
        if n in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = Source(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def try_compile(build: Callable[[], object], label: str, max_chars: int = 2000, first_line: bool = False,
                quiet: bool = False):
    """``build()``, or None after printing ``"<label> COMPILE ERROR <type>: <message>"`` (the
    message cut to ``max_chars``, or its first line cut to 120 with ``first_line``), so a
    failing configuration is reported and the script goes on. ``quiet``: swallow what the
    compile prints on stdout (Triton prints the whole PTX on a ptxas crash)."""
    try:
        if quiet:
            with contextlib.redirect_stdout(io.StringIO()):
                return build()
        return build()
    except Exception as e:  # reported, not fatal
        msg = str(e).splitlines()[0][:120] if first_line else str(e)[:max_chars]
        print(f"{label} COMPILE ERROR {type(e).__name__}: {msg}", flush=True)
        return None


def ptx_counts(ptx: str, patterns) -> str:
    """``"name count name count ..."``: matches of each ``(name, regex)`` of ``patterns`` in ``ptx``."""
    return " ".join(f"{x} {len(re.findall(p, ptx))}" for x, p in patterns)
