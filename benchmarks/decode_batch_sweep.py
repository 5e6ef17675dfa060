"""Large-batch decode attention tuning: stage-1 tiles, residency and split counts.

``PYTHONPATH=src python benchmarks/decode_batch_sweep.py [--out DIR] [--quick | --tp-shards | --tp-tiles]``

`decode_config` was tuned at batch 1 and 8 (``decode_sweep.py``), where a request's few
programs must each stream fast. In the random workload of ``bench.offline`` the decode
steps run 64-256 requests of ~800 keys; there one 3-stage 128-key program fills an SM's
shared memory (~192 KB at d 128), so each program's pipeline fill and drain (7 tiles at 800
keys) is not hidden by a second resident program. This sweep times stage 1 + 2 inside a
CUDA graph (launch cost removed, as in a decode step) over those batch shapes for every
``(block_n, num_stages, num_warps)`` and split-wave budget, and reports each against the
device-to-device copy rate measured in the same run (the roofline's ``BW``): the kernel
reads ``sum(lens) * Hkv * D * 2`` bytes of K and V.

Shapes: Llama-3-8B (Hq 32, Hkv 8, D 128) and Qwen3-0.6B (Hq 16, Hkv 8, D 128); KV slots
are whole requests in a shuffled order (prefill allocates a prompt's slots together).
Every config's output is checked against the default config's (max |diff| recorded).
Each timed graph cycles through copies of the KV (>= 256 MB in all), so the L2 does not hold
a call's KV (it would hold one tp-4 rank's 38 MB at 64 x 576 keys otherwise).
Writes ``<out>/<device>-decode-batch-sweep-<date>.json``.

``--tp-shards`` (`tp_shard_sweep`): the engine's split rule at several minimum split lengths on one
rank's heads at tp 2 / tp 4 (and tp 1 controls); ``--tp-tiles``: this tile sweep, with split-wave
budgets 1-8, on one tp-4 rank's heads (`TP_TILE_CASES`). JSON tags ``decode-tp-shard-splits`` /
``decode-tp-tiles``. ``--stages-ab`` (`stages_ab`): the engine's tile against it at 2 stages
(``decode-stages-ab``). ``--head-shapes`` (`head_shape_sweep`): tiles with K's head split or
whole on Phi-3-mini's heads (``decode-head-shapes``; ``--kv-dtype fp8_e4m3``: over an e4m3 cache,
``decode-head-shapes-fp8_e4m3``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import itertools
from dataclasses import dataclass

import torch

from attnserve.bench.results import write_result
from common import bench_graph

SHAPES = {"llama-3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128),
          # one rank's heads of Llama-3-8B under tensor parallelism
          "llama-3-8b-tp2": (16, 4, 128), "llama-3-8b-tp4": (8, 2, 128),
          # MHA with a head size that is not a power of two (Phi-3-mini / Phi-3.5-mini)
          "phi-3-mini": (32, 32, 96)}
#: (shape, batch, context or (lo, hi) uniform lengths, KV dtypes)
CASES = [
    ("llama-3-8b", 64, 800, ("bf16",)),
    ("llama-3-8b", 144, 800, ("bf16", "fp8_e4m3")),
    ("llama-3-8b", 256, 800, ("bf16",)),
    ("qwen3-0.6b", 144, 800, ("bf16", "fp8_e4m3")),
    ("qwen3-0.6b", 256, 800, ("bf16",)),
    ("llama-3-8b", 256, (200, 1800), ("bf16", "fp8_e4m3")),
]
DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
#: ``--tp-shards``: (shape, batch, context) with the engine's split rule at each minimum split length
TP_CASES = [
    ("llama-3-8b-tp4", 64, 576),  # tp_decode.py's 64 requests of 512 + 128 keys, mid-run
    ("llama-3-8b-tp4", 64, (512, 640)),
    ("llama-3-8b-tp4", 144, 800),
    ("llama-3-8b-tp4", 256, (200, 1800)),
    ("llama-3-8b-tp2", 64, 576),
    ("llama-3-8b", 64, 576),  # tp 1: the control
    ("llama-3-8b", 8, 4096),
    ("llama-3-8b", 1, 8192),
]
#: ``--tp-tiles``: `sweep`'s tile x split-wave grid on one tp-4 rank's heads
TP_TILE_CASES = [("llama-3-8b-tp4", 64, 576, ("bf16",)), ("llama-3-8b-tp4", 144, 800, ("bf16",))]
MIN_SPLIT_TOKENS = (128, 256, 384, 512, 1024)
#: ``--stages-ab``: the engine's stage-1 config against the same with 2 stages, at tp 1 / 2 / 4 heads
STAGES_AB_CASES = [(shape, bs, ctx) for shape in ("llama-3-8b", "llama-3-8b-tp2", "llama-3-8b-tp4")
                   for bs, ctx in ((1, 576), (8, 4096), (64, 576), (64, 800), (144, 800), (256, (200, 1800)))]
#: ``--head-shapes``: (shape, batch, context) cases of `head_shape_sweep`
HEAD_SHAPE_CASES = [("phi-3-mini", bs, ctx) for bs, ctx in ((1, 2048), (8, 4096), (32, 800), (96, 800), (144, 800),
                                                             (256, (200, 1800)))]
#: ``--head-shapes --block-h1``: fewer cases of the same shape
BLOCK_H1_CASES = [("phi-3-mini", bs, ctx) for bs, ctx in ((8, 4096), (96, 800), (144, 800))]
ROTATE_BYTES = 256 << 20


def _case(hq, hkv, d, bs, ctx, dtype, gen, device="cuda"):
    from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr

    if isinstance(ctx, tuple):
        lens = torch.randint(ctx[0], ctx[1] + 1, (bs,), generator=gen, dtype=torch.int32)
    else:
        lens = torch.full((bs,), ctx, dtype=torch.int32)
    total = int(lens.sum())
    # whole requests in a shuffled order (slot 0 is the pool's padding slot)
    starts = torch.zeros(bs, dtype=torch.int64)
    order = torch.randperm(bs, generator=gen)
    pos = 1
    for i in order.tolist():
        starts[i] = pos
        pos += int(lens[i])
    indices = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, lens)]).to(device, torch.int32)
    k = torch.randn(total + 1, hkv, d, generator=gen).to(device, torch.bfloat16).to(dtype)
    v = torch.randn(total + 1, hkv, d, generator=gen).to(device, torch.bfloat16).to(dtype)
    q = torch.randn(bs, hq, d, generator=gen).to(device, torch.bfloat16)
    lens = lens.to(device)
    return q, k, v, lens, compute_kv_indptr(lens), indices, total


def _rotated(k, v, kv_bytes: int) -> list:
    """``[(k, v), copies...]``: >= ROTATE_BYTES of KV in all, cycled through a timed graph so that
    the L2 (50 MB on an H200) never holds a call's KV, as it would not in a 32-layer step."""
    return [(k, v)] + [(k.clone(), v.clone()) for _ in range(-(-ROTATE_BYTES // kv_bytes) - 1)]


@dataclass
class _Buffers:
    """One case's decode inputs (`_case`), its KV copies (`_rotated`) and the split scratch."""

    hq: int
    hkv: int
    d: int
    q: torch.Tensor
    kvs: list
    lens: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    kv_bytes: int
    logits: torch.Tensor
    lse: torch.Tensor
    max_kv_splits: int

    def calls(self, o: torch.Tensor, splits: torch.Tensor, config=None) -> list:
        """Stage 1 + 2 into ``o``, one call per KV copy (`bench_graph` cycles through them)."""
        from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd

        return [functools.partial(decode_attention_fwd, self.q, k, v, o, self.indptr, self.indices, self.logits,
                                  self.lse, splits, self.max_kv_splits, self.d ** -0.5, config=config)
                for k, v in self.kvs]


def _buffers(shape: str, bs: int, ctx, dtype, gen, max_kv_splits: int, device="cuda") -> _Buffers:
    """`_Buffers` of `SHAPES` [shape] for ``bs`` requests of ``ctx`` keys (an int, or uniform in ``(lo, hi)``)."""
    hq, hkv, d = SHAPES[shape]
    q, k, v, lens, indptr, indices, total = _case(hq, hkv, d, bs, ctx, dtype, gen, device)
    kv_bytes = total * hkv * d * 2 * k.element_size()
    return _Buffers(hq, hkv, d, q, _rotated(k, v, kv_bytes), lens, indptr, indices, kv_bytes,
                    torch.empty(bs, hq, max_kv_splits, d, device=device), torch.empty(bs, hq, max_kv_splits,
                                                                                     device=device), max_kv_splits)


def _configs(dtype_name: str):
    if dtype_name == "bf16":
        return itertools.product((64, 128), (2, 3, 4), (4, 8))
    return itertools.product((128, 256), (2, 3, 4), (4, 8))


def _time_config(row: dict, make_calls, o: torch.Tensor, ref, kv_bytes: int, copy_bps: float, diff_key: str):
    """One stage-1 config of a sweep into ``row``: ``make_calls()`` (the graphed launches writing
    ``o``) run once, ``row[diff_key]`` = max |o - ref| (``ref``: the first config's output, taken
    here when None), then ``graph_us``, ``kv_gbs`` and ``share_of_copy_rate`` of ``kv_bytes``
    against ``copy_bps``; a config that does not compile or fit records ``error`` instead.
    Returns ``ref``."""
    try:
        calls = make_calls()
        calls[0]()
        torch.cuda.synchronize()
        if ref is None:
            ref = o.float().clone()
        row[diff_key] = float((o.float() - ref).abs().max())
        us = bench_graph(calls)
        row["graph_us"] = us
        row["kv_gbs"] = kv_bytes / us / 1e3
        row["share_of_copy_rate"] = kv_bytes / (us * 1e-6) / copy_bps
    except Exception as e:  # noqa: BLE001 - a config that does not fit is a result
        row["error"] = f"{type(e).__name__}: {e}"[:200]
    return ref


def sweep(quick: bool = False, max_kv_splits: int = 16, cases=None, waves_grid=(4, 8, 16)) -> list:
    from attnserve.attention.triton_ops.decode_attention import DecodeConfig, compute_num_kv_splits, decode_config
    from common import measure_ceilings

    ceil = measure_ceilings()
    copy_bps = ceil["copy_tbps"] * 1e12
    print(f"copy rate {ceil['copy_tbps']:.3f} TB/s", flush=True)
    props = torch.cuda.get_device_properties(0)
    sms, smem, name = props.multi_processor_count, props.shared_memory_per_block_optin, torch.cuda.get_device_name()
    gen = torch.Generator().manual_seed(0)
    rows = []
    if cases is None:
        cases = CASES[:2] if quick else CASES
    for shape, bs, ctx, dtypes in cases:
        for dname in dtypes:
            dtype = DTYPES[dname]
            case = _buffers(shape, bs, ctx, dtype, gen, max_kv_splits)
            hq, hkv, d, kv_bytes = case.hq, case.hkv, case.d, case.kv_bytes
            base = decode_config(d, hq // hkv, dtype, max_shared_mem=smem, device_name=name)
            ref = None
            case_rows = []
            for (block_n, stages, warps), waves in itertools.product(
                    [(base.block_n, base.num_stages, base.num_warps)] + list(_configs(dname)), waves_grid):
                cfg = DecodeConfig(block_n=block_n, block_h=base.block_h, num_warps=warps, num_stages=stages,
                                   v_pairs=base.v_pairs)
                splits = torch.empty(bs, dtype=torch.int32, device="cuda")
                compute_num_kv_splits(case.lens, splits, max_kv_splits, sms, hkv, waves=waves)
                o = torch.empty(bs, hq, d, device="cuda", dtype=torch.bfloat16)
                row = {"shape": shape, "bs": bs, "context": list(ctx) if isinstance(ctx, tuple) else ctx,
                       "kv_dtype": dname, "block_n": block_n, "num_stages": stages, "num_warps": warps,
                       "split_waves": waves, "mean_splits": float(splits.float().mean()),
                       "default": (block_n, stages, warps, waves) == (base.block_n, base.num_stages,
                                                                      base.num_warps, 4)}
                if any(r["block_n"] == block_n and r["num_stages"] == stages and r["num_warps"] == warps
                       and r["split_waves"] == waves for r in case_rows):
                    continue
                ref = _time_config(row, functools.partial(case.calls, o, splits, cfg), o, ref, kv_bytes, copy_bps,
                                   "max_abs_diff_vs_default")
                case_rows.append(row)
            ok = [r for r in case_rows if "graph_us" in r]
            best = min(ok, key=lambda r: r["graph_us"])
            dflt = next(r for r in ok if r["default"])
            print(f"{shape:11s} bs={bs:3d} ctx={ctx} {dname:8s}: default {dflt['graph_us']:7.1f} us "
                  f"({dflt['share_of_copy_rate']:.3f} of copy); best {best['graph_us']:7.1f} us "
                  f"({best['share_of_copy_rate']:.3f}) block_n {best['block_n']} stages {best['num_stages']} "
                  f"warps {best['num_warps']} waves {best['split_waves']}", flush=True)
            rows.extend(case_rows)
            del case
            torch.cuda.empty_cache()
    return rows, ceil


def tp_shard_sweep() -> list:
    """``--tp-shards``: stage 1 + 2 under a CUDA graph as the triton backend launches them
    (`decode_config` chosen by the kernel, `compute_num_kv_splits` with the backend's small-batch
    rule and ragged factor) for `TP_CASES`, at each ``min_split_tokens`` of `MIN_SPLIT_TOKENS`
    (the first is the default, `decode_splits._MIN_SPLIT_TOKENS`). The question: one rank of a
    tp 4 engine has 2 KV heads, so the whole-wave rule's units (``num_sms * waves / Hkv``) are 4x
    tp 1's and a 64 x 576 batch is cut into ~140-key splits; do fewer, longer splits stream faster?"""
    from attnserve.attention.backend_config import DEFAULT_NUM_KV_SPLITS
    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits
    from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS
    from common import measure_ceilings

    ceil = measure_ceilings()
    copy_bps = ceil["copy_tbps"] * 1e12
    print(f"copy rate {ceil['copy_tbps']:.3f} TB/s", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    rows = []
    max_kv_splits = DEFAULT_NUM_KV_SPLITS
    for shape, bs, ctx in TP_CASES:
        case = _buffers(shape, bs, ctx, torch.bfloat16, gen, max_kv_splits)
        ref = None
        line = []
        for min_tokens in MIN_SPLIT_TOKENS:
            splits = torch.empty(bs, dtype=torch.int32, device="cuda")
            compute_num_kv_splits(case.lens, splits, max_kv_splits, sms, case.hkv,
                                  small_split_tokens=SMALL_SPLIT_TOKENS, min_split_tokens=min_tokens)
            o = torch.empty(bs, case.hq, case.d, device="cuda", dtype=torch.bfloat16)
            calls = case.calls(o, splits)
            calls[0]()
            torch.cuda.synchronize()
            if ref is None:
                ref = o.float().clone()
            us = bench_graph(calls)
            row = {"shape": shape, "bs": bs, "context": list(ctx) if isinstance(ctx, tuple) else ctx,
                   "min_split_tokens": min_tokens, "mean_splits": float(splits.float().mean()), "graph_us": us,
                   "share_of_copy_rate": case.kv_bytes / (us * 1e-6) / copy_bps,
                   "max_abs_diff_vs_default": float((o.float() - ref).abs().max())}
            rows.append(row)
            line.append(f"{min_tokens}: {us:6.1f} us ({row['share_of_copy_rate']:.2f}, "
                        f"{row['mean_splits']:.1f} splits)")
        print(f"{shape:15s} bs={bs:3d} ctx={ctx}: " + "  ".join(line), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows, ceil


def _engine_cases(cases, dtype=torch.bfloat16):
    """For each ``(shape, bs, ctx)`` of ``cases`` (a ``dtype`` KV cache) yields ``(shape, bs, ctx, case, splits,
    engine)``: the `_Buffers`, the engine's split counts (`compute_num_kv_splits` with the
    small-batch rule, `DEFAULT_NUM_KV_SPLITS` at most) and the stage-1 config the engine picks for
    that batch (`decode_config` with the batch, KV heads and SMs). Frees the case afterwards."""
    from attnserve.attention.backend_config import DEFAULT_NUM_KV_SPLITS
    from attnserve.attention.triton_ops.decode_attention import compute_num_kv_splits
    from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS
    from attnserve.attention.triton_ops.decode_tuning import decode_config

    props = torch.cuda.get_device_properties(0)
    sms, smem, name = props.multi_processor_count, props.shared_memory_per_block_optin, torch.cuda.get_device_name()
    gen = torch.Generator().manual_seed(0)
    for shape, bs, ctx in cases:
        case = _buffers(shape, bs, ctx, dtype, gen, DEFAULT_NUM_KV_SPLITS)
        splits = torch.empty(bs, dtype=torch.int32, device="cuda")
        compute_num_kv_splits(case.lens, splits, DEFAULT_NUM_KV_SPLITS, sms, case.hkv,
                              small_split_tokens=SMALL_SPLIT_TOKENS)
        engine = decode_config(case.d, case.hq // case.hkv, dtype, max_shared_mem=smem, device_name=name,
                               batch_size=bs, num_kv_heads=case.hkv, num_sms=sms)
        yield shape, bs, ctx, case, splits, engine
        del case
        torch.cuda.empty_cache()


def stages_ab() -> list:
    """``--stages-ab``: stage 1 + 2 (graph, KV rotated, the engine's split rule) with the config
    the engine picks (`decode_config` with the batch, KV heads and SMs) against the same config at
    2 stages, on `STAGES_AB_CASES` (bf16 KV). Question: the tp-4 tile sweep found 2 stages of
    128-key tiles 13-23% faster than the small-batch tile's 3 on one rank's 2 KV heads; for which
    head counts and batches does that hold?"""
    from dataclasses import replace

    from common import measure_ceilings

    ceil = measure_ceilings()
    copy_bps = ceil["copy_tbps"] * 1e12
    rows = []
    for shape, bs, ctx, case, splits, engine in _engine_cases(STAGES_AB_CASES):
        hq, d = case.hq, case.d
        row = {"shape": shape, "bs": bs, "context": list(ctx) if isinstance(ctx, tuple) else ctx,
               "mean_splits": float(splits.float().mean()),
               "engine_tile": [engine.block_n, engine.num_stages, engine.num_warps]}
        outs = {}
        for tag, cfg in (("engine", engine), ("stages2", replace(engine, num_stages=2))):
            o = torch.empty(bs, hq, d, device="cuda", dtype=torch.bfloat16)
            calls = case.calls(o, splits, cfg)
            calls[0]()
            torch.cuda.synchronize()
            outs[tag] = o.float().clone()
            us = bench_graph(calls)
            row[f"{tag}_us"] = us
            row[f"{tag}_share"] = case.kv_bytes / (us * 1e-6) / copy_bps
        row["max_abs_diff"] = float((outs["engine"] - outs["stages2"]).abs().max())
        row["speedup"] = row["engine_us"] / row["stages2_us"]
        rows.append(row)
        print(f"{shape:15s} bs={bs:3d} ctx={ctx}: engine {tuple(row['engine_tile'])} {row['engine_us']:7.1f} us "
              f"({row['engine_share']:.2f})  2 stages {row['stages2_us']:7.1f} us ({row['stages2_share']:.2f})  "
              f"x{row['speedup']:.2f}  splits {row['mean_splits']:.1f}", flush=True)
        del case
    return rows, ceil


def head_shape_sweep(kv_dtype: str = "bf16", block_h1: bool = False) -> list:
    """``--head-shapes``: on `HEAD_SHAPE_CASES` (a ``kv_dtype`` cache, a `DTYPES` key; the engine's
    split rule, graphs with the KV rotated), the engine's stage-1 config against every (block_n,
    stages, warps) of a grid, each with K's head read as main + remainder tiles and as one padded
    tile (``DecodeConfig.whole_dk``). Question: why Phi-3-mini's stage 1 (32 KV heads of 96) streams at
    0.69 of copy in a decode step at 96 x 800 where Mistral-7B's (8 of 128) reaches 0.85.

    ``block_h1`` (``--block-h1``; Phi-3's one query head per KV head): the grid instead runs the
    per-head kernel without ``tl.dot`` (``block_h`` 1: the products and sums on the CUDA cores, no
    16-row padding of one head; block_n 32 / 64 / 128, 2 / 4 stages, 2 / 4 warps) on
    `BLOCK_H1_CASES`, against the engine's config."""
    from dataclasses import replace

    from common import measure_ceilings

    ceil = measure_ceilings()
    copy_bps = ceil["copy_tbps"] * 1e12
    rows = []
    if block_h1:
        grid = list(itertools.product((32, 64, 128), (2, 4), (2, 4), (False, True)))
    else:
        grid = list(itertools.product((32, 64, 128), (2, 3, 4, 5), (4, 8), (False, True)))
    for shape, bs, ctx, case, splits, engine in _engine_cases(BLOCK_H1_CASES if block_h1 else HEAD_SHAPE_CASES,
                                                              DTYPES[kv_dtype]):
        hq, d = case.hq, case.d
        ref = None
        case_rows = []
        engine_tile = (engine.block_n, engine.num_stages, engine.num_warps, engine.whole_dk)
        for block_n, stages, warps, whole in [engine_tile] + grid:
            block_h = 1 if block_h1 and case_rows else engine.block_h  # the first row is the engine's own
            if any((r["block_n"], r["num_stages"], r["num_warps"], r["whole_dk"], r["block_h"])
                   == (block_n, stages, warps, whole, block_h) for r in case_rows):
                continue
            cfg = replace(engine, block_n=block_n, num_stages=stages, num_warps=warps, whole_dk=whole,
                          block_h=block_h)
            row = {"shape": shape, "bs": bs, "context": list(ctx) if isinstance(ctx, tuple) else ctx,
                   "kv_dtype": kv_dtype, "mean_splits": float(splits.float().mean()), "block_n": block_n,
                   "num_stages": stages, "block_h": block_h,
                   "num_warps": warps, "whole_dk": whole, "engine": not case_rows}
            o = torch.empty(bs, hq, d, device="cuda", dtype=torch.bfloat16)
            ref = _time_config(row, functools.partial(case.calls, o, splits, cfg), o, ref, case.kv_bytes, copy_bps,
                               "max_abs_diff_vs_engine")
            case_rows.append(row)
        ok = sorted((r for r in case_rows if "graph_us" in r), key=lambda r: r["graph_us"])
        eng = case_rows[0]
        print(f"{shape:11s} bs={bs:3d} ctx={ctx}: engine {engine.block_n}/{engine.num_stages}/{engine.num_warps} "
              f"{eng.get('graph_us', float('nan')):7.1f} us ({eng.get('share_of_copy_rate', 0):.2f}); best: " +
              "; ".join(f"{r['block_n']}/{r['num_stages']}/{r['num_warps']}{' whole' if r['whole_dk'] else ''} "
                        f"h{r['block_h']} {r['graph_us']:.1f} ({r['share_of_copy_rate']:.2f}, "
                        f"diff {r.get('max_abs_diff_vs_engine', 0):.2g})" for r in ok[:4]), flush=True)
        rows.extend(case_rows)
        del case
    return rows, ceil


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="the first two cases only")
    ap.add_argument("--tp-shards", action="store_true",
                    help="instead: split lengths for one rank's heads at tp 2 / tp 4 (tp_shard_sweep)")
    ap.add_argument("--tp-tiles", action="store_true", help="instead: the tile sweep on TP_TILE_CASES")
    ap.add_argument("--stages-ab", action="store_true", help="instead: the engine's tile vs 2 stages (stages_ab)")
    ap.add_argument("--head-shapes", action="store_true",
                    help="instead: tiles and whole / split K heads on Phi-3-mini's heads (head_shape_sweep)")
    ap.add_argument("--kv-dtype", default="bf16", choices=list(DTYPES), help="the KV cache of --head-shapes")
    ap.add_argument("--block-h1", action="store_true",
                    help="with --head-shapes: the per-head kernel without tl.dot (block_h 1) on BLOCK_H1_CASES")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_batch_sweep needs a CUDA GPU")
    import triton

    if args.tp_shards:
        rows, ceil = tp_shard_sweep()
    elif args.stages_ab:
        rows, ceil = stages_ab()
    elif args.head_shapes:
        rows, ceil = head_shape_sweep(args.kv_dtype, args.block_h1)
    else:
        rows, ceil = sweep(args.quick, cases=TP_TILE_CASES, waves_grid=(1, 2, 4, 8)) if args.tp_tiles \
            else sweep(args.quick)
    result = {"benchmark": "decode_batch_sweep", "date": dt.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "ceilings": ceil, "rows": rows}
    tag = ("decode-tp-shard-splits" if args.tp_shards else "decode-tp-tiles" if args.tp_tiles
           else "decode-stages-ab" if args.stages_ab
           else "decode-head-shapes" + ("" if args.kv_dtype == "bf16" else f"-{args.kv_dtype}")
           + ("-block-h1" if args.block_h1 else "") if args.head_shapes
           else "decode-batch-sweep")
    write_result(result, args.out, tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
