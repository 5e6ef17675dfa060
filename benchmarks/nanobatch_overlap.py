"""Can a decode step overlap its memory-bound attention with its compute-bound GEMMs?

``PYTHONPATH=src python benchmarks/nanobatch_overlap.py [--out DIR] [--layers L] [--cases ...]``

At the batches a mixed workload decodes (100-500 requests of ~1,000 keys, Llama-3-8B shape
on an H200) the GEMMs sit at the ridge (2·P·B FLOPs at the matmul rate ~ the weights' bytes
at the copy rate) and attention streams KV at ~0.9 of the copy rate, one after the other. The
roofline of `attnserve.bench.roofline` takes the *max* of a step's memory and compute times,
the serial floor their *sum*; the mixed rows sit near the serial floor. NanoFlow
(arXiv:2408.12757) splits a batch into nano-batches and runs one nano-batch's attention while
another's GEMMs run, on the same GPU.

This benchmark measures whether that pays here, before any engine change, on a stack of
``L`` decoder layers of the model's shapes (own weights and KV per layer, so the L2 never
holds them; no norms or RoPE: they are the same in every mode):

* ``serial``: the whole batch, per layer ``qkv -> attention -> o -> gate_up -> act -> down``;
* ``halves``: the same for two half batches one after the other (what splitting costs: the
  weights are read twice);
* ``overlap``: the two halves on two streams in lockstep phases: while half A runs layer
  ``l``'s attention, half B runs its GEMMs (``o``/MLP of ``l - 1`` and ``qkv`` of ``l``), and
  the other way round in the next phase; events join the streams at each phase;
* ``free``: the two halves on two streams with no phase barriers (the hardware interleaves).

Each mode is captured in one CUDA graph (launch cost removed, as in the engine's decode
step) and timed per layer; the GEMMs are ``torch.mm`` (cuBLAS, what the engine runs at these
batches on an H200) and attention the engine's Triton decode kernel with the engine's split
rule. Also reported: the attention and the GEMMs of one layer alone, the step's roofline
(max of bytes at the copy rate and FLOPs at the matmul rate) and its serial floor (their sum),
both from rates measured in the same run. Writes ``<out>/<device>-nanobatch-overlap-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from attnserve.bench.results import cuda_run_metadata, write_result
from common import bench_graph, measure_ceilings

#: hidden, intermediate, Hq, Hkv, head dim
SHAPES = {"llama-3-8b": (4096, 14336, 32, 8, 128), "qwen3-0.6b": (1024, 3072, 16, 8, 128)}
#: (shape, batch, context or (lo, hi))
CASES = [("llama-3-8b", 146, 1000), ("llama-3-8b", 256, (200, 1800)), ("llama-3-8b", 486, 1000),
         ("qwen3-0.6b", 176, 992)]


class _Layer:
    """One decoder layer's weights and paged KV for ``bs`` requests."""

    def __init__(self, shape, lens, gen):
        h, inter, hq, hkv, d = SHAPES[shape]
        dev, bf = "cuda", torch.bfloat16
        self.hq, self.hkv, self.d = hq, hkv, d
        scale = h ** -0.5

        def w(n, k):
            return (torch.randn(n, k, device=dev, dtype=bf) * scale)

        self.w_qkv, self.w_o = w((hq + 2 * hkv) * d, h), w(h, hq * d)
        self.w_gu, self.w_down = w(2 * inter, h), w(h, inter)
        total = int(lens.sum())
        perm = torch.randperm(total, device=dev).to(torch.int32) + 1
        self.k = torch.randn(total + 1, hkv, d, device=dev, dtype=bf)
        self.v = torch.randn(total + 1, hkv, d, device=dev, dtype=bf)
        self.indices = perm  # every request's keys scattered over the pool, as after a long run

    def weight_bytes(self) -> int:
        return 2 * sum(t.numel() for t in (self.w_qkv, self.w_o, self.w_gu, self.w_down))


