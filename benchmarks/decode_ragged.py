"""Ragged paged decode: our split heuristics against SGLang's Triton decode kernel, one run.

``PYTHONPATH=src python benchmarks/decode_ragged.py [--out DIR] [--name FILE] [--sglang-wheel
PATH] [--cases NAME ...] [--variants NAME ...] [--smoke]`` measures, on one GPU and on the
same paged inputs (page size 1, Hq 32, Hkv 8, D 128, bf16, token slots randomly permuted):

* the copy ceiling: a 1 GiB device-to-device copy, bytes read + written (median of
  ``triton.testing.do_bench``); a case's floor is its K+V bytes over that rate;
* ``sglang``: ``decode_attention_fwd`` of SGLang's ``decode_attention.py``, loaded at run
  time from the sglang wheel (``python3 -m pip download --no-deps sglang -d .whl/sglang``;
  the code is not part of this repository). It runs as SGLang's Triton backend runs it on
  this GPU: ``--triton-attention-num-kv-splits`` 8 (its default), per-request split counts
  from its own ``get_num_kv_splits_triton`` (``TritonAttnBackend.get_num_kv_splits``:
  ``MAX_NUM_SEQ`` 256 or the next power of two, ``device_core_count`` = the SM count),
  PDL on sm_90+ (``is_arch_support_pdl``), int64 ``kv_indices``, the ``uneven_batch`` flag
  buffer. The few sglang modules its import needs (``sglang.srt.utils``, ``sglang.srt.environ``)
  are replaced by small stand-ins answering "CUDA, no HIP, every env flag off";
* ours: `decode_attention_fwd` with the split counts of each variant in `VARIANTS` (the
  counts are batch metadata, computed once per step in serving, so neither side's split
  kernel is inside the timed region; both are timed on their own as ``metadata_us``).

Times are the median per call of CUDA-graph replays (events around each replay of a graph
holding >= 24 calls; every case's KV is > 4x the L2, so no set rotation is needed), averaged
over ``--passes`` interleaved passes (each pass's median is kept in ``us_runs``), plus
``triton.testing.do_bench`` medians (L2 flushed per call) for ours-default and SGLang.
Every output is checked against SGLang's and, for six requests a case, against float64.
Writes ``<out>/<name>`` (default ``benchmarks/results/<h100|h200|slug>-decode-ragged-<date>.json``)
and prints a table last. ``--smoke`` runs tiny float32 cases on the CPU under the Triton
interpreter (plumbing only, no timing).
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import types
import zipfile

import torch

HQ, HKV, HEAD_DIM = 32, 8, 128
MAX_KV_SPLITS = 32  # ours: DEFAULT_NUM_KV_SPLITS of the backend config
SGLANG_MAX_KV_SPLITS = 8  # SGLang: --triton-attention-num-kv-splits default
CASES = ("ragged64", "ragged256", "tail64", "tail256", "64x1K", "64x8K", "8x32K", "256x2K",
         "mixed100", "mixed400", "mixed700")
#: split-count variants of ours: name -> (rule, compute_num_kv_splits kwargs, grid waves)
VARIANTS = {
    "head": ("floor-uncapped", {}, 4),  # counts and grid before issue 33 (issue 21's whole-wave floor)
    "cdiv": ("cdiv-uncapped", {}, 4),  # counts before issue 21 (rounded up), same grid
    "default": ("new", {}, None),  # compute_num_kv_splits / decode_grid_splits defaults
    "rag1.0-g4": ("new", {"ragged_factor": 1.0}, 4),
    "rag0.5-g4": ("new", {"ragged_factor": 0.5}, 4),
    "rag0.25-g4": ("new", {"ragged_factor": 0.25}, 4),
    "rag0.5-g8": ("new", {"ragged_factor": 0.5}, 8),
    "rag0.25-g8": ("new", {"ragged_factor": 0.25}, 8),
    "rag0.5-g16": ("new", {"ragged_factor": 0.5}, 16),
    "rag0.5-g32": ("new", {"ragged_factor": 0.5}, 32),
    "rag0.75-g16": ("new", {"ragged_factor": 0.75}, 16),
    "rag1.0-g16": ("new", {"ragged_factor": 1.0}, 16),
    "rag1.5-g16": ("new", {"ragged_factor": 1.5}, 16),
    "rag2.0-g16": ("new", {"ragged_factor": 2.0}, 16),
    "rag3.0-g16": ("new", {"ragged_factor": 3.0}, 16),
    "floor-g8": ("new", {"ragged_factor": 0.0}, 8),  # empty-program cost: same counts, larger grid
    "floor-g16": ("new", {"ragged_factor": 0.0}, 16),
}
_SGLANG_FILES = {
    "decode": ("sglang/kernels/ops/attention/decode_attention.py",
               "sglang/srt/layers/attention/triton_ops/decode_attention.py"),
    "metadata": ("sglang/kernels/ops/attention/metadata.py",),
    "score_mod": ("sglang/kernels/ops/attention/score_mod.py",),
}


# ------------------------------------------------------------------------------- sglang
def _wheel_path(path: str) -> str:
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "sglang-*.whl")))
        if not found:
            raise FileNotFoundError(f"no sglang-*.whl in {path}")
        return found[-1]
    return path


def load_sglang(wheel: str, num_sms: int):
    """SGLang's decode kernel module and split-count kernel from the wheel, with stand-ins for
    the sglang utilities they import. Returns ``(decode_module, get_num_kv_splits_triton,
    wheel_file)``."""
    wheel = _wheel_path(wheel)
    root = tempfile.mkdtemp(prefix="sglang_src_")
    paths = {}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for key, candidates in _SGLANG_FILES.items():
            member = next((c for c in candidates if c in names), None)
            if member is None:
                raise FileNotFoundError(f"{wheel} holds none of {candidates}")
            paths[key] = z.extract(member, root)

    def package(name):
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod
        return mod

    for name in ("sglang", "sglang.srt", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention"):
        package(name)
    utils = types.ModuleType("sglang.srt.utils")  # what decode_attention.py asks of it, on CUDA
    utils.get_device_core_count = lambda device_id=0: num_sms
    utils.is_hip = lambda: False
    utils.is_gfx95_supported = lambda: False
    utils.is_gfx1250_supported = lambda: False
    sys.modules["sglang.srt.utils"] = utils

    class _Flag:
        def get(self):
            return False

    class _Envs:  # every SGLANG_* flag at its "off" default (read only on HIP paths)
        def __getattr__(self, name):
            return _Flag()

    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = _Envs()
    sys.modules["sglang.srt.environ"] = environ

    def load(key, name):
        spec = importlib.util.spec_from_file_location(name, paths[key])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)  # a file on disk: Triton's @jit reads its source
        return mod

    load("score_mod", "sglang.kernels.ops.attention.score_mod")
    decode = load("decode", "sglang.kernels.ops.attention.decode_attention")
    metadata = load("metadata", "sglang.kernels.ops.attention.metadata")
    return decode, metadata.get_num_kv_splits_triton, os.path.basename(wheel)


def sglang_num_kv_splits(fn, seq_lens64, out, uneven, num_sms, hq=HQ, hkv=HKV):
    """``TritonAttnBackend.get_num_kv_splits`` for decode (no speculative groups)."""
    import triton

    bs = seq_lens64.shape[0]
    fn[(1,)](out, seq_lens64, bs, 1, hq, hkv, SGLANG_MAX_KV_SPLITS, num_sms,
             MAX_NUM_SEQ=256 if bs < 256 else triton.next_power_of_2(bs), uneven_batch_ptr=uneven)


# -------------------------------------------------------------------------------- cases
def mixed_step_lens(step: int, num_prompts: int = 256, input_len: int = 1024, output_len: int = 1024,
                    range_ratio: float = 0.098, seed: int = 0):
    """The running batch of `bench.offline`'s random workload (issue 33's mixed rows, its
    lengths from `bench.roofline.random_lengths` with that row's arguments) at decode step
    ``step``, as its roofline counts it (`bench.roofline.workload_roofline`: every request
    decodes from step 0): ``isl + step`` keys for each request whose output is longer than
    ``step`` tokens."""
    from attnserve.bench.roofline import random_lengths

    isl, osl = random_lengths(num_prompts, input_len, output_len, range_ratio, seed)
    return [i + step for i, o in zip(isl, osl) if o > step]


def case_lens(name: str, gen: torch.Generator, smoke: bool = False):
    """Request lengths of a case: ``ragged<bs>`` uniform in [128, 8192]; ``tail<bs>``
    log-normal, median 1,024, sigma 1, clipped to [128, 32768]; ``<bs>x<len>`` equal;
    ``mixed<step>`` the mixed workload's batch at that decode step (`mixed_step_lens`)."""
    if smoke:
        return {"ragged64": [3, 70, 300, 129, 64], "tail64": [5, 17, 40, 600], "64x1K": [96] * 4}[name]
    if name.startswith("mixed"):
        return mixed_step_lens(int(name[5:]))
    if name.startswith("ragged"):
        return torch.randint(128, 8193, (int(name[6:]),), generator=gen).tolist()
    if name.startswith("tail"):
        x = torch.exp(torch.randn(int(name[4:]), generator=gen) + math.log(1024))
        return x.clamp(128, 32768).long().tolist()
    bs, n = name.split("x")
    return [int(n[:-1]) * 1024] * int(bs)


