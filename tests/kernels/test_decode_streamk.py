"""Stream-K stage 1 of paged decode attention (`decode_streamk`) vs a float64 reference and
the split-K kernel (Triton interpreter on CPU, tiny shapes, 16-key tiles so that program
ranges cross several requests and long requests span several programs)."""

from __future__ import annotations

import pytest
import torch

from test_decode_attention import _reference

from attnserve.attention.triton_ops import decode_streamk as sk
from attnserve.attention.triton_ops.decode_attention import DecodeConfig, decode_attention_fwd
from attnserve.attention.triton_ops.decode_splits import compute_num_kv_splits
from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

CFG = DecodeConfig(block_n=16, block_h=16, num_warps=4, num_stages=2)
# ragged: empty, one key, not multiples of 16, one long request (10 tiles) among short ones
LENS = [0, 1, 17, 16, 150, 3, 33]


def _inputs(gen, paged, lens, hq, hkv, d, page_size, kv_dtype, k_scale, v_scale):
    r2t, rows, num_slots = paged(lens, page_size, gen)
    k_true = torch.randn(num_slots, hkv, d, generator=gen)
    v_true = torch.randn(num_slots, hkv, d, generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(torch.bfloat16)
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kb, vb = (k_true / k_scale).to(kv_dtype), (v_true / v_scale).to(kv_dtype)
        k_ref, v_ref = kb.double() * k_scale, vb.double() * v_scale  # what the cache holds
    else:
        kb, vb = k_true.to(kv_dtype), v_true.to(kv_dtype)
        k_ref, v_ref = kb, vb
    seq = torch.tensor(lens, dtype=torch.int32)
    indptr = compute_kv_indptr(seq)
    indices = torch.empty(int(sum(lens)) + 1, dtype=torch.int32)
    create_kv_indices(r2t, rows, seq, indptr, None, indices)
    return q, kb, vb, k_ref, v_ref, r2t, rows, seq, indptr, indices


def _decode(q, kb, vb, seq, indptr, indices, max_splits, logit_cap, scales, **kw):
    bs, hq, _ = q.shape
    dv = vb.shape[2]
    splits = torch.empty(bs, dtype=torch.int32)
    compute_num_kv_splits(seq, splits, max_splits, num_sms=4, num_kv_heads=kb.shape[1], min_split_tokens=16)
    o = torch.full((bs, hq, dv), float("nan"), dtype=q.dtype)
    logits = torch.full((bs, hq, max_splits, dv), float("nan"))
    lse = torch.full((bs, hq, max_splits), float("nan"))
    decode_attention_fwd(q, kb, vb, o, indptr, indices, logits, lse, splits, max_splits, q.shape[2] ** -0.5,
                         logit_cap, config=CFG, **scales, **kw)
    return o


@pytest.mark.parametrize("hq,hkv,page_size,kv_dtype,logit_cap,programs,max_splits", [
    (8, 2, 1, torch.bfloat16, 0.0, 5, 4),          # group 4; P = 8 units, request 4 over 2-3 programs
    (4, 4, 16, torch.bfloat16, 30.0, 3, 8),        # group 1 (MHA through the 16-row dot), capped logits
    (16, 2, 16, torch.float8_e4m3fn, 0.0, 7, 4),   # group 8, fp8 cache with per-tensor scales
    (8, 2, 1, torch.float8_e5m2, 20.0, 64, 2),     # 2 segments at most: P raised from 1 to 9 units
])
def test_streamk_matches_reference_and_split_k(hq, hkv, page_size, kv_dtype, logit_cap, programs, max_splits,
                                                gen, paged):
    d = 32
    fp8 = kv_dtype not in (torch.bfloat16,)
    scales = {"k_scale": 0.05, "v_scale": 0.3} if fp8 else {}
    q, kb, vb, k_ref, v_ref, r2t, rows, seq, indptr, indices = _inputs(
        gen, paged, LENS, hq, hkv, d, page_size, kv_dtype, scales.get("k_scale", 1.0), scales.get("v_scale", 1.0))
    out = _decode(q, kb, vb, seq, indptr, indices, max_splits, logit_cap, scales, streamk=True,
                  streamk_programs=programs)
    base = _decode(q, kb, vb, seq, indptr, indices, max_splits, logit_cap, scales, streamk=False)
    ref = _reference(q, k_ref, v_ref, r2t, rows, [0] * len(LENS), LENS, d ** -0.5, logit_cap)
    assert not torch.isnan(out).any(), "an output row was not written"
    assert torch.equal(out[0], torch.zeros_like(out[0])), "a request without keys must output zeros"
    # bf16 output rounding (2^-8 relative) of values |o| <= max|V| ~ 4: 2e-2 absolute and relative,
    # the split-K tests' bound; both kernels accumulate in float32 (interpreter: float32 dots).
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    # against split-K: each output is within one bf16 rounding of the other's (different split points)
    torch.testing.assert_close(out.float(), base.float(), atol=1.6e-2, rtol=1.6e-2)


def _py_plan(lens, block_n, head_programs, programs, max_splits):
    tiles = [-(-n // block_n) for n in lens]
    t_all = sum(tiles)
    per = max(-(-t_all * head_programs // programs), max(max(tiles) - 2, 0) // (max_splits - 1) + 1)
    return tiles, t_all, per


@pytest.mark.parametrize("programs,max_splits", [(5, 4), (64, 2), (1, 3)])
def test_streamk_plan_and_segment_bound(programs, max_splits):
    """The plan's tile table and (T, P) against a Python recount; every (request, head
    program) gets between 1 and max_kv_splits segments, and the grid covers every unit."""
    lens, block_n, hp = LENS, 16, 4
    seq = torch.tensor(lens, dtype=torch.int32)
    indptr = compute_kv_indptr(seq)
    cap = sk.streamk_tile_capacity(torch.empty(int(sum(lens))), len(lens), block_n)
    plan = sk.plan_streamk_decode(indptr, len(lens), cap, block_n, hp, programs, max_splits)
    tiles, t_all, per = _py_plan(lens, block_n, hp, programs, max_splits)
    assert plan.meta.tolist() == [t_all, per]
    off = [sum(tiles[:i]) for i in range(len(lens))]
    assert plan.tile_off.tolist() == off
    req = [b for b, n in enumerate(tiles) for _ in range(n)]
    t_in = [t for n in tiles for t in range(n)]
    assert plan.tiles[0, :t_all].tolist() == req and plan.tiles[3, :t_all].tolist() == t_in
    assert plan.tiles[1, :t_all].tolist() == [int(indptr[b]) + t * block_n for b, t in zip(req, t_in)]
    assert plan.tiles[2, :t_all].tolist() == [int(indptr[b + 1]) for b in req]
    assert programs * per >= hp * t_all
    for h in range(hp):
        for b, n in enumerate(tiles):
            if n:
                u0 = h * t_all + off[b]
                assert 1 <= (u0 + n - 1) // per - u0 // per + 1 <= max_splits


def test_streamk_selection(monkeypatch, gen, paged):
    """``ATTNSERVE_DECODE_STREAMK=1`` routes batches of >= num_sms (4 off CUDA) head programs
    to stream-K; smaller batches, batch-invariant mode and ``streamk=False`` stay split-K."""
    calls = []
    real = sk.launch_streamk
    monkeypatch.setattr(sk, "launch_streamk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, kb, vb, _, _, _, _, seq, indptr, indices = _inputs(gen, paged, [5, 20], 4, 2, 16, 1, torch.bfloat16, 1, 1)
    monkeypatch.setenv(sk.STREAMK_ENV, "1")
    _decode(q, kb, vb, seq, indptr, indices, 4, 0.0, {})  # 2 requests x 2 head programs = 4 SMs
    assert len(calls) == 1
    _decode(q[:1], kb, vb, seq[:1], indptr[:2], indices, 4, 0.0, {})  # 2 head programs < 4 SMs
    _decode(q, kb, vb, seq, indptr, indices, 4, 0.0, {}, batch_invariant=True)
    _decode(q, kb, vb, seq, indptr, indices, 4, 0.0, {}, streamk=False)
    assert len(calls) == 1
    monkeypatch.setenv(sk.STREAMK_ENV, "0")
    _decode(q, kb, vb, seq, indptr, indices, 4, 0.0, {})
    assert len(calls) == 1


def test_streamk_reuses_a_step_plan_and_rejects_a_foreign_one(gen, paged):
    """A plan made once for the step gives the same output as planning per call; a plan for
    another tile size raises."""
    lens = [40, 3, 70]
    q, kb, vb, _, _, _, _, seq, indptr, indices = _inputs(gen, paged, lens, 8, 2, 16, 1, torch.bfloat16, 1, 1)
    cap = sk.streamk_tile_capacity(indices, len(lens), 16)
    plan = sk.plan_streamk_decode(indptr, len(lens), cap, 16, 2, 3, 4)
    a = _decode(q, kb, vb, seq, indptr, indices, 4, 0.0, {}, streamk=True, streamk_plan=plan)
    b = _decode(q, kb, vb, seq, indptr, indices, 4, 0.0, {}, streamk=True, streamk_programs=3)
    assert torch.equal(a, b)
    bad = sk.plan_streamk_decode(indptr, len(lens), cap * 2, 8, 2, 3, 4)
    with pytest.raises(ValueError, match="plan made for"):
        _decode(q, kb, vb, seq, indptr, indices, 4, 0.0, {}, streamk=True, streamk_plan=bad)