class _Half:
    """A nano-batch: rows ``[r0, r1)`` of the batch, its KV index slice and scratch."""

    def __init__(self, layers, lens, r0, r1, num_sms, max_splits=16):
        from attnserve.attention.triton_ops.decode_splits import compute_num_kv_splits
        from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr

        l0 = layers[0]
        dev = "cuda"
        n = r1 - r0
        full_ptr = compute_kv_indptr(lens)
        a, b = int(full_ptr[r0]), int(full_ptr[r1])
        self.indptr = (full_ptr[r0:r1 + 1] - a).contiguous()
        self.slices = [lay.indices[a:b] for lay in layers]
        self.splits = torch.empty(n, dtype=torch.int32, device=dev)
        compute_num_kv_splits(lens[r0:r1].contiguous(), self.splits, max_splits, num_sms, l0.hkv)
        self.max_splits = max_splits
        self.logits = torch.empty(n, l0.hq, max_splits, l0.d, device=dev)
        self.lse = torch.empty(n, l0.hq, max_splits, device=dev)
        h = l0.w_o.shape[0]
        self.x = torch.randn(n, h, device=dev, dtype=torch.bfloat16) * 0.1
        self.qkv = torch.empty(n, l0.w_qkv.shape[0], device=dev, dtype=torch.bfloat16)
        self.attn = torch.empty(n, l0.hq, l0.d, device=dev, dtype=torch.bfloat16)
        self.gu = torch.empty(n, l0.w_gu.shape[0], device=dev, dtype=torch.bfloat16)
        self.y = torch.empty(n, h, device=dev, dtype=torch.bfloat16)

    def attention(self, lay, i):
        from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd

        q = self.qkv[:, : lay.hq * lay.d].view(-1, lay.hq, lay.d)
        decode_attention_fwd(q, lay.k, lay.v, self.attn, self.indptr, self.slices[i], self.logits, self.lse,
                             self.splits, self.max_splits, lay.d ** -0.5)

    def qkv_gemm(self, lay):
        torch.mm(self.x, lay.w_qkv.t(), out=self.qkv)

    def post_gemms(self, lay):
        """``o`` projection and the MLP: ``x <- down(act(gate_up(o(attn))))`` (no residual)."""
        torch.mm(self.attn.view(self.attn.shape[0], -1), lay.w_o.t(), out=self.y)
        torch.mm(self.y, lay.w_gu.t(), out=self.gu)
        inter = self.gu.shape[1] // 2
        act = torch.nn.functional.silu(self.gu[:, :inter]) * self.gu[:, inter:]
        torch.mm(act, lay.w_down.t(), out=self.x)


def _serial(halves, layers):
    for hb in halves:
        for i, lay in enumerate(layers):
            hb.qkv_gemm(lay)
            hb.attention(lay, i)
            hb.post_gemms(lay)


def _overlap(halves, layers, lockstep: bool):
    """Half A on the current stream, half B on a side stream, half a layer behind."""
    a, b = halves
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    # phases: A: G(0) | A(0) G(1) A(1) ... ; B runs G while A runs attention and vice versa
    side.wait_stream(main)
    a_ops = []
    b_ops = []
    for i, lay in enumerate(layers):
        a_ops += [functools.partial(a.qkv_gemm, lay), functools.partial(a.attention, lay, i),
                  functools.partial(a.post_gemms, lay)]
        b_ops += [functools.partial(b.qkv_gemm, lay), functools.partial(b.attention, lay, i),
                  functools.partial(b.post_gemms, lay)]
    # group into phases: A's [qkv(0)], then alternate attention / GEMM groups
    def groups(ops):
        out = [[ops[0]]]
        rest = ops[1:]
        while rest:
            out.append([rest[0]])  # attention
            out.append(rest[1:3])  # post GEMMs of this layer + qkv of the next (or the last post)
            rest = rest[3:]
        return out

    ga, gb = groups(a_ops), groups(b_ops)
    # B starts one phase late: phase p runs ga[p] on main and gb[p - 1] on side
    for p in range(len(ga) + 1):
        if p < len(ga):
            for f in ga[p]:
                f()
        if p >= 1:
            with torch.cuda.stream(side):
                for f in gb[p - 1]:
                    f()
        if lockstep:
            ev_a, ev_b = torch.cuda.Event(), torch.cuda.Event()
            ev_a.record(main)
            ev_b.record(side)
            main.wait_event(ev_b)
            side.wait_event(ev_a)
    main.wait_stream(side)


