"""The Gluon fp8 (e4m3) decode stage 1 (`decode_fp8_gluon`, ``ATTNSERVE_DECODE_FP8_GLUON=1``) on a GPU.

``PYTHONPATH=src:tests pytest -x -q tests/gpu/test_decode_fp8_gluon_gpu.py``. Every test is
marked ``cuda`` and skipped without a GPU; the Gluon tests also need compute capability 9.x
(Hopper) and Triton with Gluon (>= 3.6).

Each case runs the full decode (stage 1 + the unchanged stage 2) through
`decode_attention_fwd` with the switch on (asserting that the call is routed to the Gluon
kernel) and off (the Triton fp8 path), with the same split counts, and compares both with
float64 attention over the dequantised cache. Two configurations of the kernel are also
launched directly (`gluon_fp8_decode_stage1`).

Tolerance (``ATOL = RTOL = 1e-2``, on ``|out - ref| <= ATOL + RTOL |ref|``): the scores are
exact up to float32 summation (bf16 -> fp16 query conversion is exact for |q| >= 6e-5, the
dequantised e4m3 values are exact in fp16, f16 x f16 products are exact in float32), P is
rounded to fp16 (relative 2^-11 per weight) and the output to bf16 (relative 2^-9, half an
ulp): ~2.5e-3 relative in all, so 1e-2 leaves a 4x margin and still catches a wrong key, a
dropped tile or a wrong scale (errors of the order of the output, ~0.1-1). Gluon against
Triton: each rounds its bf16 output once (together one ulp, 2^-8 relative) plus float32
summation-order differences, inside the same bounds.
"""

from __future__ import annotations

import pytest
import torch

from attnserve.attention.triton_ops.decode_attention import _fp8_gluon_route, decode_attention_fwd
from attnserve.attention.triton_ops.decode_fp8_gluon import (FP8_GLUON_ENV, GluonFp8DecodeConfig,
                                                             gluon_fp8_decode_stage1)
from attnserve.attention.triton_ops.decode_merge import decode_stage2
from attnserve.attention.triton_ops.decode_splits import compute_num_kv_splits

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 9
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _HOPPER, reason="needs a Hopper (sm_90) GPU"),
]
DEV = "cuda"
HQ, D = 32, 128
MAX_SPLITS = 32
K_SCALE, V_SCALE = 0.05, 0.3
ATOL = RTOL = 1e-2


def _lens(name):
    g = torch.Generator().manual_seed(len(name))
    return {
        "64x[128,4096]": torch.randint(128, 4097, (64,), generator=g).tolist(),
        "144x800": [800] * 144,
        "1x8192": [8192],
        "3x[1,127,129]": [1, 127, 129],
        "ragged 1..5000": torch.randint(1, 5001, (24,), generator=g).tolist(),
    }[name]


