"""The opt-in fp8 V-pairs tiles of decode stage 1 (``ATTNSERVE_DECODE_FP8_TILE``,
`decode_tuning.FP8_TILE_VARIANTS`: 2-3 shared-memory buffers of K/V, ``maxnreg``) on a GPU,
against float64 attention over the dequantised cache and against the default tiles; the
16-bit cache's opt-in tiles (``ATTNSERVE_DECODE_BF16_TILE``) the same way, and PDL at every
batch (``ATTNSERVE_DECODE_PDL_ALL``) against an eager launch without it.

``pytest tests/gpu/test_decode_fp8_tiles_gpu.py``. Every test is marked ``cuda`` and skipped
without a GPU. The tiles are what `decode_config` returns for an H100 with the variable set
(so the selection and the launch options, ``maxnreg`` included, are the engine's), on
whatever GPU runs the test (V pairs need only CUDA and 16-bit queries).
"""

from __future__ import annotations

import pytest
import torch

from attnserve.attention.triton_ops.decode_attention import decode_attention_fwd, decode_config
from attnserve.attention.triton_ops.decode_splits import compute_num_kv_splits
from attnserve.attention.triton_ops.decode_tuning import (BF16_TILE_ENV, BF16_TILE_VARIANTS, FP8_TILE_ENV,
                                                          FP8_TILE_VARIANTS, PDL_ALL_ENV)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"
HQ, HKV, D = 32, 8, 128  # Llama-3-8B heads
MAX_SPLITS = 32
K_SCALE, V_SCALE = 0.05, 0.3
ATOL = RTOL = 2e-2  # bf16 queries and outputs, fp16 dots (as tests/kernels/test_fp8_kv_kernels.py)
H100 = "NVIDIA H100 80GB HBM3"


def _scales(kv_dtype):
    """The cache's dequantisation scales: `K_SCALE` / `V_SCALE` for fp8, 1 for a bf16 cache."""
    return (1.0, 1.0) if kv_dtype == torch.bfloat16 else (K_SCALE, V_SCALE)


def _inputs(lens, kv_dtype, seed):
    """q (bf16), K/V buffers of ``kv_dtype`` holding ``x / scale`` rounded (`_scales`), the CSR
    indices of requests at shuffled slots (slot 0 unused) and the split counts the triton
    backend computes."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = sum(lens)
    fmax = torch.finfo(kv_dtype).max
    ks, vs = _scales(kv_dtype)
    k = (torch.randn(total + 1, HKV, D, device=DEV, generator=g) / ks).clamp(-fmax, fmax).to(kv_dtype)
    v = (torch.randn(total + 1, HKV, D, device=DEV, generator=g) / vs).clamp(-fmax, fmax).to(kv_dtype)
    q = torch.randn(len(lens), HQ, D, device=DEV, generator=g).to(torch.bfloat16)
    indices = (torch.randperm(total, device=DEV, generator=g) + 1).to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV)
    indptr[1:] = torch.cumsum(lens_t, 0)
    splits = torch.empty(len(lens), dtype=torch.int32, device=DEV)
    compute_num_kv_splits(lens_t, splits, MAX_SPLITS, torch.cuda.get_device_properties(0).multi_processor_count, HKV)
    return q, k, v, indptr, indices, splits


def _reference(q, k, v, indptr, indices):
    """float64 softmax(q K^T / sqrt(D)) V over the dequantised cache, per request."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=DEV)
    group = HQ // HKV
    ks, vs = _scales(k.dtype)
    for b in range(q.shape[0]):
        rows = indices[int(indptr[b]):int(indptr[b + 1])].long()
        kb = k[rows].double().repeat_interleave(group, dim=1) * ks  # [n, HQ, D]
        vb = v[rows].double().repeat_interleave(group, dim=1) * vs
        s = torch.einsum("hd,nhd->hn", q[b].double(), kb) * D ** -0.5
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vb)
    return out


