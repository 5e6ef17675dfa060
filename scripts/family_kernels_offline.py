"""Offline sm_90a compile of the attention kernel variants each supported family launches (no GPU needed).

``PYTHONPATH=<triton 3.6 dir>:src:benchmarks python scripts/family_kernels_offline.py [--ptxas PATH] [--only NAME,...]``

Why: Triton 3.6's ptxas (12.8) crashed (SIGSEGV) on the extend kernel's cached-prefix stage at
Phi-3-mini's head size 96 (benchmarks/NOTES.md, 2026-11-28 eighteenth). Nothing had compiled that
variant before a user's first prefix-cache hit would: the GPU family tests run in float32 (other
tiles), and the benchmarks' random prompts never hit a prefix. This script asks, for every family
shape of `FAMILIES` (head sizes, GQA group, logit cap, sliding window as the models use them), the
engine's own tuning functions (`extend_config`, `decode_config`) which tiles a launch takes, builds
the kernels' constexprs as `extend_attention_fwd` / `decode_attention_fwd` do, and compiles each
through Triton for sm_90a, then ``ptxas -v``:

* extend: a plain prefill (short and long on sm_90, where the tiles differ), one over a cached
  prefix (bf16 pool, and an e4m3 pool with its scales and fp16 prefix dots), and one with a
  custom mask (speculative tree verification) over a prefix;
* decode stage 1: the small-batch tile and the batch tile, bf16 and e4m3 caches.

Prints one line per variant (registers, spill bytes, shared memory) and ``COMPILE ERROR`` where
Triton or ptxas failed; exits 1 if any variant failed. The JIT's 16-divisibility of pointers and
strides is assumed (`offline_ptxas.compile_sm90a`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import triton

from extend_variants_offline import compile_variant
from offline_ptxas import compile_sm90a, ptxas_parser, ptxas_path, ptxas_report, try_compile

import attnserve.attention.triton_ops.decode_attention as da  # noqa: E402
import attnserve.attention.triton_ops.extend_attention as ea  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
SMEM, SMS = 227 * 1024, 132


@dataclass(frozen=True)
class Family:
    """The attention shape of one family as its layers launch the kernels."""

    hq: int
    hkv: int
    dk: int
    dv: int
    logit_cap: float = 0.0
    window: bool = False


#: name -> shape (`attnserve.model_loader.dummy.DUMMY_MODEL_CONFIGS` and the HF configs)
FAMILIES = {
    "llama-3-8b": Family(32, 8, 128, 128),
    "llama-3-70b": Family(64, 8, 128, 128),
    "qwen3-0.6b": Family(16, 8, 128, 128),
    "qwen2.5-7b": Family(28, 4, 128, 128),
    "smollm2-135m": Family(9, 3, 64, 64),
    "phi-3-mini": Family(32, 32, 96, 96, window=True),  # sliding_window 2047 (4k), 262144 (128k, 3.5)
    "phi-3-mini-no-window": Family(32, 32, 96, 96),  # a config without sliding_window
    "gemma3-270m": Family(4, 1, 256, 256, window=True),
    "gemma-2-9b": Family(16, 8, 256, 256, logit_cap=50.0, window=True),
    "deepseek-v2-lite-expanded": Family(16, 16, 192, 128),  # MLA prefill in the expanded form
}
#: decode stage 1's pointer arguments other than the cache (the rest are int32 metadata)
_PTR_TYPES = {"q_ptr": "*bf16", "o_ptr": "*bf16", "logits_ptr": "*fp32", "lse_ptr": "*fp32"}


def compile_extend(f: Family, kind: str, pool: str):
    """`_extend_fwd_kernel` as `extend_attention_fwd` launches it for ``kind`` ("plain-short",
    "plain-long", "prefix", "mask") over a ``pool`` ("bf16" / "e4m3") cache, with the tiles
    `extend_config` picks (`extend_variants_offline.compile_variant` builds the launch)."""
    has_prefix, mask = kind in ("prefix", "mask"), kind == "mask"
    max_len = 4096 if kind == "plain-long" else 512
    cfg = ea.extend_config(f.dk, f.dv, torch.bfloat16, has_custom_mask=mask, has_prefix=has_prefix,
                           is_causal=not mask, max_len_extend=max_len, capability=(9, 0))
    fp8 = pool == "e4m3"
    label = f"{cfg.block_m}x{cfg.block_n}x{cfg.num_warps}x{cfg.num_stages}" + (" whole" if cfg.whole_dk else "")
    return label, compile_variant(cfg, has_prefix, "*fp8e4nv" if fp8 else "*bf16", fp8, f.dk, f.hq // f.hkv,
                                  dv=f.dv, mask=mask, window=f.window, cap=f.logit_cap > 0, kv_scaled=fp8)


def compile_decode(f: Family, batch: str, pool: str):
    """`_decode_stage1_kernel` as `decode_attention_fwd` launches it at the small-batch tile
    (``batch`` "small", 8 requests) or the batch tile ("large", 512 requests) of a ``pool`` cache."""
    fp8 = pool == "e4m3"
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    group = f.hq // f.hkv
    cfg = da.decode_config(f.dk, group, dtype, max_shared_mem=SMEM, device_name=H100,
                           batch_size=8 if batch == "small" else 512, num_kv_heads=f.hkv, num_sms=SMS)
    block_h = max(16, cfg.block_h) if cfg.block_h > 1 else 1
    block_d, block_dpe = da._k_dims(f.dk, cfg.whole_dk)
    block_dv = max(16, triton.next_power_of_2(f.dv))
    v_pairs = cfg.v_pairs and block_h > 1 and block_dv == f.dv and block_dv >= 32
    const = dict(GROUP=group, HEAD_BLOCKS=da._head_blocks(block_h, group), DK=f.dk, DV=f.dv, BLOCK_D=block_d,
                 BLOCK_DPE=block_dpe, BLOCK_DV=block_dv, BLOCK_H=block_h, BLOCK_N=cfg.block_n, HAS_CAP=f.logit_cap > 0,
                 V_SCALED=fp8, COMPUTE_FP32=False, DOT_PREC=None, F16_DOT=fp8, V_PAIRS=v_pairs, E5M2=False,
                 USE_PDL=cfg.pdl, HAS_SINK=False)
    fn = da._decode_stage1_kernel
    types = {n: _PTR_TYPES.get(n, "*i32") for n in fn.arg_names if n.endswith("_ptr")}
    types["k_ptr"] = "*fp8e4nv" if fp8 else "*bf16"
    types["v_ptr"] = "*i16" if v_pairs else types["k_ptr"]
    types.update(sm_scale="fp32", logit_cap="fp32", v_scale="fp32")
    divisible = {n for n in types if types[n].startswith("*")} | {
        n for n in fn.arg_names if n.startswith("stride") and n != "stride_ls"}
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    label = f"{cfg.block_n}/{cfg.num_stages}/{cfg.num_warps}" + (" whole" if cfg.whole_dk else "") + (
        " pairs" if v_pairs else "")
    return label, compile_sm90a(fn, const, types, opts, divisible)


def main(argv=None) -> int:
    ap = ptxas_parser(__doc__)
    ap.add_argument("--only", default="", help="comma-separated family names (default: all)")
    args = ap.parse_args(argv)
    ptxas = ptxas_path(args.ptxas)
    names = [x for x in args.only.split(",") if x] or list(FAMILIES)
    failed = 0
    for name in names:
        f = FAMILIES[name]
        jobs = [(f"extend {kind:11s} {pool}", compile_extend, (f, kind, pool))
                for kind in ("plain-short", "plain-long", "prefix", "mask") for pool in ("bf16", "e4m3")
                if not (pool == "e4m3" and kind.startswith("plain"))]
        if f.dk == f.dv:  # the expanded MLA form is a prefill-only launch
            jobs += [(f"decode {batch:5s} {pool}", compile_decode, (f, batch, pool))
                     for batch in ("small", "large") for pool in ("bf16", "e4m3")]
        for what, fn, fargs in jobs:
            tag = f"{name:26s} {what:24s}"
            out = try_compile(lambda: fn(*fargs), tag, first_line=True, quiet=True)
            if out is None:
                failed += 1
                continue
            label, k = out
            regs, spill = ptxas_report(k.asm["ptx"], ptxas)
            print(f"{tag} {label:20s} regs {regs or '?'} spills {spill or '?'} shared {k.metadata.shared}", flush=True)
    print(f"{failed} variant(s) failed to compile" if failed else "every variant compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
