"""The stream-K decode stage 1 (`decode_streamk`) on a GPU at H100 batch shapes, against the
split-K kernel and float64, and inside a CUDA graph replayed at new lengths.

``pytest tests/gpu/test_decode_streamk_gpu.py``. Every test is marked ``cuda`` and skipped
without a GPU. Tolerances: outputs are bf16 (relative rounding 2^-8) of values bounded by
max|V| (~4.5 for these randn caches), both kernels accumulate in float32 and differ only in
where the keys are split, so each is within 2e-2 (absolute and relative, the bound of
``test_decode_small_batch_gpu.py``) of float64 and of each other.
"""

from __future__ import annotations

import pytest
import torch

from test_decode_small_batch_gpu import _paged_slots, _reference

from attnserve.attention.triton_ops import decode_streamk as sk
from attnserve.attention.triton_ops.decode_attention import _head_blocks, decode_attention_fwd, decode_config
from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS, compute_num_kv_splits
from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"
HQ, HKV, D = 32, 8, 128
MAX_SPLITS = 32
TOL = 2e-2
K_SCALE, V_SCALE = 0.05, 0.3


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _inputs(lens, kv_dtype, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    slots, num_slots = _paged_slots(lens, page_size, gen)
    k_true = torch.randn(num_slots, HKV, D, generator=gen)
    v_true = torch.randn(num_slots, HKV, D, generator=gen)
    if kv_dtype == torch.bfloat16:
        kb, vb, ks, vs = k_true.to(kv_dtype), v_true.to(kv_dtype), 1.0, 1.0
    else:
        kb, vb, ks, vs = (k_true / K_SCALE).to(kv_dtype), (v_true / V_SCALE).to(kv_dtype), K_SCALE, V_SCALE
    q = torch.randn(len(lens), HQ, D, generator=gen).to(DEV, torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    indices = torch.cat([s for s in slots] + [torch.zeros(1, dtype=torch.int64)]).to(DEV, torch.int32)
    return q, kb.to(DEV), vb.to(DEV), ks, vs, seq, compute_kv_indptr(seq), indices, slots


def _run(q, kb, vb, seq, indptr, indices, scales, **kw):
    bs = q.shape[0]
    splits = torch.empty(bs, dtype=torch.int32, device=DEV)
    compute_num_kv_splits(seq, splits, MAX_SPLITS, _sms(), HKV, small_split_tokens=SMALL_SPLIT_TOKENS)
    o = torch.full((bs, HQ, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    logits = torch.full((bs, HQ, MAX_SPLITS, D), float("nan"), device=DEV)
    lse = torch.full((bs, HQ, MAX_SPLITS), float("nan"), device=DEV)
    decode_attention_fwd(q, kb, vb, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5, **scales, **kw)
    return o


def _lens(bs, ctx, seed):
    if isinstance(ctx, tuple):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(ctx[0], ctx[1] + 1, (bs,), generator=g).tolist()
    return [ctx] * bs


@pytest.mark.parametrize("bs,ctx,kv_dtype,page_size,pps", [
    (64, 640, torch.bfloat16, 1, 2),
    (144, 800, torch.bfloat16, 16, 1),
    (256, (200, 1800), torch.bfloat16, 1, 2),
    (144, 800, torch.float8_e4m3fn, 1, 2),
    (64, (1, 3000), torch.float8_e4m3fn, 16, 1),
], ids=["bf16-64x640", "bf16-144x800-p16", "bf16-256-ragged", "e4m3-144x800", "e4m3-64-ragged-p16"])
def test_streamk_matches_split_k_and_float64(bs, ctx, kv_dtype, page_size, pps):
    lens = _lens(bs, ctx, bs)
    q, kb, vb, ks, vs, seq, indptr, indices, slots = _inputs(lens, kv_dtype, page_size, seed=bs + page_size)
    scales = {"k_scale": ks, "v_scale": vs}
    out = _run(q, kb, vb, seq, indptr, indices, scales, streamk=True,
               streamk_programs=sk.streamk_num_programs(_sms(), pps))
    base = _run(q, kb, vb, seq, indptr, indices, scales, streamk=False)
    ref = _reference(q, kb, vb, slots, ks, vs)
    assert not torch.isnan(out).any(), "an output row was not written"
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(out.float(), base.float(), atol=TOL, rtol=TOL)


def test_streamk_env_rule_falls_back_on_small_batches(monkeypatch):
    """With ``ATTNSERVE_DECODE_STREAMK=1``, 8 x 4096 (64 head programs < the SMs) runs split-K
    (bitwise the default), 64 x 640 runs stream-K (close to it)."""
    monkeypatch.setenv(sk.STREAMK_ENV, "1")
    for bs, ctx, expect_same in ((8, 4096, True), (64, 640, False)):
        q, kb, vb, ks, vs, seq, indptr, indices, _ = _inputs([ctx] * bs, torch.bfloat16, 1, seed=7)
        env = _run(q, kb, vb, seq, indptr, indices, {})
        base = _run(q, kb, vb, seq, indptr, indices, {}, streamk=False)
        if expect_same:
            assert torch.equal(env, base)
        else:
            torch.testing.assert_close(env.float(), base.float(), atol=TOL, rtol=TOL)


def test_streamk_in_a_cuda_graph_at_new_lengths():
    """Plan + stream-K captured once for 96 requests, replayed after the step's lengths and
    indices change (fixed buffers, as the backend's graph runner holds them): each replay
    matches eager split-K on that step's inputs."""
    bs, cap_tokens = 96, 96 * 1400 + 1
    dtype = torch.bfloat16
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
    indices = torch.zeros(cap_tokens, dtype=torch.int32, device=DEV)
    q_buf = torch.zeros(bs, HQ, D, dtype=dtype, device=DEV)
    o = torch.zeros(bs, HQ, D, dtype=dtype, device=DEV)
    logits = torch.zeros(bs, HQ, MAX_SPLITS, D, device=DEV)
    lse = torch.zeros(bs, HQ, MAX_SPLITS, device=DEV)
    splits = torch.ones(bs, dtype=torch.int32, device=DEV)
    smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    base = decode_config(D, HQ // HKV, dtype, max_shared_mem=smem, device_name=torch.cuda.get_device_name(),
                         batch_size=bs, num_kv_heads=HKV, num_sms=_sms())
    cfg = sk.streamk_config(dtype, base)
    hp = HKV * _head_blocks(max(16, cfg.block_h), HQ // HKV)
    g = sk.streamk_num_programs(_sms())
    cap = sk.streamk_tile_capacity(indices, bs, cfg.block_n)
    steps = [_lens(bs, (1, 1400), s) for s in (1, 2, 3)]
    num_slots = max(sum(lens) for lens in steps) + 2
    gen = torch.Generator().manual_seed(5)
    kb = torch.randn(num_slots, HKV, D, generator=gen).to(DEV, dtype)
    vb = torch.randn(num_slots, HKV, D, generator=gen).to(DEV, dtype)
    plan = sk.plan_streamk_decode(indptr, bs, cap, cfg.block_n, hp, g, MAX_SPLITS)

    def step():
        sk.plan_streamk_decode(indptr, bs, cap, cfg.block_n, hp, g, MAX_SPLITS, out=plan)
        decode_attention_fwd(q_buf, kb, vb, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5,
                             streamk=True, config=cfg, streamk_plan=plan, streamk_programs=g)

    def load(lens, seed):
        gen = torch.Generator().manual_seed(seed)
        seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
        indptr.copy_(compute_kv_indptr(seq))
        perm = torch.randperm(num_slots - 1, generator=gen)[: sum(lens)] + 1
        indices[: sum(lens)].copy_(perm.to(DEV, torch.int32))
        q_buf.copy_(torch.randn(bs, HQ, D, generator=gen).to(DEV, dtype))
        return seq

    load(steps[0], 0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i, lens in enumerate(steps):
        seq = load(lens, 10 + i)
        graph.replay()
        torch.cuda.synchronize()
        ref = _run(q_buf, kb, vb, seq, indptr, indices[: sum(lens) + 1], {}, streamk=False)
        torch.testing.assert_close(o.float(), ref.float(), atol=TOL, rtol=TOL)