def _config(variant, bs, monkeypatch, kv_dtype=torch.float8_e4m3fn, pdl_all=False):
    """`decode_config` for an H100 with the opt-in tile ``variant`` of ``kv_dtype``'s table
    (None: the default tiles) and ``ATTNSERVE_DECODE_PDL_ALL`` set or not."""
    env = BF16_TILE_ENV if kv_dtype == torch.bfloat16 else FP8_TILE_ENV
    if variant is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, variant)
    if pdl_all:
        monkeypatch.setenv(PDL_ALL_ENV, "1")
    else:
        monkeypatch.delenv(PDL_ALL_ENV, raising=False)
    props = torch.cuda.get_device_properties(0)
    return decode_config(D, HQ // HKV, kv_dtype, max_shared_mem=props.shared_memory_per_block_optin,
                         device_name=H100, batch_size=bs, num_kv_heads=HKV, num_sms=props.multi_processor_count)


def _run(q, k, v, indptr, indices, splits, cfg):
    bs = q.shape[0]
    o = torch.full((bs, HQ, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    logits = torch.full((bs, HQ, MAX_SPLITS, D), float("nan"), device=DEV)
    lse = torch.full((bs, HQ, MAX_SPLITS), float("nan"), device=DEV)
    ks, vs = _scales(k.dtype)
    decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5, config=cfg,
                         k_scale=ks, v_scale=vs)
    return o


#: lengths around every tile size (64 / 128 / 256) and long enough for several splits
SMALL_LENS = [1, 63, 64, 65, 127, 129, 255, 257, 300, 800, 1030, 4100]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("variant", sorted(FP8_TILE_VARIANTS))
def test_fp8_tile_matches_float64(variant, kv_dtype, monkeypatch):
    """A small batch (the small-batch tiles are replaced) of ragged lengths."""
    q, k, v, indptr, indices, splits = _inputs(SMALL_LENS, kv_dtype, seed=len(variant))
    cfg = _config(variant, len(SMALL_LENS), monkeypatch)
    assert (cfg.block_n, cfg.num_stages, cfg.num_warps, cfg.maxnreg) == FP8_TILE_VARIANTS[variant]
    assert int(splits.max()) > 1, "several splits must be merged"
    out = _run(q, k, v, indptr, indices, splits, cfg)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), _reference(q, k, v, indptr, indices), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", sorted(FP8_TILE_VARIANTS))
