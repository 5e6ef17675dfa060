"""Offline sm_90a compile of the FP8 mid GEMM (`fp8_mid_gemm_triton`, W8A8, 64 rows; no GPU needed).

``PYTHONPATH=<triton 3.6 dir>:src:benchmarks python scripts/fp8_mid_offline.py [--wide | --routes]
[--ptxas PATH] [--ptx-dir DIR]``

Compiles `_fp8_mid_gemm_kernel` through Triton for sm_90a as the launcher would launch it
at 64 producer-quantised rows (no bias, per-row weight scales; the JIT's 16-divisibility
specialisation of pointers, ``N``, ``K`` and ``stride_xm``, and ``stride_xs == 1``, assumed)
for the current default tiles of the Llama-3-8B shapes (`FP8_MID_DEFAULT_W8A8`) and their
split-K forms, or with ``--wide`` for every candidate of ``benchmarks/fp8_mid_sweep.py``
(stage 1 and a stage 2 around its first structures), or with ``--routes`` for the tiles of
``benchmarks/fp8_routes.py`` (each plain, with PDL, and with PDL + L2 hints). Runs ``ptxas -v`` and prints registers,
spills, Triton's shared memory, the compile seconds and PTX counts (wgmma, mma.sync, TMA
loads, atomics, plain global stores). ``--ptx-dir`` writes each PTX (to diff two trees).
A compile error is listed, not fatal. Install the device's Triton with ``pip install --no-deps
--target <dir> triton==3.6.0``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import triton

from offline_ptxas import compile_sm90a, ptx_counts, ptxas_parser, ptxas_path, ptxas_report, try_compile

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/benchmarks")

from attnserve.models.layers.mid_gemm import m_pieces  # noqa: E402
from attnserve.models.layers.quantization import fp8_mid_gemm_triton as kt  # noqa: E402

SHAPES = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, True),
          ("down", 4096, 14336, False)]
M = 64


def compile_fp8_mid(cfg, gated: bool):
    """Triton's sm_90a compile of `_fp8_mid_gemm_kernel` for ``cfg`` at `M` W8A8 rows."""
    fn = kt._fp8_mid_gemm_kernel
    names = fn.arg_names
    m1, m2 = m_pieces(M)
    const = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M1=m1, BLOCK_M2=max(m2, 16), HAS_M2=m2 > 0,
                 SPLIT_K=cfg.split_k, USE_TMA=cfg.use_tma, UPCAST=False, W8A8=True, WS_PER_TENSOR=False,
                 HAS_BIAS=False, GATED=gated, ACT=1 if gated else 0, stride_xs=1, USE_PDL=cfg.pdl,
                 PREFETCH_LINES=1 << max(cfg.prefetch * cfg.block_k // 128 - 1, 0).bit_length() if cfg.prefetch else 0,
                 INTERPRET=False)
    split = cfg.split_k > 1
    types = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*fp32",
             "y_ptr": "*bf16", "wk_ptr": "*fp32" if split else "*bf16", "cnt_ptr": "*i32" if split else "*bf16",
             "w_desc": f"tensordesc<fp8e4nv[{cfg.block_n}, {cfg.block_k}]>" if cfg.use_tma else "*fp8e4nv"}
    ptrs = [n for n in names if n in types and not types[n].startswith("tensordesc")]
    divisible = set(ptrs) | {"N", "K", "stride_xm", "stride_ym"}
    return compile_sm90a(fn, const, types, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), divisible)


def configs(wide: bool, routes: bool = False):
    from attnserve.models.layers.mid_gemm import table_key
    from attnserve.models.layers.quantization import fp8_mid_gemm as mid

    out = []
    for name, n, k, gated in SHAPES:
        if routes:
            import fp8_routes

            out += [(name, gated, c) for c in fp8_routes._tiles(fp8_routes.BASE_TILES[name])]
        elif wide:
            import fp8_mid_sweep as sw

            plan = sw.plan_stage1(M, n, k, gated)
            out += [(name, gated, c) for c in plan + sw.plan_stage2(plan[1:4], M, gated, plan)]
        else:
            row = mid.FP8_MID_DEFAULT_W8A8["NVIDIA_H100_80GB_HBM3"][table_key(n, k, gated)]
            cfg = mid._config_from_row(row, M, k, gated, "w8a8")
            out += [(name, gated, cfg), (name, gated, dataclasses.replace(cfg, split_k=2 if cfg.split_k == 1 else 1))]
    return out


def main(argv=None) -> int:
    ap = ptxas_parser(__doc__)
    ap.add_argument("--wide", action="store_true", help="the wide sweep's candidates instead of the defaults")
    ap.add_argument("--routes", action="store_true",
                    help="the W8A8 tiles of benchmarks/fp8_routes.py (plain, PDL, PDL + L2 hints)")
    ap.add_argument("--ptx-dir", help="write each PTX here")
    args = ap.parse_args(argv)
    ptxas = ptxas_path(args.ptxas)
    print(f"triton {triton.__version__}, ptxas {ptxas}; W8A8, M = {M}", flush=True)
    t_all, ok = time.perf_counter(), 0
    for name, gated, cfg in configs(args.wide, args.routes):
        label = (f"{name} {cfg.block_n}x{cfg.block_k}/{cfg.num_warps}w{cfg.num_stages}s/sk{cfg.split_k}"
                 f"{'/tma' if cfg.use_tma else ''}{'/pdl' if cfg.pdl else ''}{f'pf{cfg.prefetch}' if cfg.prefetch else ''}")
        t0 = time.perf_counter()
        k = try_compile(lambda: compile_fp8_mid(cfg, gated), f"{label:34s}", first_line=True, quiet=True)
        if k is None:  # ptxas / resource errors are reported, not fatal
            continue
        secs = time.perf_counter() - t0
        ok += 1
        ptx = k.asm["ptx"]
        if args.ptx_dir:
            os.makedirs(args.ptx_dir, exist_ok=True)
            with open(os.path.join(args.ptx_dir, label.replace(" ", "_").replace("/", "_") + ".ptx"), "w") as f:
                f.write(ptx)
        regs, spill = ptxas_report(ptx, ptxas)
        counts = ptx_counts(ptx, (
            ("wgmma", r"wgmma\.mma_async"), ("mma", r"\bmma\.sync"), ("tma", r"cp\.async\.bulk\.tensor"),
            ("atom", r"\batom\.|\bred\."), ("st.global", r"st\.global")))
        print(f"{label:34s} regs {regs or '?'} spills {spill or '?'} "
              f"shared {k.metadata.shared} compile {secs:.1f}s " + counts, flush=True)
    print(f"{ok} compiled in {time.perf_counter() - t_all:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
