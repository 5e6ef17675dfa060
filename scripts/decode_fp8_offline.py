"""Offline sm_90a analysis of decode stage 1: the default bf16 / fp8 tiles and the opt-in fp8 tiles.

``PYTHONPATH=<triton 3.6 dir>:src python scripts/decode_fp8_offline.py [--dump DIR] [--ptx-sha]``

No GPU needed. For Llama-3-8B heads (group 4 -> ``BLOCK_H`` 16, D 128) each stage-1 kernel of
`decode_attention` (bf16 cache; e4m3 cache with V pairs and fp16 dots) is compiled through
Triton for sm_90a (the JIT's 16-divisibility specialisation of pointers and strides is
assumed), then the cubin is read with the ``cuobjdump`` / ``nvdisasm`` that ship with Triton.
Per kernel it prints: registers and stack (spills), shared memory, the TTGIR's K/V/index
buffers (``ttg.local_alloc`` shapes: the leading dim is the number of buffers) and its
``async_wait`` counts (``num = 0`` in the loop: the next tile is waited for right after it
was issued, i.e. no load overlaps the tile's compute), resident programs per SM (registers
at 8-register granularity, 64 K per SM; shared memory with 1 KB reserved per block, 228 KB
per SM), and the SASS of the key loop counted per class (one warp, one tile), with
instructions per KB of K+V and the issue cycles of a tile against its memory cycles at
``--bytes-per-cycle`` per SM (3.0 TB/s / 132 SMs / 1.755 GHz ~ 13). ``--ptx-sha`` prints the
sha256 of the PTX without its debug lines, to show that a change leaves the default kernels' bits alone. Install the
device's Triton with ``pip install --no-deps --target <dir> triton==3.6.0``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import attnserve.attention.triton_ops.decode_attention as da
import attnserve.attention.triton_ops.decode_tuning as dt
from attnserve.attention.triton_ops.decode_tuning import BATCH_TILE, FP8_HOPPER_BATCH_TILE, FP8_HOPPER_TILE

#: the opt-in tiles (absent before they were added: then the default tiles only, for --ptx-sha)
FP8_TILE_VARIANTS = getattr(dt, "FP8_TILE_VARIANTS", {})

FLOATS = ("sm_scale", "logit_cap", "v_scale")
COMMON = dict(GROUP=4, HEAD_BLOCKS=1, DK=128, DV=128, BLOCK_D=128, BLOCK_DPE=0, BLOCK_DV=128, BLOCK_H=16,
              HAS_CAP=False, COMPUTE_FP32=False, DOT_PREC=None, USE_PDL=False, HAS_SINK=False)
KINDS = {"bf16": ("*bf16", "*bf16", dict(V_SCALED=False, F16_DOT=False, V_PAIRS=False, E5M2=False), 2),
         "e4m3": ("*fp8e4nv", "*i16", dict(V_SCALED=True, F16_DOT=True, V_PAIRS=True, E5M2=False), 1)}
SM_REGS, SM_SMEM, SMEM_RESERVED = 65536, 228 * 1024, 1024


def compile_stage1(kind: str, block_n: int, num_stages: int, num_warps: int, maxnreg: int = 0):
    """Triton's sm_90a compile of `_decode_stage1_kernel` for a ``kind`` cache at one tile."""
    kv_ty, v_ty, extra, _ = KINDS[kind]
    fn = da._decode_stage1_kernel
    const = dict(COMMON, BLOCK_N=block_n, **extra)
    names = fn.arg_names
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_ptr": kv_ty, "v_ptr": v_ty,
                      "logits_ptr": "*fp32", "lse_ptr": "*fp32"}.get(n, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in FLOATS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride") and n != "stride_ls":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _sass_instructions(sass: str):
    """[(text)] of the SASS and {label: index} of its branch targets."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        lm = re.match(r"^(\.L_x_\d+):", line)
        if lm:
            pending.append(lm.group(1))
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            for p in pending:
                labels[p] = len(ins)
            pending = []
            ins.append(m.group(1).strip())
    return ins, labels


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0]


def _class(op: str) -> str:
    b = op.split(".")[0]
    table = {"LDGSTS": "cp.async", "LDG": "global load", "STG": "global store", "LDSM": "ldmatrix", "LDS": "lds",
             "STS": "sts", "STSM": "sts", "HMMA": "mma", "MUFU": "mufu", "F2FP": "cvt", "F2F": "cvt", "I2F": "cvt",
             "PRMT": "prmt", "SHFL": "shfl", "BAR": "barrier/wait", "DEPBAR": "barrier/wait",
             "LDGDEPBAR": "barrier/wait"}
    if b in table:
        return table[b]
    if b in ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "HFMA2", "HADD2", "HMUL2"):
        return "float alu"
    if b == "IMAD" and op.startswith("IMAD.MOV"):
        return "mov"
    if b in ("MOV", "UMOV"):
        return "mov"
    return "int alu/other"


def key_loop_counts(sass: str) -> collections.Counter:
    """Per-class counts of the innermost loop with the most HMMAs (the key loop), one warp."""
    ins, labels = _sass_instructions(sass)
    loops = []
    for i, t in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", t)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    lo, hi = max(loops, key=lambda ab: sum(_opcode(ins[k]).startswith("HMMA") for k in range(ab[0], ab[1] + 1)))
    c = collections.Counter(_class(_opcode(ins[k])) for k in range(lo, hi + 1))
    c["total"] = hi - lo + 1
    return c


def _code_only(ptx: str) -> str:
    """The PTX without its debug information (``.file`` / ``.loc`` lines and the ``.debug_*``
    sections name the source file's path and lines, which differ between checkouts)."""
    ptx = ptx.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith((".file", ".loc")))


def analyse(label: str, kind: str, tile, bytes_per_cycle: float, dump: str = "", ptx_sha: bool = False) -> dict:
    block_n, stages, warps = tile[:3]
    maxnreg = tile[3] if len(tile) > 3 else 0
    k = compile_stage1(kind, block_n, stages, warps, maxnreg)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))
    ttgir = k.asm["ttgir"]
    buffers = re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([^,>]+)", ttgir)
    waits = [int(x) for x in re.findall(r"async_wait[^{\n]*\{num = (\d+)", ttgir)]
    smem = k.metadata.shared
    threads = 32 * warps
    by_regs = SM_REGS // (((regs + 7) // 8) * 8 * threads)
    by_smem = SM_SMEM // (smem + SMEM_RESERVED)
    programs = min(by_regs, by_smem, 32 // warps)
    depth = int(buffers[-1].split("x")[0]) if buffers else 0
    tile_bytes = block_n * 128 * 2 * KINDS[kind][3]
    c = key_loop_counts(sass)
    mem_cycles = tile_bytes / bytes_per_cycle
    row = dict(label=label, kind=kind, block_n=block_n, num_stages=stages, num_warps=warps, maxnreg=maxnreg,
               regs=regs, stack=stack, shared=smem, buffers=buffers, waits=waits, programs_per_sm=programs,
               kv_buffers=depth, tile_kv_bytes=tile_bytes, loop=dict(c),
               instr_per_kb=1024 * c["total"] / tile_bytes, issue_share_of_memory_time=c["total"] / mem_cycles,
               bytes_in_flight_during_compute=programs * (depth - 1) * tile_bytes)
    cls = " ".join(f"{n} {c[n]}" for n in ("cp.async", "lds", "ldmatrix", "cvt", "prmt", "mov", "mma", "mufu",
                                            "float alu", "int alu/other", "shfl", "sts", "barrier/wait"))
    print(f"{label:30s} regs {regs:3d} stack {stack:3d} smem {smem / 1024:6.1f} KB buffers {depth} waits {waits} "
          f"programs/SM {programs} (regs {by_regs}, smem {by_smem}) in flight while computing "
          f"{row['bytes_in_flight_during_compute'] // 1024} KB/SM", flush=True)
    print(f"{'':30s} loop/warp/tile {c['total']} instr = {row['instr_per_kb']:.1f} per KB of K+V, issue "
          f"{c['total']} cycles vs memory {mem_cycles:.0f} ({row['issue_share_of_memory_time']:.2f}); {cls}",
          flush=True)
    if ptx_sha:
        print(f"{'':30s} ptx sha256 {hashlib.sha256(_code_only(k.asm['ptx']).encode()).hexdigest()}", flush=True)
    if dump:
        stem = os.path.join(dump, label.replace(" ", "_").replace("/", "-"))
        for ext in ("ttgir", "ptx"):
            with open(f"{stem}.{ext}", "w") as f:
                f.write(k.asm[ext])
        with open(f"{stem}.sass", "w") as f:
            f.write(sass)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", default="", help="write each kernel's TTGIR, PTX and SASS to this directory")
    ap.add_argument("--ptx-sha", action="store_true", help="print each kernel's PTX sha256")
    ap.add_argument("--bytes-per-cycle", type=float, default=3.0e12 / 132 / 1.755e9,
                    help="memory bytes per SM per cycle at the copy rate (default 3.0 TB/s, 132 SMs, 1.755 GHz)")
    ap.add_argument("--defaults-only", action="store_true", help="the default tiles only (for --ptx-sha checks)")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90a, Hq 32 / Hkv 8 / D 128 (BLOCK_H 16), "
          f"{args.bytes_per_cycle:.1f} B/cycle/SM", flush=True)
    runs = [("bf16 default 128/3", "bf16", (128, 3, 4)),
            ("bf16 batch " + "/".join(map(str, BATCH_TILE[:2])), "bf16", BATCH_TILE),
            ("e4m3 default " + "/".join(map(str, FP8_HOPPER_TILE[:2])), "e4m3", FP8_HOPPER_TILE),
            ("e4m3 batch " + "/".join(map(str, FP8_HOPPER_BATCH_TILE[:2])), "e4m3", FP8_HOPPER_BATCH_TILE)]
    if not args.defaults_only:
        runs += [(f"e4m3 {name}", "e4m3", (n, st, w, r)) for name, (n, st, w, r) in FP8_TILE_VARIANTS.items()]
        runs += [(f"bf16 {name}", "bf16", (n, st, w, r))
                 for name, (n, st, w, r) in getattr(dt, "BF16_TILE_VARIANTS", {}).items()]
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for label, kind, tile in runs:
        try:
            analyse(label, kind, tile, args.bytes_per_cycle, args.dump, args.ptx_sha)
        except Exception as e:  # noqa: BLE001 - a compile error is the result to report
            print(f"{label:30s} COMPILE ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