def run_case(shape, bs, ctx, n_layers, rates, gen):
    dev = "cuda"
    if isinstance(ctx, tuple):
        lens = torch.randint(ctx[0], ctx[1] + 1, (bs,), generator=gen, dtype=torch.int32)
    else:
        lens = torch.full((bs,), ctx, dtype=torch.int32)
    lens = lens.to(dev)
    layers = [_Layer(shape, lens, gen) for _ in range(n_layers)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    full = [_Half(layers, lens, 0, bs, sms)]
    mid = bs // 2
    halves = [_Half(layers, lens, 0, mid, sms), _Half(layers, lens, mid, bs, sms)]
    row = {"model": shape, "batch": bs, "context": ctx if isinstance(ctx, int) else list(ctx), "layers": n_layers}
    modes = {
        "serial": lambda: _serial(full, layers),
        "halves": lambda: _serial(halves, layers),
        "overlap": lambda: _overlap(halves, layers, lockstep=True),
        "free": lambda: _overlap(halves, layers, lockstep=False),
        "attention_only": lambda: [full[0].attention(lay, i) for i, lay in enumerate(layers)],
        "gemms_only": lambda: [(full[0].qkv_gemm(lay), full[0].post_gemms(lay)) for lay in layers],
    }
    for name, fn in modes.items():
        row[f"{name}_us_per_layer"] = bench_graph([fn], min_calls=2, replays=10) / n_layers
    # check the overlapped halves compute what the serial halves do
    _serial(halves, layers)
    ref = [hb.x.clone() for hb in halves]
    for hb, r in zip(halves, ref):
        hb.x.copy_(r)
    _serial(halves, layers)
    serial_out = [hb.x.float().clone() for hb in halves]
    for hb, r in zip(halves, ref):
        hb.x.copy_(r)
    _overlap(halves, layers, lockstep=True)
    torch.cuda.synchronize()
    row["overlap_max_abs_diff"] = max(float((hb.x.float() - s).abs().max()) for hb, s in zip(halves, serial_out))
    h, inter, hq, hkv, d = SHAPES[shape]
    lay = layers[0]
    kv_bytes = int(lens.sum()) * hkv * d * 2 * 2
    w_bytes = lay.weight_bytes()
    flops = 2 * (w_bytes // 2) * bs + 4 * hq * d * int(lens.sum())
    mem_us = (w_bytes + kv_bytes) / rates["copy_tbps"] / 1e6
    gemm_mem_us, attn_mem_us = w_bytes / rates["copy_tbps"] / 1e6, kv_bytes / rates["copy_tbps"] / 1e6
    gemm_flop_us = 2 * (w_bytes // 2) * bs / rates["matmul_bf16_tflops"] / 1e6
    row.update(roofline_us_per_layer=max(mem_us, flops / rates["matmul_bf16_tflops"] / 1e6),
               serial_floor_us_per_layer=max(gemm_mem_us, gemm_flop_us) + attn_mem_us,
               gemm_floor_us=max(gemm_mem_us, gemm_flop_us), attention_floor_us=attn_mem_us)
    for name in ("serial", "overlap", "free"):
        row[f"{name}_share"] = row["roofline_us_per_layer"] / row[f"{name}_us_per_layer"]
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    t0 = time.perf_counter()
    rates = measure_ceilings()
    print(rates, flush=True)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for s, bs, ctx in CASES:
        rows.append(run_case(s, bs, ctx, args.layers, rates, gen))
        torch.cuda.empty_cache()
    result = cuda_run_metadata("nanobatch-overlap", t0)
    result.update(rates=rates, rows=rows)
    write_result(result, args.out, "nanobatch-overlap" + args.tag)


if __name__ == "__main__":
    main()
