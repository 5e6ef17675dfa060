"""Offline sm_90a compile of the stream-K decode stage 1 next to the split-K one (no GPU needed).

``PYTHONPATH=<triton 3.6 dir>:src python scripts/decode_streamk_offline.py [--ptxas PATH]``

Llama-3-8B heads (group 4, D 128, block_h 16): bf16 cache, and e4m3 with V pairs and fp16
dots, each at the stream-K tile (`decode_streamk.STREAMK_TILE` / `STREAMK_FP8_TILE`) and at the
split-K default tiles. Prints registers and spills (``ptxas -v``), shared memory, the
pipelined buffers of the TTGIR (``ttg.local_alloc`` shapes: the leading dim is the number of
stages in flight) and the PTX's ``cp.async`` count. The JIT's 16-divisibility
specialisation of pointers and strides is assumed. Install the device's Triton with ``pip
install --no-deps --target <dir> triton==3.6.0``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import attnserve.attention.triton_ops.decode_attention as da
import attnserve.attention.triton_ops.decode_streamk as sk

FLOATS = ("sm_scale", "logit_cap", "v_scale")


def compile_stage1(fn, const: dict, kv_ty: str, v_ty: str, num_warps: int, num_stages: int):
    """Triton's sm_90a compile of a stage-1 kernel (``fn``) with constexprs ``const``."""
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
            if n.startswith("stride") and n not in ("stride_ls",):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                               num_stages=num_stages))


def report(label: str, k, ptxas: str) -> None:
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", f.name + ".o"],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    ttgir = k.asm["ttgir"]
    allocs = sorted(set(re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([^,>]+x[a-z0-9]+)", ttgir)))
    n_async = len(re.findall(r"ttg\.async_copy_global_to_local", ttgir))
    print(f"{label:34s} regs {regs.group(1) if regs else '?'} spills {spill.groups() if spill else '?'} "
          f"shared {k.metadata.shared} cp.async {len(re.findall(r'cp.async.c[ag]', ptx))} "
          f"async_copy(ttgir) {n_async} buffers {allocs}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptxas", help="ptxas for the -v report (default: Triton's)")
    ap.add_argument("--dump", help="write each variant's TTGIR to this directory")
    args = ap.parse_args(argv)
    from triton import knobs

    ptxas = args.ptxas or knobs.nvidia.ptxas.path
    print(f"triton {triton.__version__}, ptxas {ptxas}")
    common = dict(GROUP=4, HEAD_BLOCKS=1, DK=128, DV=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_H=16, HAS_CAP=False,
                  COMPUTE_FP32=False, DOT_PREC=None, USE_PDL=False)
    kinds = {"bf16": ("*bf16", "*bf16", dict(V_SCALED=False, F16_DOT=False, V_PAIRS=False, E5M2=False)),
             "e4m3 pairs": ("*fp8e4nv", "*i16", dict(V_SCALED=True, F16_DOT=True, V_PAIRS=True, E5M2=False))}
    runs = []
    for name, (kv_ty, v_ty, extra) in kinds.items():
        n, st, w = sk.STREAMK_FP8_TILE if "e4m3" in name else sk.STREAMK_TILE
        runs.append((f"stream-K {name} {n}/{st}", sk._streamk_stage1_kernel, kv_ty, v_ty,
                     dict(common, HEAD_PROGRAMS=8, BLOCK_N=n, **extra), w, st))
        runs.append((f"stream-K {name} {n}/{st} cap", sk._streamk_stage1_kernel, kv_ty, v_ty,
                     dict(common, HEAD_PROGRAMS=8, BLOCK_N=n, **dict(extra, HAS_CAP=True)), w, st))
        tiles = [(256, 3)] if "e4m3" in name else [(128, 3)]
        tiles.append((128, 4) if "e4m3" in name else (128, 2))
        for n, st in tiles:
            runs.append((f"split-K {name} {n}/{st}", da._decode_stage1_kernel, kv_ty, v_ty,
                         dict(common, BLOCK_DPE=0, BLOCK_N=n, **extra), 4, st))
    for label, fn, kv_ty, v_ty, const, w, st in runs:
        try:
            k = compile_stage1(fn, const, kv_ty, v_ty, w, st)
        except Exception as e:  # noqa: BLE001 - a compile error is the result to report
            print(f"{label:34s} COMPILE ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        report(label, k, ptxas)
        if args.dump:
            with open(f"{args.dump}/{label.replace(' ', '_').replace('/', '-')}.ttgir", "w") as f:
                f.write(k.asm["ttgir"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
