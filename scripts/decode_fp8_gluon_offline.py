"""Offline sm_90a compile of the Gluon fp8 decode stage 1 (`decode_fp8_gluon_kernel`; no GPU needed).

``PYTHONPATH=<triton 3.6 dir>:src:scripts python scripts/decode_fp8_gluon_offline.py [--dump DIR]``

Compiles `_fp8_decode_stage1_kernel` through Triton for sm_90a (bf16 queries, e4m3 cache,
int32 indices, the JIT's 16-divisibility of pointers and strides assumed) for each
(GROUP, BLOCK_N, NUM_BUF) below and prints ``ptxas -v``'s registers and spills, the
kernel's shared memory, resident programs per SM (by registers and by the 227 KB of shared
memory) and PTX counts (cp.async, wait_group, mma.sync, cvt e4m3x2, bar.sync). Install the
device's Triton with ``pip install --no-deps --target <dir> triton==3.6.0``.
"""

from __future__ import annotations

import argparse
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from attnserve.attention.triton_ops.decode_fp8_gluon_kernel import _fp8_decode_stage1_kernel
from offline_ptxas import ptxas_report

CASES = [  # (group, block_n, num_buf)
    (4, 64, 4), (4, 64, 3), (4, 128, 3), (4, 128, 2), (1, 64, 4), (8, 64, 4), (16, 64, 4),
]


def compile_case(group: int, block_n: int, num_buf: int, num_warps: int = 4):
    fn = _fp8_decode_stage1_kernel
    names = fn.arg_names
    hp = max(8, triton.next_power_of_2(group))
    const = dict(GROUP=group, HP=hp, BLOCK_N=block_n, NUM_BUF=num_buf, SPLIT_ALIGN=128, V_SCALED=True)
    ptr_ty = dict(q_ptr="*bf16", k_ptr="*fp8e4nv", v_ptr="*fp8e4nv", kv_indptr_ptr="*i32", kv_indices_ptr="*i32",
                  num_kv_splits_ptr="*i32", logits_ptr="*fp32", lse_ptr="*fp32", o_ptr="*bf16")
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
        elif n in ptr_ty:
            sig[n] = ptr_ty[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ("qk_scale", "v_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptxas", help="ptxas for the -v report (default: Triton's)")
    ap.add_argument("--dump", help="write each case's PTX and TTGIR here")
    args = ap.parse_args(argv)
    from triton import knobs

    ptxas = args.ptxas or knobs.nvidia.ptxas.path
    print(f"triton {triton.__version__}, ptxas {ptxas}", flush=True)
    for group, block_n, num_buf in CASES:
        label = f"group {group:2d} keys {block_n:3d} buffers {num_buf}"
        try:
            k = compile_case(group, block_n, num_buf)
        except Exception as e:  # report, go on with the next case
            print(f"{label}: COMPILE ERROR {type(e).__name__}: {str(e)[:3000]}", flush=True)
            continue
        ptx = k.asm["ptx"]
        if args.dump:
            slug = f"g{group}_n{block_n}_b{num_buf}"
            open(f"{args.dump}/{slug}.ptx", "w").write(ptx)
            open(f"{args.dump}/{slug}.ttgir", "w").write(k.asm["ttgir"])
        regs, spill = ptxas_report(ptx, ptxas)
        smem = k.metadata.shared
        by_regs = 65536 // (128 * max(1, int(regs or 255)))
        by_smem = (227 * 1024) // max(1, smem + 1024)  # + 1 KB the driver reserves per block
        counts = {x: len(re.findall(p, ptx)) for x, p in (
            ("cp.async", r"cp\.async\.c[ag]\.shared"), ("wait_group", r"cp\.async\.wait_group"),
            ("mma", r"mma\.sync"), ("cvt.e4m3x2", r"cvt\.rn\.f16x2\.e4m3x2"), ("bar.sync", r"bar\.sync"),
            ("ld.shared", r"ld\.shared"), ("st.shared", r"st\.shared"))}
        print(f"{label}: regs {regs} spills {spill} shared {smem} B programs/SM {min(by_regs, by_smem, 16)} "
              f"(regs {by_regs}, smem {by_smem}) " + " ".join(f"{x} {n}" for x, n in counts.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
