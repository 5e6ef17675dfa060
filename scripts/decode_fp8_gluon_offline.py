"""Offline sm_90a compile of the Gluon fp8 decode stage 1 (`decode_fp8_gluon_kernel`; no GPU needed).

``PYTHONPATH=<triton 3.6 dir>:src:scripts python scripts/decode_fp8_gluon_offline.py [--dump DIR]``

Compiles `_fp8_decode_stage1_kernel` through Triton for sm_90a (bf16 queries, e4m3 cache,
int32 indices, the JIT's 16-divisibility of pointers and strides assumed) for each
(GROUP, BLOCK_N, NUM_BUF, PAIRS) below and prints ``ptxas -v``'s registers and spills, the
kernel's shared memory, resident programs per SM (by registers and by the 227 KB of shared
memory) and PTX counts (cp.async, wait_group, mma.sync, cvt e4m3x2, bar.sync). Install the
device's Triton with ``pip install --no-deps --target <dir> triton==3.6.0``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import triton

from attnserve.attention.triton_ops.decode_fp8_gluon_kernel import _fp8_decode_stage1_kernel
from offline_ptxas import compile_sm90a, ptx_counts, ptxas_parser, ptxas_path, ptxas_report, try_compile

CASES = [  # (group, block_n, num_buf, pairs)
    (4, 64, 4, True), (4, 64, 4, False), (4, 64, 3, True), (4, 128, 3, True), (4, 128, 2, True),
    (1, 64, 4, True), (8, 64, 4, True), (16, 64, 4, True), (8, 64, 4, False),
]


def compile_case(group: int, block_n: int, num_buf: int, pairs: bool, num_warps: int = 4):
    hp = max(8, triton.next_power_of_2(group))
    const = dict(GROUP=group, HP=hp, BLOCK_N=block_n, NUM_BUF=num_buf, SPLIT_ALIGN=128, V_SCALED=True, PAIRS=pairs,
                 SAME_STRIDE=True)
    types = dict(q_ptr="*bf16", k_ptr="*fp8e4nv", v_ptr="*fp8e4nv", kv_indptr_ptr="*i32", kv_indices_ptr="*i32",
                 num_kv_splits_ptr="*i32", logits_ptr="*fp32", lse_ptr="*fp32", o_ptr="*bf16", qk_scale="fp32",
                 v_scale="fp32")
    return compile_sm90a(_fp8_decode_stage1_kernel, const, types, dict(num_warps=num_warps, num_stages=1), gluon=True)


def loop_mix(ptx: str, ptxas: str) -> str:
    """SASS of the tile loop (from the ``cp.async.wait_group`` 's ``DEPBAR.LE`` to the
    backward branch that returns to it): instructions a warp issues per tile and the most
    frequent opcodes (``cuobjdump -sass`` next to Triton's ptxas)."""
    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(src, "w").write(ptx)
        subprocess.run([ptxas, "--gpu-name", "sm_90a", src, "-o", obj], check=True, capture_output=True)
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", obj],
                              capture_output=True, text=True).stdout
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    dep = next((i for i, ln in enumerate(lines) if "DEPBAR.LE" in ln), None)
    if dep is None:
        return "loop not found"
    start = next((i for i in range(dep, -1, -1) if addr[i] <= addr[dep] - 0x80), 0)
    for i in range(dep, len(lines)):
        m = re.search(r"BRA (0x[0-9a-f]+)", lines[i])
        if m and addr[start] <= int(m.group(1), 16) <= addr[dep]:
            body = lines[int(addr.index(int(m.group(1), 16))):i + 1]
            ops = Counter(re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0].split(".")[0]
                          for ln in body)
            return f"loop {len(body)} instr/warp/tile " + " ".join(f"{k} {v}" for k, v in ops.most_common(10))
    return "loop end not found"


def main(argv=None) -> int:
    ap = ptxas_parser(__doc__)
    ap.add_argument("--dump", help="write each case's PTX and TTGIR here")
    args = ap.parse_args(argv)
    ptxas = ptxas_path(args.ptxas)
    print(f"triton {triton.__version__}, ptxas {ptxas}", flush=True)
    for group, block_n, num_buf, pairs in CASES:
        label = f"group {group:2d} keys {block_n:3d} buffers {num_buf} pairs {int(pairs)}"
        k = try_compile(lambda: compile_case(group, block_n, num_buf, pairs), f"{label}:", max_chars=3000)
        if k is None:
            continue
        ptx = k.asm["ptx"]
        if args.dump:
            slug = f"g{group}_n{block_n}_b{num_buf}_p{int(pairs)}"
            open(f"{args.dump}/{slug}.ptx", "w").write(ptx)
            open(f"{args.dump}/{slug}.ttgir", "w").write(k.asm["ttgir"])
        regs, spill = ptxas_report(ptx, ptxas)
        smem = k.metadata.shared
        by_regs = 65536 // (128 * max(1, int(regs or 255)))
        by_smem = (227 * 1024) // max(1, smem + 1024)  # + 1 KB the driver reserves per block
        counts = ptx_counts(ptx, (
            ("cp.async", r"cp\.async\.c[ag]\.shared"), ("wait_group", r"cp\.async\.wait_group"),
            ("mma", r"mma\.sync"), ("cvt.e4m3x2", r"cvt\.rn\.f16x2\.e4m3x2"), ("bar.sync", r"bar\.sync"),
            ("ld.shared", r"ld\.shared"), ("ldmatrix", r"ldmatrix"), ("st.shared", r"st\.shared")))
        print(f"{label}: regs {regs} spills {spill} shared {smem} B programs/SM {min(by_regs, by_smem, 16)} "
              f"(regs {by_regs}, smem {by_smem}) PTX " + counts, flush=True)
        print(f"    {loop_mix(ptx, ptxas)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
