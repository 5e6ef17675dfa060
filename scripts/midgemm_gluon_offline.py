"""Offline sm_90a compile of the Gluon mid GEMM (`mid_gemm_gluon`) for the benchmark's shapes and configs.

``PYTHONPATH=<triton 3.6 dir>:src python scripts/midgemm_gluon_offline.py [--ptxas PATH] [--quick]``

Builds `_gluon_mid_gemm_kernel` through Triton (GluonASTSource, GPUTarget cuda 90, no GPU) for
every (row-piece pair of the benchmark's M values) x config of ``benchmarks/midgemm_gluon.py``
(plain, then the gated ``g-`` ones; the kernel does not specialise on N, K or M values, only
on the pieces and flags), runs ``ptxas -v`` and prints registers, spills, shared memory and PTX
counts (wgmma, TMA copies, atomics, setmaxnreg), and ``loop_spill``: local-memory
instructions (``LDL`` / ``STL``) of the SASS (``cuobjdump -sass``) inside the innermost loop
(a backward branch) around an ``HGMMA`` - a K loop; it must be 0. A failing compile is listed with
its error.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton

from offline_ptxas import compile_sm90a, ptx_counts, ptxas_parser, ptxas_path, ptxas_report, try_compile

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/benchmarks")
from midgemm_gluon import CANDIDATES, GATED_CANDIDATES, M_VALUES  # noqa: E402

from attnserve.models.layers import mid_gemm_gluon as mg  # noqa: E402
from attnserve.models.layers import mid_gemm_gluon_kernel as kern  # noqa: E402


def compile_config(cfg, m: int, has_bias: bool = True, pdl: bool = False, gated: bool = False):
    from triton.experimental.gluon import language as gl

    m1, m2 = mg.m_pieces(m)
    lay = repr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    const = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M1=m1, BLOCK_M2=max(m2, 16), HAS_M2=m2 > 0,
                 NUM_STAGES=cfg.num_stages, NUM_CONSUMERS=cfg.num_consumers, HAS_BIAS=has_bias, USE_PDL=pdl,
                 CONSUMER_REGS=mg.REGISTER_PLAN[cfg.num_consumers][1],
                 LOADER_REGS=mg.REGISTER_PLAN[cfg.num_consumers][2], GATED=gated, ACT=0)
    fn = kern._gluon_mid_gemm_kernel
    types = dict(w_desc=f"tensordesc<bf16[{cfg.wg_rows}, 64],{lay}>", x1_desc=f"tensordesc<bf16[{m1}, 64],{lay}>",
                 x2_desc=f"tensordesc<bf16[{m2 or m1}, 64],{lay}>")
    ptrs = [n for n in fn.arg_names if n.endswith("_ptr") and n not in const]
    types.update({n: {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}.get(n, "*bf16") for n in ptrs})
    opts = dict(num_warps=4, num_stages=1)
    if mg.REGISTER_PLAN[cfg.num_consumers][0]:
        opts["maxnreg"] = mg.REGISTER_PLAN[cfg.num_consumers][0]
    return compile_sm90a(fn, const, types, opts, divisible=set(ptrs) | {"N", "K", "stride_ym"}, gluon=True)


def k_loop_spills(cubin: bytes, cuobjdump: str) -> int:
    """``LDL``/``STL`` count inside the innermost loops (backward ``BRA`` ranges) around the
    ``HGMMA`` instructions, from the SASS of ``cubin``."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ins = []  # (address, text)
    for line in sass.splitlines():
        mt = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if mt:
            ins.append((int(mt.group(1), 16), mt.group(2)))
    back = []  # backward branches: (target, branch address)
    for addr, text in ins:
        mb = re.search(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)", text)
        if mb and int(mb.group(1), 16) < addr:
            back.append((int(mb.group(1), 16), addr))
    loops = set()  # the innermost loop around each HGMMA: the K loops
    for a, t in ins:
        if "HGMMA" in t:
            around = [(lo, hi) for lo, hi in back if lo <= a <= hi]
            if around:
                loops.add(min(around, key=lambda r: r[1] - r[0]))
    return sum(1 for a, t in ins if re.search(r"\b(LDL|STL)\b", t) and any(lo <= a <= hi for lo, hi in loops))


def main(argv=None) -> int:
    ap = ptxas_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="only M 144 and the first two candidates")
    args = ap.parse_args(argv)
    ptxas = ptxas_path(args.ptxas)
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    print(f"triton {triton.__version__}, ptxas {ptxas}", flush=True)
    ms = (144,) if args.quick else tuple(M_VALUES) + (17, 33, 200)  # the benchmark's and the tests' M values
    pieces = sorted({mg.m_pieces(m) for m in ms})
    runs = [(name, cfg, False) for name, cfg in (CANDIDATES[:2] if args.quick else CANDIDATES)]
    runs += [(name, cfg, True) for name, cfg in (GATED_CANDIDATES[:1] if args.quick else GATED_CANDIDATES)]
    bad = 0
    for name, cfg, gated in runs:
        for m1, m2 in pieces:
            m = m1 + m2
            fit = mg.fit_stages(cfg, m, gated)  # as the benchmark runs it: fewer stages where the ring does not fit
            if fit is None:
                print(f"{name:22s} M {m1}+{m2}: skipped (accumulators do not fit)", flush=True)
                continue
            for pdl in (False, True):
                label = f"{name:22s} M {m1}+{m2} s{fit.num_stages} pdl {int(pdl)}"
                k = try_compile(lambda: compile_config(fit, m, pdl=pdl, gated=gated), label, quiet=True)
                if k is None:
                    bad += 1
                    continue
                ptx = k.asm["ptx"]
                regs, spill = ptxas_report(ptx, ptxas)
                counts = ptx_counts(ptx, (
                    ("wgmma", r"wgmma\.mma_async"), ("tma", r"cp\.async\.bulk\.tensor"),
                    ("atom", r"\b(?:atom|red)\.global"), ("setmaxnreg", r"setmaxnreg"),
                    ("gdc", r"griddepcontrol")))
                loop_spill = k_loop_spills(k.asm["cubin"], cuobjdump)
                bad += loop_spill > 0
                print(f"{label} regs {regs or '?'} spills {spill or '?'} loop_spill {loop_spill} shared "
                      f"{k.metadata.shared} " + counts, flush=True)
    print(f"{bad} compile errors or K loops with spills", flush=True)
    return int(bad > 0)


if __name__ == "__main__":
    raise SystemExit(main())