def old_rule_counts(lens, rule, num_sms, waves=4, min_split=128):
    """The split counts of earlier heads, on the host: ``n // t`` (issue 21) or ``cdiv(n, t)``
    (before), ``t = max(cdiv(T, num_sms * waves // HKV), min_split)``, clamped to
    ``1..MAX_KV_SPLITS`` (no grid cap: a program loops over extra splits)."""
    per = max(-(-sum(lens) // max(1, num_sms * waves // HKV)), min_split)
    f = (lambda n: n // per) if rule == "floor-uncapped" else (lambda n: -(-n // per))
    return [min(max(f(n), 1), MAX_KV_SPLITS) for n in lens]


def paged_inputs(lens, gen, device, dtype, hq=HQ, hkv=HKV, d=HEAD_DIM):
    """Page-size-1 KV over randomly permuted slots (slot 0 reserved): q, k_buffer, v_buffer,
    kv_indptr (int32), kv_indices (int32; int64 copy for SGLang) and the slots per request."""
    total = sum(lens)
    perm = torch.randperm(total, generator=gen) + 1
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    dgen = torch.Generator(device=device)
    dgen.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    k = (torch.randn(total + 1, hkv, d, generator=dgen, device=device) * 0.5).to(dtype)
    v = torch.randn(total + 1, hkv, d, generator=dgen, device=device).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=dgen, device=device).to(dtype)
    idx = perm.to(torch.int32).to(device)
    return dict(q=q, k=k, v=v, kv_indptr=kv_indptr.to(device), kv_indices=idx, kv_indices64=idx.long(),
                lens=lens, perm=perm)


def reference_rows(inp, rows, sm_scale):
    """float64 attention for the chosen requests: ``[len(rows), HQ, D]``."""
    q, k, v, ip = inp["q"], inp["k"], inp["v"], inp["kv_indptr"].cpu()
    hq, hkv = q.shape[1], k.shape[1]
    out = []
    for i in rows:
        slots = inp["kv_indices"][int(ip[i]): int(ip[i + 1])].long()
        kk = k[slots].double().repeat_interleave(hq // hkv, dim=1)
        vv = v[slots].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * sm_scale
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv))
    return torch.stack(out)


def rel_err(out, ref):
    if torch.isnan(out).any():
        return float("inf")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------ running
def run_case(name, args, sgl, num_sms, gen, device, dtype, copy_tbps, use_pdl):
    from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd
    from attnserve.attention.triton_ops.decode_splits import _GRID_WAVES, compute_num_kv_splits, decode_grid_splits

    lens = case_lens(name, gen, args.smoke)
    bs = len(lens)
    hq, hkv, d = (8, 2, 64) if args.smoke else (HQ, HKV, HEAD_DIM)
    inp = paged_inputs(lens, gen, device, dtype, hq, hkv, d)
    sm_scale = d ** -0.5
    seq32 = torch.tensor(lens, dtype=torch.int32, device=device)
    kv_bytes = 2 * sum(lens) * hkv * d * torch.finfo(dtype).bits // 8
    row = dict(case=name, bs=bs, tokens=sum(lens), len_min=min(lens), len_max=max(lens),
               len_mean=sum(lens) / bs, kv_bytes=kv_bytes)
    if copy_tbps:
        row["floor_us"] = kv_bytes / (copy_tbps * 1e12) * 1e6

    # SGLang as its Triton backend runs it
    decode_mod, sgl_splits_fn = sgl
    s_ns = torch.empty(bs, dtype=torch.int32, device=device)
    uneven = torch.zeros(1, dtype=torch.int32, device=device)
    seq64 = seq32.long()
    sglang_num_kv_splits(sgl_splits_fn, seq64, s_ns, uneven, num_sms, hq, hkv)
    s_logits = torch.empty(bs, hq, SGLANG_MAX_KV_SPLITS, d, dtype=torch.float32, device=device)
    s_lse = torch.empty(bs, hq, SGLANG_MAX_KV_SPLITS, dtype=torch.float32, device=device)
    s_o = torch.full((bs, hq, d), float("nan"), dtype=dtype, device=device)

    def sglang_call(pdl=use_pdl):
        decode_mod.decode_attention_fwd(inp["q"], inp["k"], inp["v"], s_o, inp["kv_indptr"], inp["kv_indices64"],
                                        s_logits, s_lse, s_ns, SGLANG_MAX_KV_SPLITS, sm_scale, 1.0, 1.0,
                                        use_pdl=pdl, page_size=1, uneven_batch=uneven)

    pdl = use_pdl
    row["sglang"] = {}
    try:
        sglang_call(pdl)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # PDL refused by this Triton / driver: SGLang without it, recorded
        if not pdl:
            raise
        pdl, row["sglang"]["pdl_error"] = False, f"{type(e).__name__}: {str(e)[:200]}"
        sglang_call(pdl)
    sample = sorted(range(bs), key=lambda i: -lens[i])[:3] + [int(i) for i in torch.randperm(bs, generator=gen)[:3]]
    ref = reference_rows(inp, sample, sm_scale)
    row["sglang"].update(splits_mean=float(s_ns.float().mean()), splits_max=int(s_ns.max()),
                         err_f64=rel_err(s_o[sample].cpu(), ref.cpu()))
    s_out = s_o.clone()

    ours = {}
    for vname in args.variants:
        rule, kw, waves = VARIANTS[vname]
        waves = waves or _GRID_WAVES
        if rule == "new":
            ns = compute_num_kv_splits(seq32, torch.empty(bs, dtype=torch.int32, device=device), MAX_KV_SPLITS,
                                       num_sms, hkv, grid_waves=waves, **kw)
        else:
            ns = torch.tensor(old_rule_counts(lens, rule, num_sms), dtype=torch.int32, device=device)
        if rule == "new":
            g = decode_grid_splits(bs, hkv, MAX_KV_SPLITS, num_sms, waves)
        else:  # the grid of those heads: cdiv(num_sms * 4, bs * Hkv), no minimum
            g = max(1, min(MAX_KV_SPLITS, -(-num_sms * waves // (bs * hkv))))
        logits = torch.empty(bs, hq, MAX_KV_SPLITS, d, dtype=torch.float32, device=device)
        lse = torch.empty(bs, hq, MAX_KV_SPLITS, dtype=torch.float32, device=device)
        o = torch.full((bs, hq, d), float("nan"), dtype=dtype, device=device)

        def call(ns=ns, g=g, logits=logits, lse=lse, o=o):
            decode_attention_fwd(inp["q"], inp["k"], inp["v"], o, inp["kv_indptr"], inp["kv_indices"], logits, lse,
                                 ns, MAX_KV_SPLITS, sm_scale, grid_splits=g)

        call()
        nsl = ns.cpu()
        ours[vname] = dict(splits_mean=float(nsl.float().mean()), splits_max=int(nsl.max()), splits_sum=int(nsl.sum()),
                           grid_splits=g, working_programs=int(nsl.clamp(max=g).sum()) * hkv,
                           grid_programs=bs * hkv * g, err_vs_sglang=rel_err(o.cpu(), s_out.cpu()),
                           err_f64=rel_err(o[sample].cpu(), ref.cpu()), _call=call)
    if not args.smoke:
        from common import bench_eager, bench_graph

        runs = {"sglang": []}
        for _ in range(args.passes):  # interleaved passes: the spread of a config is the noise
            try:
                runs["sglang"].append(bench_graph([lambda: sglang_call(pdl)]))
            except Exception as e:  # PDL inside a CUDA graph refused: time it without, recorded
                if not pdl:
                    raise
                pdl, row["sglang"]["pdl_graph_error"] = False, f"{type(e).__name__}: {str(e)[:200]}"
                runs["sglang"].append(bench_graph([lambda: sglang_call(pdl)]))
            for vname, r in ours.items():
                runs.setdefault(vname, []).append(bench_graph([r["_call"]]))
        row["sglang"].update(us=sum(runs["sglang"]) / len(runs["sglang"]), us_runs=runs["sglang"], use_pdl=pdl)
        row["sglang"]["eager_us"] = bench_eager([lambda: sglang_call(pdl)])
        for vname, r in ours.items():
            r["us_runs"] = runs[vname]
            r["us"] = sum(runs[vname]) / len(runs[vname])
            r["vs_sglang"] = row["sglang"]["us"] / r["us"]
            if copy_tbps:
                r["pct_copy"] = 100 * row["floor_us"] / r["us"]
        if "default" in ours:
            ours["default"]["eager_us"] = bench_eager([ours["default"]["_call"]])
        if copy_tbps:
            row["sglang"]["pct_copy"] = 100 * row["floor_us"] / row["sglang"]["us"]
        import triton.testing

        ns_buf = torch.empty(bs, dtype=torch.int32, device=device)
        row["metadata_us"] = {
            "ours": triton.testing.do_bench(lambda: compute_num_kv_splits(seq32, ns_buf, MAX_KV_SPLITS, num_sms, hkv),
                                            return_mode="median") * 1e3,
            "sglang": triton.testing.do_bench(
                lambda: sglang_num_kv_splits(sgl_splits_fn, seq64, ns_buf, uneven, num_sms, hq, hkv),
                return_mode="median") * 1e3,
        }
    for r in ours.values():
        r.pop("_call")
    row["ours"] = ours
    del inp
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def copy_ceiling_tbps() -> float:
    import triton.testing

    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return 2 * (1 << 28) * 4 / (ms * 1e-3) / 1e12


def print_table(res):
    names = list(res["variants"])
    print(f"\ncopy ceiling {res['copy_tbps']:.3f} TB/s; per variant: us, SGLang us / ours us, floor / time")
    print(f"{'case':>10s} {'floor':>7s} {'sglang':>14s} " + " ".join(f"{n:>19s}" for n in names))
    for row in res["cases"]:
        if "error" in row:
            print(f"{row['case']:>10s} ERROR {row['error']}")
            continue
        s = row["sglang"]
        line = f"{row['case']:>10s} {row['floor_us']:7.1f} {s['us']:7.1f} ({s['pct_copy']:3.0f}%) "
        for n in names:
            r = row["ours"][n]
            line += f" {r['us']:7.1f} {r['vs_sglang']:5.3f}x {r['pct_copy']:3.0f}%"
        print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default=None, help="file name of the JSON (default <gpu>-decode-ragged-<date>.json)")
    ap.add_argument("--sglang-wheel", default=".whl/sglang", help="sglang wheel, or a folder holding one")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=33)
    ap.add_argument("--passes", type=int, default=2, help="interleaved timing passes (times are their mean)")
    ap.add_argument("--smoke", action="store_true", help="tiny float32 cases on the CPU (interpreter), no timing")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import triton

    from attnserve.attention.triton_ops import decode_splits

    if args.smoke:
        device, dtype, num_sms, copy_tbps, use_pdl = torch.device("cpu"), torch.float32, 4, None, False
        args.cases = [c for c in ("ragged64", "tail64", "64x1K")]
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        use_pdl = torch.cuda.get_device_capability()[0] >= 9
        copy_tbps = copy_ceiling_tbps()
    sgl = load_sglang(args.sglang_wheel, num_sms)
    wheel = sgl[2]
    sgl = sgl[:2]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    res = {"benchmark": "decode_ragged", "date": dt.date.today().isoformat(), "gpu": gpu, "num_sms": num_sms,
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "sglang_wheel": wheel, "sglang_use_pdl": use_pdl, "sglang_max_kv_splits": SGLANG_MAX_KV_SPLITS,
           "shape": {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM, "dtype": str(dtype), "page_size": 1,
                     "max_kv_splits": MAX_KV_SPLITS},
           "defaults": {"ragged_factor": decode_splits._RAGGED_FACTOR, "grid_waves": decode_splits._GRID_WAVES,
                        "waves": decode_splits._SPLIT_WAVES, "min_split_tokens": decode_splits._MIN_SPLIT_TOKENS},
           "variants": {n: {"rule": VARIANTS[n][0], **VARIANTS[n][1], "grid_waves": VARIANTS[n][2]}
                        for n in args.variants},
           "copy_tbps": copy_tbps, "cases": []}
    short = next((k for k in ("h100", "h200") if k in gpu.lower()), gpu.lower().replace("nvidia ", "").replace(" ", "-"))
    path = os.path.join(args.out, args.name or f"{short}-decode-ragged-{res['date']}.json")
    gen = torch.Generator().manual_seed(args.seed)
    bad = []
    for name in args.cases:
        try:
            row = run_case(name, args, sgl, num_sms, gen, device, dtype, copy_tbps, use_pdl)
        except Exception as e:  # keep the other cases' numbers; the error is in the JSON
            if args.smoke:
                raise
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            bad.append(name)
            print(f"{name}: {row['error']}", flush=True)
        else:
            errs = [row["sglang"]["err_f64"]] + [r["err_f64"] for r in row["ours"].values()]
            row["max_err_f64"] = max(errs)
            print(f"{name}: bs {row['bs']} tokens {row['tokens']} max rel err vs float64 {max(errs):.2e}", flush=True)
            if max(errs) > 1e-2:
                bad.append(name)
        res["cases"].append(row)
        res["total_s"] = time.perf_counter() - t0
        if not args.smoke:  # written after every case, so a run cut short keeps what it measured
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
    if args.smoke:
        print(json.dumps(res["cases"], indent=1)[:3000])
    else:
        print(f"wrote {path}")
        print_table(res)
    if bad:
        raise SystemExit(f"cases failed or off the float64 reference (> 1e-2): {bad}")
    return res


if __name__ == "__main__":
    main()