def test_fp8_tile_big_batch_matches_default(variant, monkeypatch):
    """144 requests (the batch tiles are replaced): float64 on a sample of requests, and the
    default tiles' output everywhere (same math, other tile boundaries)."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 900, (144,), generator=g).tolist()
    q, k, v, indptr, indices, splits = _inputs(lens, torch.float8_e4m3fn, seed=3)
    out = _run(q, k, v, indptr, indices, splits, _config(variant, len(lens), monkeypatch))
    default = _run(q, k, v, indptr, indices, splits, _config(None, len(lens), monkeypatch))
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), default.float(), atol=ATOL, rtol=RTOL)
    sample = [0, 1, 77, 143]
    ref = _reference(q, k, v, indptr, indices)
    torch.testing.assert_close(out[sample].double(), ref[sample], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", sorted(FP8_TILE_VARIANTS))
def test_fp8_tile_in_cuda_graph(variant, monkeypatch):
    """Captured in a CUDA graph (as decode steps are) and replayed after the cache, lengths
    and split counts changed in place: equal to an eager call on the new inputs."""
    lens = [700, 5, 1300, 64]
    q, k, v, indptr, indices, splits = _inputs(lens, torch.float8_e4m3fn, seed=11)
    cfg = _config(variant, len(lens), monkeypatch)
    o = torch.empty(len(lens), HQ, D, dtype=torch.bfloat16, device=DEV)
    logits = torch.empty(len(lens), HQ, MAX_SPLITS, D, device=DEV)
    lse = torch.empty(len(lens), HQ, MAX_SPLITS, device=DEV)

    def step():
        decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5, config=cfg,
                             k_scale=K_SCALE, v_scale=V_SCALE)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = [300, 1704, 1, 64]  # same total (2,069 keys), new boundaries
    q2, k2, v2, indptr2, indices2, splits2 = _inputs(new_lens, torch.float8_e4m3fn, seed=12)
    for dst, src in ((q, q2), (k, k2), (v, v2), (indptr, indptr2), (indices, indices2), (splits, splits2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = _run(q2, k2, v2, indptr2, indices2, splits2, cfg)
    assert torch.equal(o, eager)
    torch.testing.assert_close(o.double(), _reference(q2, k2, v2, indptr2, indices2), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", sorted(BF16_TILE_VARIANTS))
def test_bf16_tile_matches_float64_and_default(variant, monkeypatch):
    """``ATTNSERVE_DECODE_BF16_TILE``: a small ragged batch against float64, and 144 requests
    against the default tiles (same math, other tile boundaries) and float64 on a sample."""
    q, k, v, indptr, indices, splits = _inputs(SMALL_LENS, torch.bfloat16, seed=len(variant))
    cfg = _config(variant, len(SMALL_LENS), monkeypatch, torch.bfloat16)
    assert (cfg.block_n, cfg.num_stages, cfg.num_warps, cfg.maxnreg) == BF16_TILE_VARIANTS[variant]
    assert not cfg.v_pairs and int(splits.max()) > 1
    out = _run(q, k, v, indptr, indices, splits, cfg)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), _reference(q, k, v, indptr, indices), atol=ATOL, rtol=RTOL)
    lens = torch.randint(1, 900, (144,), generator=torch.Generator().manual_seed(5)).tolist()
    q, k, v, indptr, indices, splits = _inputs(lens, torch.bfloat16, seed=9)
    out = _run(q, k, v, indptr, indices, splits, _config(variant, len(lens), monkeypatch, torch.bfloat16))
    default = _run(q, k, v, indptr, indices, splits, _config(None, len(lens), monkeypatch, torch.bfloat16))
    torch.testing.assert_close(out.float(), default.float(), atol=ATOL, rtol=RTOL)
    sample = [0, 1, 77, 143]
    torch.testing.assert_close(out[sample].double(), _reference(q, k, v, indptr, indices)[sample],
                               atol=ATOL, rtol=RTOL)


def test_pdl_all_in_cuda_graph_equals_eager_without_pdl(monkeypatch):
    """``ATTNSERVE_DECODE_PDL_ALL=1`` at 144 requests (stage 1 over several waves): captured
    in a CUDA graph and replayed on new lengths, the bits equal an eager launch without PDL
    (PDL changes when stage 2 launches, not what it computes)."""
    g = torch.Generator().manual_seed(13)
    lens = torch.randint(1, 900, (144,), generator=g).tolist()
    q, k, v, indptr, indices, splits = _inputs(lens, torch.bfloat16, seed=14)
    cfg = _config(None, len(lens), monkeypatch, torch.bfloat16, pdl_all=True)
    assert cfg.pdl
    o = torch.empty(len(lens), HQ, D, dtype=torch.bfloat16, device=DEV)
    logits = torch.empty(len(lens), HQ, MAX_SPLITS, D, device=DEV)
    lse = torch.empty(len(lens), HQ, MAX_SPLITS, device=DEV)

    def step():
        decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, splits, MAX_SPLITS, D ** -0.5, config=cfg)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = [lens[i] for i in torch.randperm(len(lens), generator=g).tolist()]  # same total, new boundaries
    assert new_lens != lens
    q2, k2, v2, indptr2, indices2, splits2 = _inputs(new_lens, torch.bfloat16, seed=15)
    for dst, src in ((q, q2), (k, k2), (v, v2), (indptr, indptr2), (indices, indices2), (splits, splits2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = _run(q2, k2, v2, indptr2, indices2, splits2, _config(None, len(lens), monkeypatch, torch.bfloat16))
    assert torch.equal(o, eager)
