"""Offline sm_90a compile of the Gluon causal prefill kernel (`prefill_gluon`; no GPU needed).

``PYTHONPATH=<triton 3.6 dir>:src:scripts python scripts/prefill_gluon_offline.py [--ptxas PATH] [--dump DIR]``

Compiles `prefill_gluon_kernel._prefill_fwd_kernel` through Triton for sm_90a (bf16, group
4, the JIT's 16-divisibility of pointers and strides assumed) for each configuration below,
and the cached-prefix specialization `prefill_gluon_prefix_kernel._prefill_prefix_fwd_kernel`
(``--prefix``: also its cp.async gathers, their 16-byte width and the mbarrier arrivals),
then runs ``ptxas -v`` and prints registers, spills, shared memory, the TMA descriptors'
boxes, PTX counts (wgmma, wgmma waits, TMA loads, mbarrier waits, setmaxnreg) and any
ptxas warning (e.g. wgmma serialization). Install the device's Triton with ``pip install
--no-deps --target <dir> triton==3.6.0``.
"""

from __future__ import annotations

import re

import triton
from triton.experimental.gluon import language as gl

from attnserve.attention.triton_ops.prefill_gluon import DEFAULT_CONFIG, GluonPrefillConfig
from attnserve.attention.triton_ops.prefill_gluon_kernel import _prefill_fwd_kernel
from attnserve.attention.triton_ops.prefill_gluon_prefix_kernel import _prefill_prefix_fwd_kernel
from offline_ptxas import compile_sm90a, ptx_counts, ptxas_parser, ptxas_path, ptxas_verbose, try_compile

CONFIGS = {
    "default 128x128 s2": DEFAULT_CONFIG,
    "128x128 s3": GluonPrefillConfig(stages=3),
    "128x64 s3": GluonPrefillConfig(block_n=64, stages=3),
}


def _descriptors(cfg: GluonPrefillConfig, dtype: str):
    """Signature types of the Q / K / V TMA descriptors (Q: 64-row boxes, K / V: ``block_n``)."""
    sw = repr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    kv = f"tensordesc<{dtype}[{cfg.block_n}, 128],{sw}>"
    return dict(q_desc=f"tensordesc<{dtype}[{cfg.block_m // 2}, 128],{sw}>", k_desc=kv, v_desc=kv)


def _options(cfg: GluonPrefillConfig):
    return dict(num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)


def compile_config(cfg: GluonPrefillConfig, group: int = 4, from_indptr: bool = False, idx_ty: str = "*i32",
                   dtype: str = "bf16"):
    const = dict(GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, FROM_INDPTR=from_indptr,
                 CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs)
    types = dict(_descriptors(cfg, dtype), out_ptr=f"*{dtype}", start_ptr=idx_ty, len_ptr=idx_ty, qk_scale="fp32")
    return compile_sm90a(_prefill_fwd_kernel, const, types, _options(cfg), gluon=True)


def compile_prefix_config(cfg: GluonPrefillConfig, group: int = 4, idx_ty: str = "*i32", dtype: str = "bf16"):
    """The cached-prefix specialization (`prefill_gluon_prefix_kernel`), strides 16-divisible."""
    const = dict(GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                 CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs)
    types = dict(_descriptors(cfg, dtype), out_ptr=f"*{dtype}", k_buf_ptr=f"*{dtype}", v_buf_ptr=f"*{dtype}",
                 qo_indptr_ptr=idx_ty, kv_indptr_ptr=idx_ty, kv_indices_ptr=idx_ty, qk_scale="fp32")
    return compile_sm90a(_prefill_prefix_fwd_kernel, const, types, _options(cfg), gluon=True)