def _inputs(lens, hkv, seed, v_scale=V_SCALE):
    """q (bf16), e4m3 K/V buffers holding ``randn / scale`` (slot 0 unused, requests at
    shuffled slots) and the CSR indices (int32)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = sum(lens)
    k = (torch.randn(total + 1, hkv, D, device=DEV, generator=g) / K_SCALE).clamp(-448, 448)
    v = (torch.randn(total + 1, hkv, D, device=DEV, generator=g) / v_scale).clamp(-448, 448)
    q = torch.randn(len(lens), HQ, D, device=DEV, generator=g).to(torch.bfloat16)
    indices = (torch.randperm(total, device=DEV, generator=g) + 1).to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV)
    indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32, device=DEV), 0)
    return q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), indptr, indices


def _engine_splits(lens, hkv):
    """The split counts the triton backend computes (small-batch rule on)."""
    out = torch.empty(len(lens), dtype=torch.int32, device=DEV)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    compute_num_kv_splits(torch.tensor(lens, dtype=torch.int32, device=DEV), out, MAX_SPLITS, sms, hkv,
                          small_split_tokens=128)
    return out


def _reference(q, k, v, indptr, indices, v_scale=V_SCALE):
    """float64 softmax(q K^T / sqrt(D)) V over the dequantised cache, per request (zeros for
    an empty request)."""
    hkv = k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=DEV)
    for b in range(q.shape[0]):
        rows = indices[int(indptr[b]):int(indptr[b + 1])].long()
        if rows.numel() == 0:
            continue
        kb = k[rows].double().repeat_interleave(HQ // hkv, dim=1) * K_SCALE
        vb = v[rows].double().repeat_interleave(HQ // hkv, dim=1) * v_scale
        s = torch.einsum("hd,nhd->hn", q[b].double(), kb) * D ** -0.5
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vb)
    return out


def _scratch(bs):
    o = torch.full((bs, HQ, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    logits = torch.full((bs, HQ, MAX_SPLITS, D), float("nan"), device=DEV)
    lse = torch.full((bs, HQ, MAX_SPLITS), float("nan"), device=DEV)
    return o, logits, lse


def _decode(q, k, v, indptr, indices, splits, gluon, monkeypatch, v_scale=V_SCALE):
    """Full decode through `decode_attention_fwd`, the Gluon switch on or off."""
    if gluon:
        monkeypatch.setenv(FP8_GLUON_ENV, "1")
        assert _fp8_gluon_route(q, k, v, indptr, indices, splits, 0.0, False), "not routed to the Gluon kernel"
    else:
        monkeypatch.delenv(FP8_GLUON_ENV, raising=False)
    o, logits, lse = _scratch(q.shape[0])
    decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5,
                         k_scale=K_SCALE, v_scale=v_scale)
    return o


def _check(out, ref):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("hkv", [32, 8, 4], ids=["group1", "group4", "group8"])
@pytest.mark.parametrize("case", ["64x[128,4096]", "144x800", "1x8192", "3x[1,127,129]", "ragged 1..5000"])
def test_gluon_matches_float64_and_triton(case, hkv, monkeypatch):
    """Engine split counts (several splits for long requests, one for short ones)."""
    lens = _lens(case)
    q, k, v, indptr, indices = _inputs(lens, hkv, seed=hkv + len(lens))
    splits = _engine_splits(lens, hkv)
    ref = _reference(q, k, v, indptr, indices)
    out = _decode(q, k, v, indptr, indices, splits, True, monkeypatch)
    _check(out, ref)
    tri = _decode(q, k, v, indptr, indices, splits, False, monkeypatch)
    torch.testing.assert_close(out.float(), tri.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mode", ["one split", "random splits"])
def test_gluon_forced_split_counts(mode, monkeypatch):
    """Every request in one split (stage 1 writes ``o``), and random counts in 1..12 (merged
    by stage 2), v_scale 1 (no scaling branch) in the first."""
    lens = _lens("ragged 1..5000") + [1, 128, 129]
    g = torch.Generator().manual_seed(5)
    if mode == "one split":
        splits = torch.ones(len(lens), dtype=torch.int32, device=DEV)
        v_scale = 1.0
    else:
        splits = torch.randint(1, 13, (len(lens),), generator=g, dtype=torch.int32).to(DEV)
        v_scale = V_SCALE
    q, k, v, indptr, indices = _inputs(lens, 8, seed=21, v_scale=v_scale)
    ref = _reference(q, k, v, indptr, indices, v_scale=v_scale)
    out = _decode(q, k, v, indptr, indices, splits, True, monkeypatch, v_scale=v_scale)
    _check(out, ref)
    tri = _decode(q, k, v, indptr, indices, splits, False, monkeypatch, v_scale=v_scale)
    torch.testing.assert_close(out.float(), tri.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("cfg", [GluonFp8DecodeConfig(block_n=128, num_buffers=3), GluonFp8DecodeConfig(num_buffers=2),
                                 GluonFp8DecodeConfig(block_n=128, num_buffers=2), GluonFp8DecodeConfig(num_buffers=3),
                                 GluonFp8DecodeConfig(pairs=False), GluonFp8DecodeConfig(block_n=128, pairs=False),
                                 GluonFp8DecodeConfig(split_align=256)],
                         ids=["128x3", "64x2", "128x2", "64x3", "64x4-bytes", "128x4-bytes", "64x4-align256"])
def test_gluon_configs_direct(cfg):
    """Other tiles / ring depths / split alignments and the byte-load variant (``pairs``
    off), launched directly (stage 2 with the config's ``split_align``), with a split grid of
    2 (programs loop over several splits)."""
    lens = _lens("64x[128,4096]")[:20] + [1, 63, 64, 65]
    hkv = 8
    q, k, v, indptr, indices = _inputs(lens, hkv, seed=33)
    splits = torch.randint(1, 9, (len(lens),), generator=torch.Generator().manual_seed(6), dtype=torch.int32).to(DEV)
    o, logits, lse = _scratch(len(lens))
    gluon_fp8_decode_stage1(q, k, v, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5, 2,
                            k_scale=K_SCALE, v_scale=V_SCALE, config=cfg)
    decode_stage2(logits, lse, o, indptr, splits, MAX_SPLITS, split_align=cfg.split_align, merge_block=32,
                  num_warps=2)
    _check(o, _reference(q, k, v, indptr, indices))


def test_gluon_in_cuda_graph_replayed_at_new_lengths(monkeypatch):
    """Captured in a CUDA graph (as decode steps are) and replayed after the cache, lengths,
    indices and split counts changed in place: bitwise equal to an eager call on the new
    inputs (the kernel has no atomics) and to float64 within the bounds."""
    monkeypatch.setenv(FP8_GLUON_ENV, "1")
    lens = [700, 5, 1300, 64, 3000, 1]
    hkv = 8
    q, k, v, indptr, indices = _inputs(lens, hkv, seed=11)
    splits = _engine_splits(lens, hkv)
    assert _fp8_gluon_route(q, k, v, indptr, indices, splits, 0.0, False)
    o, logits, lse = _scratch(len(lens))

    def step():
        decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5,
                             k_scale=K_SCALE, v_scale=V_SCALE)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = [3000, 1, 1764, 300, 4, 1]  # same total (5,070 keys), new boundaries and split counts
    q2, k2, v2, indptr2, indices2 = _inputs(new_lens, hkv, seed=12)
    splits2 = _engine_splits(new_lens, hkv)
    for dst, src in ((q, q2), (k, k2), (v, v2), (indptr, indptr2), (indices, indices2), (splits, splits2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = _decode(q2, k2, v2, indptr2, indices2, splits2, True, monkeypatch)
    assert torch.equal(o, eager)
    _check(o, _reference(q2, k2, v2, indptr2, indices2))


def test_route_off_by_default_and_for_unsupported(monkeypatch):
    """Unset switch, e5m2 caches and logit caps keep the Triton kernel."""
    q, k, v, indptr, indices = _inputs([10], 8, seed=1)
    splits = torch.ones(1, dtype=torch.int32, device=DEV)
    monkeypatch.delenv(FP8_GLUON_ENV, raising=False)
    assert not _fp8_gluon_route(q, k, v, indptr, indices, splits, 0.0, False)
    monkeypatch.setenv(FP8_GLUON_ENV, "1")
    assert _fp8_gluon_route(q, k, v, indptr, indices, splits, 0.0, False)
    assert not _fp8_gluon_route(q, k, v, indptr, indices, splits, 30.0, False)
    assert not _fp8_gluon_route(q, k, v, indptr, indices, splits, 0.0, True)
    k5, v5 = k.float().to(torch.float8_e5m2), v.float().to(torch.float8_e5m2)
    assert not _fp8_gluon_route(q, k5, v5, indptr, indices, splits, 0.0, False)
