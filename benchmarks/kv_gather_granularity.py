"""Gathered KV reads by row size: is fp8 decode's 0.77-0.79 of the copy rate a DRAM granularity limit?

``PYTHONPATH=src python benchmarks/kv_gather_granularity.py [--out DIR] [--tokens 110000]``

Why (benchmarks/NOTES.md, session 2026-11-27 seventh): at the batch tiles the fp8-KV decode
stage 1 streams at 0.77-0.79 of the device-to-device copy rate where bf16 reaches 0.92, and
neither two K/V buffers nor a third program per SM closed it. One difference left is the
access pattern: a stage-1 program reads, per key, one KV head's row of the paged cache
``[slots, Hkv, D]``: 128 B for e4m3 at D 128, at a stride of ``Hkv * 128`` B, against
256 B rows for bf16. Hypothesis: scattered 128-byte rows stream slower than 256-byte rows.

The kernel here does nothing but that read: program ``(head, request-block)`` walks
``BLOCK_N`` slots at a time through an index array (``kv_indices``, as stage 1 does),
loads ``[BLOCK_N, ROW]`` bytes of K and of V per step, and keeps a running XOR so the loads
are not dropped; one int32 per program is written. Cases, each timed in a CUDA graph
(`common.bench_graph`) and reported as GB/s of K+V bytes and share of the copy rate
measured in the same run:

* ``row128-h8``: 128 B rows, 8 heads per slot (e4m3, Llama-3-8B KV heads, D 128);
* ``row256-h8``: 256 B rows, 8 heads (bf16);
* ``row256-h4``: 256 B rows made of two fp8 heads read together (a program per pair of KV
  heads: what a two-head fp8 stage 1 would read);
* ``row512-h4``: 512 B rows, two bf16 heads read together (the same question for bf16);
* ``row128-h8-seq``: 128 B rows with the slots in order (a fresh request's slots are usually
  consecutive) instead of shuffled whole requests.

Slots are laid out as `decode_fp8_variants.py` does (whole requests of ``--context`` keys at
shuffled positions), ``--tokens`` slots in all (~110,000: 144 requests x 800 keys, the
decode-tile benchmark's batch case). Prediction if the hypothesis holds: row128 < 0.85 of
copy and row256 >= 0.9. Not yet run on a GPU (written 2026-11-27 after the device budget
was spent).
"""

from __future__ import annotations

import argparse
import datetime as dt

import torch
import triton
import triton.language as tl

from attnserve.bench.results import write_result
from common import bench_graph, copy_bandwidth_gbs


@triton.jit
def _gather_rows_kernel(k_ptr, v_ptr, kv_indices, out_ptr, n_slots, slot_words, head_words,
                        ROW_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, PROGRAMS_PER_HEAD: tl.constexpr):
    """Program ``(h, p)``: slots ``p * BLOCK_N, (p + G) * BLOCK_N, ...`` (``G`` =
    PROGRAMS_PER_HEAD) of head ``h``; int32 words, so a 128 B row is 32 words."""
    h = tl.program_id(0)
    p = tl.program_id(1)
    cols = tl.arange(0, ROW_WORDS)
    acc = tl.zeros([BLOCK_N, ROW_WORDS], tl.int32)
    for start in range(p * BLOCK_N, n_slots, PROGRAMS_PER_HEAD * BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        mask = offs < n_slots
        slot = tl.load(kv_indices + offs, mask=mask, other=0).to(tl.int64)
        base = slot * slot_words + h * head_words
        k = tl.load(k_ptr + base[:, None] + cols[None, :], mask=mask[:, None], other=0)
        v = tl.load(v_ptr + base[:, None] + cols[None, :], mask=mask[:, None], other=0)
        acc ^= k ^ v
    tl.store(out_ptr + h * PROGRAMS_PER_HEAD + p, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


def _slots(tokens: int, context: int, total_slots: int, shuffled: bool, gen: torch.Generator) -> torch.Tensor:
    """``tokens`` slot ids: whole requests of ``context`` consecutive slots, the requests at
    shuffled positions of a pool of ``total_slots`` (or in order)."""
    n_req = max(1, tokens // context)
    starts = torch.randperm(total_slots // context, generator=gen)[:n_req] * context if shuffled else \
        torch.arange(n_req) * context
    return (starts[:, None] + torch.arange(context)[None, :]).reshape(-1).to(torch.int32)


def run_case(name: str, row_bytes: int, heads: int, slots: torch.Tensor, total_slots: int, sms: int,
             block_n: int = 128) -> dict:
    """One case: a ``[total_slots, heads, row_bytes]`` K and V pool, all ``heads`` read."""
    words = row_bytes // 4
    k = torch.randint(-2**31, 2**31 - 1, (total_slots, heads, words), dtype=torch.int32, device="cuda")
    v = torch.randint_like(k, -2**31, 2**31 - 1)
    idx = slots.cuda()
    n = idx.numel()
    per_head = max(1, (3 * sms) // heads)  # ~3 programs per SM, as the batch tiles run
    out = torch.empty(heads * per_head, dtype=torch.int32, device="cuda")

    def call():
        _gather_rows_kernel[(heads, per_head)](k, v, idx, out, n, heads * words, words, ROW_WORDS=words,
                                               BLOCK_N=block_n, PROGRAMS_PER_HEAD=per_head, num_warps=4,
                                               num_stages=4)

    us = bench_graph([call])
    moved = 2 * n * heads * row_bytes
    return {"case": name, "row_bytes": row_bytes, "heads": heads, "slots": n, "programs": heads * per_head,
            "us": us, "gbs": moved / us / 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, default=115200, help="slots read per head (144 x 800)")
    ap.add_argument("--context", type=int, default=800, help="keys per request (consecutive slots)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv_gather_granularity needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    total = 2 * args.tokens
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth_gbs()
    shuffled = _slots(args.tokens, args.context, total, True, gen)
    in_order = _slots(args.tokens, args.context, total, False, gen)
    rows = [run_case("row128-h8", 128, 8, shuffled, total, sms), run_case("row256-h8", 256, 8, shuffled, total, sms),
            run_case("row256-h4", 256, 4, shuffled, total, sms), run_case("row512-h4", 512, 4, shuffled, total, sms),
            run_case("row128-h8-seq", 128, 8, in_order, total, sms)]
    name = torch.cuda.get_device_name()
    print(f"{name}: copy {copy:.0f} GB/s")
    for r in rows:
        r["share_of_copy"] = r["gbs"] / copy
        print(f"{r['case']:<15} {r['us']:8.1f} us {r['gbs']:7.0f} GB/s {r['share_of_copy']:.3f} of copy")
    write_result({"benchmark": "kv_gather_granularity", "date": dt.date.today().isoformat(), "device": name,
                  "torch": torch.__version__, "triton": triton.__version__, "copy_gbs": copy, "rows": rows},
                 args.out, "kv-gather-granularity")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