def main(argv=None) -> int:
    ap = ptxas_parser(__doc__)
    ap.add_argument("--dump", help="write each config's PTX and TTGIR here")
    ap.add_argument("--prefix", action="store_true", help="only the cached-prefix specialization")
    args = ap.parse_args(argv)
    ptxas = ptxas_path(args.ptxas)
    print(f"triton {triton.__version__}, ptxas {ptxas}", flush=True)
    if args.prefix:
        return prefix_report(ptxas, args.dump)
    for label, cfg in CONFIGS.items():
        k = try_compile(lambda: compile_config(cfg), f"{label:22s}")
        if k is None:
            continue
        ptx = k.asm["ptx"]
        if args.dump:
            slug = re.sub(r"\W+", "_", label)
            open(f"{args.dump}/{slug}.ptx", "w").write(ptx)
            open(f"{args.dump}/{slug}.ttgir", "w").write(k.asm["ttgir"])
        out = ptxas_verbose(ptx, ptxas)
        regs = re.findall(r"Used (\d+) registers", out)
        spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        warn = [ln.strip() for ln in out.splitlines() if "arning" in ln]
        counts = ptx_counts(ptx, (
            ("wgmma", r"wgmma\.mma_async"), ("wait", r"wgmma\.wait_group"), ("tma", r"cp\.async\.bulk\.tensor"),
            ("mbar.wait", r"mbarrier\.try_wait"), ("setmaxnreg", r"setmaxnreg")))
        print(f"{label:22s} regs {regs} spills {spill} shared {k.metadata.shared} "
              f"tma boxes {[m.get('block_size') for m in (k.metadata.tensordesc_meta or [])]} " + counts, flush=True)
        for w in warn:
            print(f"    ptxas: {w}", flush=True)
    # the other launches `gluon_prefill_fwd` makes: MHA / group 8, qo_indptr (int64), fp16
    for label, kw in (("group 1", dict(group=1)), ("group 8", dict(group=8)),
                      ("qo_indptr int64", dict(from_indptr=True, idx_ty="*i64")), ("fp16", dict(dtype="fp16"))):
        k = try_compile(lambda: compile_config(DEFAULT_CONFIG, **kw), f"{label:22s}")
        if k is not None:
            spill = re.findall(r"(\d+) bytes spill stores", ptxas_verbose(k.asm["ptx"], ptxas))
            print(f"{label:22s} compiled, spill stores {spill}", flush=True)
    return 0


def prefix_report(ptxas: str, dump=None) -> int:
    """Registers, spills, shared memory and the gather / barrier instruction counts of the
    cached-prefix specialization, per configuration and launch variant."""
    runs = [("prefix default", DEFAULT_CONFIG, {}), ("prefix 128x64 s3", GluonPrefillConfig(block_n=64, stages=3), {}),
            ("prefix group 1", DEFAULT_CONFIG, dict(group=1)), ("prefix group 8", DEFAULT_CONFIG, dict(group=8)),
            ("prefix int64 idx", DEFAULT_CONFIG, dict(idx_ty="*i64")), ("prefix fp16", DEFAULT_CONFIG, dict(dtype="fp16"))]
    for label, cfg, kw in runs:
        k = try_compile(lambda: compile_prefix_config(cfg, **kw), f"{label:22s}")
        if k is None:
            continue
        ptx = k.asm["ptx"]
        if dump:
            slug = re.sub(r"\W+", "_", label)
            open(f"{dump}/{slug}.ptx", "w").write(ptx)
        out = ptxas_verbose(ptx, ptxas)
        regs = re.findall(r"Used (\d+) registers", out)
        spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        counts = ptx_counts(ptx, (
            ("wgmma", r"wgmma\.mma_async"), ("tma", r"cp\.async\.bulk\.tensor"),
            ("cp.async16", r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10"),
            ("cp.async.mbar", r"cp\.async\.mbarrier\.arrive\.noinc"), ("fence.proxy", r"fence\.proxy\.async"),
            ("setmaxnreg", r"setmaxnreg")))
        nregs = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
        print(f"{label:22s} regs {regs} spills {spill} shared {k.metadata.shared} setmaxnreg {nregs} " + counts,
              flush=True)
        for w in [ln.strip() for ln in out.splitlines() if "arning" in ln]:
            print(f"    ptxas: {w}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
