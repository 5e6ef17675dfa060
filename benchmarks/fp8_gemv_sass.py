"""sm_90 code of the one-row FP8 GEMV kernels, compiled ahead of time (no GPU needed).

``PYTHONPATH=src python benchmarks/fp8_gemv_sass.py [--shape 6144,4096] [--gated] [--dump DIR]``

For the default W8A16 kernel (`skinny_gemm_triton._skinny_gemm_kernel` on its
`FP8_SKINNY_M1` tile) and each `fp8_gemv` variant on its default tile, Triton compiles for
``GPUTarget("cuda", 90, 32)`` with the pointer / ``K`` divisibility the launcher specialises
(16), and ``cuobjdump`` (bundled with Triton) reads the cubin. Prints registers, spill
stack, ``convert_layout`` ops inside the ``K`` loop (shared-memory round trips),
``BAR.SYNC`` and SASS instructions inside the loop (the longest backward branch's body)
per weight byte a thread loads per step. Counts, not timings.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _compile(fn, sig, cx, warps, stages, div):
    names = fn.arg_names
    for k in cx:
        sig[k] = "constexpr"
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def _report(name, ck, bytes_per_thread, dump):
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    cubin = os.path.join(dump, f"{stem}.cubin")
    with open(cubin, "wb") as f:
        f.write(ck.asm["cubin"])
    with open(os.path.join(dump, f"{stem}.ttgir"), "w") as f:
        f.write(ck.asm["ttgir"])
    usage = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", cubin],
                           capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    ops = []  # (address, instruction)
    for ln in sass.splitlines():
        m = re.match(r"^\s+/\*([0-9a-f]+)\*/\s*(.*?)\s*;", ln)
        if m:
            ops.append((int(m.group(1), 16), m.group(2)))
    loops = []  # backward branches: (target, branch address); the kernel's final self-branch excluded
    for addr, op in ops:
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    lo, hi = max(loops, key=lambda t: t[1] - t[0]) if loops else (0, -1)
    loop = [op for addr, op in ops if lo <= addr <= hi]
    ttgir = ck.asm["ttgir"]
    body = ttgir[ttgir.find("scf.for"):ttgir.find("scf.yield")]
    regs = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    print(f"{name:34s} regs {regs:>3s} stack {stack}"
          f"  loop: {len(loop)} instr, {body.count('convert_layout')} convert_layout, "
          f"{sum('BAR.SYNC' in op for op in loop)} BAR.SYNC, {len(loop) / bytes_per_thread:.2f} instr / weight byte",
          flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="6144,4096", help="N,K (gated: N = gate columns)")
    ap.add_argument("--gated", action="store_true")
    ap.add_argument("--dump", default="/tmp/fp8_gemv_sass")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.makedirs(args.dump, exist_ok=True)
    from attnserve.models.layers import fp8_gemv_triton, skinny_gemm_triton
    from attnserve.models.layers.fp8_gemv import FP8_GEMV_VARIANTS, fp8_gemv_candidates
    from attnserve.models.layers.skinny_gemm import fp8_skinny_config

    n, k = (int(v) for v in args.shape.split(","))
    g = args.gated
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "s_ptr": "*fp32", "y_ptr": "*bf16"}
    ptrs = list(sig)
    c = fp8_skinny_config(1, 2 * n if g else n, k, gated=g)
    cx = dict(BLOCK_M=1, BLOCK_N=c.block_n, BLOCK_K=c.block_k, USE_DOT=False, DOT_PRECISION="tf32", DOT_UPCAST=False,
              HAS_BIAS=False, GATED=g, ACT=0, CARRY=c.carry, DEFER=c.defer, USE_PDL=True, HAS_SCALE=True)
    s = dict(sig, M="i32", N="i32", K="i32", stride_xm="i32", stride_ym="i32")
    ck = _compile(skinny_gemm_triton._skinny_gemm_kernel, s, cx, c.num_warps, c.num_stages,
                  ptrs + ["N", "K", "stride_xm", "stride_ym"])
    threads = 32 * c.num_warps
    rows = c.block_n * (2 if g else 1)
    _report(f"default[{c.block_n}x{c.block_k}/{c.num_warps}w]", ck, rows * c.block_k / threads, args.dump)
    for variant, mode in FP8_GEMV_VARIANTS.items():
        c = fp8_gemv_candidates(variant, n, k, gated=g)[0]
        cx = dict(BLOCK_N=c.block_n, BLOCK_K=c.block_k, MODE=mode, INTERP=False, HAS_BIAS=False, GATED=g, ACT=0,
                  USE_PDL=variant != "dot16", CARRY=c.carry)
        ck = _compile(fp8_gemv_triton._fp8_gemv_kernel, dict(sig, N="i32", K="i32"), cx, c.num_warps, c.num_stages,
                      ptrs + ["N", "K"])
        rows = c.block_n * (2 if g else 1)
        _report(c.label(), ck, rows * c.block_k / (32 * c.num_warps), args.dump)


if __name__ == "__main__":
    main()
