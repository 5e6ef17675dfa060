"""Offline compile of the extend kernel for sm_90a (no GPU): registers, spills, shared memory and
PTX instruction counts of the bf16- and fp8-pool variants, with and without the prefix stage.

``PYTHONPATH=<triton 3.6 dir>:src python scripts/extend_compile_offline.py`` (install the device's triton,
3.6, with ``pip install --no-deps --target <dir> triton==3.6.0``; needs ``ptxas`` on PATH). Session 15,
benchmarks/NOTES.md ("plain prefills over an fp8 pool").
"""
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import attnserve.attention.triton_ops.extend_attention as m

fn = m._extend_fwd_kernel
names = fn.arg_names
def build(buf_ty, has_prefix, prefix_f16, bnp=128):
    const = dict(GROUP=4, DK=128, DV=128, BLOCK_M=128, BLOCK_N=64, BLOCK_NP=bnp, BLOCK_D=128, BLOCK_DPE=0, BLOCK_DV=128,
                 IS_CAUSAL=True, HAS_MASK=False, PREFIX_MASK=False, HAS_WINDOW=False, HAS_CAP=False,
                 HAS_PREFIX_START=False, K_SCALED=False, V_SCALED=False, PREFIX_F16=prefix_f16, HAS_PREFIX=has_prefix,
                 EVEN_DK=True, EVEN_DPE=True, EVEN_DV=True, COMPUTE_FP32=False, DOT_PREC=None)
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            if n in ("k_buf_ptr", "v_buf_ptr"):
                sig[n] = buf_ty
            elif n in ("q_ptr", "k_ext_ptr", "v_ext_ptr", "o_ptr"):
                sig[n] = "*bf16"
            elif n == "mask_ptr":
                sig[n] = "*u8"
            elif n == "mask_indptr_ptr":
                sig[n] = "*i64"
            else:
                sig[n] = "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ("sm_scale", "logit_cap", "k_scale", "v_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
    return k
for label, ty, hp, pf in [("bf16 pool, prefix", "*bf16", True, False), ("fp8 pool, prefix, f16", "*fp8e4nv", True, True),
                          ("fp8 pool, prefix, no f16", "*fp8e4nv", True, False), ("bf16 pool, no prefix", "*bf16", False, False),
                          ("fp8 pool, no prefix", "*fp8e4nv", False, True)]:
    k = build(ty, hp, pf)
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run(["ptxas", "-v", "--gpu-name", "sm_90a", f.name, "-o", "/tmp/exp/x.cubin"], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out); spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    print(f"{label:28s} regs {regs.group(1) if regs else '?'} spills {spill.groups() if spill else '?'} shared {k.metadata.shared}", flush=True)

print("---- instruction counts in PTX")
for label, ty, hp, pf in [("bf16 pool, prefix", "*bf16", True, False), ("fp8 pool, prefix, f16", "*fp8e4nv", True, True),
                          ("bf16 pool, no prefix", "*bf16", False, False)]:
    ptx = build(ty, hp, pf).asm["ptx"]
    c = lambda pat: len(re.findall(pat, ptx))
    print(f"{label:28s} wgmma {c(r'wgmma.mma_async')} mma.sync {c(r'mma.sync')} cp.async {c(r'cp.async.cg|cp.async.ca')} "
          f"cp.async.bulk {c(r'cp.async.bulk')} ld.global {c(r'ld.global')} bar.sync {c(r'bar.sync')} cvt {c(r'cvt.')} lines {ptx.count(chr(10))}")
