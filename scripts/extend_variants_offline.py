"""Offline sm_90a compile of the extend kernel's plain-prefill candidates (no GPU needed).

``PYTHONPATH=<triton 3.6 dir>:src python scripts/extend_variants_offline.py [--ptxas PATH]``

For the old default config, sm_90's plain-prefill defaults (`extend_tuning`: 2,048 tokens and
2,049) and each candidate of ``benchmarks/extend_long_sweep.py`` (bf16, D 128, group 4, causal,
``has_prefix=False``, plus the default with the prefix stage): compiles
through Triton for sm_90a (the JIT's 16-divisibility specialisation of pointers and strides
is assumed), then runs ``ptxas -v`` (``--ptxas``, default: the ptxas Triton itself uses)
and prints registers, spills, shared memory and PTX counts (wgmma, wgmma waits, TMA loads,
cp.async). A candidate whose compile fails (Triton 3.6's ptxas 12.8 crashed with SIGSEGV on
K+V descriptors at 3 stages) is listed with the error. Install the device's Triton with
``pip install --no-deps --target <dir> triton==3.6.0``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import triton

from offline_ptxas import compile_sm90a, ptx_counts, ptxas_parser, ptxas_path, ptxas_report, try_compile

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/benchmarks")
from extend_long_sweep import CANDIDATES, PHI3_CANDIDATES  # noqa: E402

import attnserve.attention.triton_ops.extend_attention as m  # noqa: E402


def compile_variant(cfg, has_prefix: bool, buf_ty: str = "*bf16", prefix_f16: bool = False, d: int = 128,
                    group: int = 4, *, dv: Optional[int] = None, mask: bool = False, window: bool = False,
                    cap: bool = False, kv_scaled: bool = False):
    """Triton's compile of `_extend_fwd_kernel` for sm_90a as `extend_attention_fwd` launches ``cfg``.

    ``buf_ty``: the paged K/V pool's element type, ``"*bf16"`` or ``"*fp8e4nv"``; ``prefix_f16``:
    fp16 prefix dots; ``d`` / ``dv``: the head sizes of K and V (``dv`` defaults to ``d``);
    ``group``: query heads per KV head; ``mask``: a custom mask (tree verification, not causal);
    ``window`` / ``cap``: a sliding window / logit cap; ``kv_scaled``: the pool's K / V scales are
    not 1. TMA descriptors of the new tokens (``cfg.kv_desc``) apply to plain runs only, as in the
    launcher; both descriptor arguments are then descriptors, else pointers (its dummy tensors)."""
    dv = d if dv is None else dv
    fn = m._extend_fwd_kernel
    names = fn.arg_names
    block_d, block_dpe = m._k_dims(d, cfg.whole_dk)
    block_dv = max(16, triton.next_power_of_2(dv))
    plain_run = not mask and not cap and block_dpe == 0 and block_dv == dv and not has_prefix
    k_desc, v_desc = (plain_run and "k" in cfg.kv_desc), (plain_run and "v" in cfg.kv_desc)
    const = dict(GROUP=group, DK=d, DV=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 BLOCK_NP=cfg.block_n_prefix or cfg.block_n, BLOCK_D=block_d, BLOCK_DPE=block_dpe, BLOCK_DV=block_dv,
                 IS_CAUSAL=not mask, HAS_MASK=mask, PREFIX_MASK=mask, HAS_WINDOW=window, HAS_CAP=cap,
                 HAS_PREFIX_START=False, K_SCALED=kv_scaled, V_SCALED=kv_scaled, PREFIX_F16=prefix_f16,
                 HAS_PREFIX=has_prefix, EVEN_DK=block_d <= d, EVEN_DPE=block_d + block_dpe == d,
                 EVEN_DV=block_dv == dv, COMPUTE_FP32=False, DOT_PREC=None, K_DESC=k_desc, V_DESC=v_desc,
                 HAS_SINK=False)
    typed = ("q_ptr", "k_ext_ptr", "v_ext_ptr", "o_ptr")
    types = {"sm_scale": "fp32", "logit_cap": "fp32", "k_scale": "fp32", "v_scale": "fp32"}
    ptrs = [n for n in names if (n.endswith("_ptr") or n.endswith("_desc")) and n not in const
            and not (n in ("k_ext_desc", "v_ext_desc") and (k_desc or v_desc))]
    for n in ptrs:
        types[n] = (buf_ty if n in ("k_buf_ptr", "v_buf_ptr") else "*bf16" if n in typed else "*u8" if n == "mask_ptr"
                    else "*i64" if n == "mask_indptr_ptr" else "*i32")
    if k_desc or v_desc:
        desc = f"tensordesc<bf16[{cfg.block_n}, {d}]>"
        types.update(k_ext_desc=desc, v_ext_desc=desc)
    divisible = set(ptrs) | {n for n in names if n.startswith("stride")}
    return compile_sm90a(fn, const, types, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), divisible)


def main(argv=None) -> int:
    ap = ptxas_parser(__doc__)
    ap.add_argument("--fp8-pool", action="store_true", help="also the prefix stage over an fp8 (e4m3) pool")
    ap.add_argument("--phi3", action="store_true",
                    help="instead: Phi-3-mini's heads (D 96, group 1), extend_long_sweep's PHI3_CANDIDATES, "
                         "plain and over a prefix")
    args = ap.parse_args(argv)
    from triton import knobs

    ptxas = ptxas_path(args.ptxas)
    print(f"triton {triton.__version__}, Triton's ptxas {knobs.nvidia.ptxas.path} ({knobs.nvidia.ptxas.version}); "
          f"report ptxas {ptxas}")
    default = m.extend_config(128, 128, m.torch.bfloat16, has_prefix=False)
    prefixed = dataclasses.replace(default, block_n_prefix=128)
    runs = [("default, prefix stage", prefixed, True, "*bf16", False), ("default", default, False, "*bf16", False)]
    if args.fp8_pool:  # the fp8 pool's prefix stage, with and without fp16 dots (NOTES, session 15)
        runs += [("fp8 pool, prefix, f16", prefixed, True, "*fp8e4nv", True),
                 ("fp8 pool, prefix, no f16", prefixed, True, "*fp8e4nv", False)]
    short = m.extend_config(128, 128, m.torch.bfloat16, has_prefix=False, capability=(9, 0), max_len_extend=2048)
    long = m.extend_config(128, 128, m.torch.bfloat16, has_prefix=False, capability=(9, 0), max_len_extend=2049)
    runs += [("sm90 default <= 2048", short, False, "*bf16", False),
             ("sm90 default > 2048", long, False, "*bf16", False)]
    runs += [(name, dataclasses.replace(default, **kw), False, "*bf16", False) for name, kw in CANDIDATES.items() if kw]
    d, group = 128, 4
    if args.phi3:
        d, group = 96, 1
        base = m.extend_config(96, 96, m.torch.bfloat16, has_prefix=True)
        runs = [(f"{name}{', prefix' if pre else ''}", dataclasses.replace(base, **kw), pre, "*bf16", False)
                for name, kw in PHI3_CANDIDATES.items() for pre in (False, True)]
    for label, cfg, has_prefix, buf_ty, prefix_f16 in runs:
        k = try_compile(lambda: compile_variant(cfg, has_prefix, buf_ty, prefix_f16, d, group), f"{label:28s}",
                        first_line=True, quiet=True)  # ptxas crashes are reported, not fatal
        if k is None:
            continue
        ptx = k.asm["ptx"]
        regs, spill = ptxas_report(ptx, ptxas)
        counts = ptx_counts(ptx, (("wgmma", r"wgmma\.mma_async"), ("wait", r"wgmma\.wait_group"),
                                  ("tma", r"cp\.async\.bulk\.tensor"), ("cp.async", r"cp\.async\.c[ag]")))
        print(f"{label:28s} regs {regs or '?'} spills {spill or '?'} shared {k.metadata.shared} " + counts, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
