"""FP8 KV cache in the Triton paged kernels (decode and extend) vs a float64 reference.

The buffers hold float8 (e4m3fn / e5m2) values quantised with per-tensor scales,
``stored = (x / scale).clamp(-max, max).to(fp8)``; the reference attends over the
fp8-ROUNDED values dequantised in float64 (``stored.double() * scale``), so the kernels
must match it at the tolerances of the q dtype (the quantisation error itself is not
part of the comparison). Under the CPU interpreter (triton >= 3.x) fp8 loads and
conversions are exact for every finite code; only the non-finite codes (never produced
by the clamp above) are decoded wrongly by the interpreter, so no test needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

from test_decode_attention import _reference as _decode_reference64  # float64 references over true K/V
from test_extend_attention import _reference as _extend_reference64

from attnserve.attention.triton_ops.decode_attention import DecodeConfig, compute_num_kv_splits, decode_attention_fwd
from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd
from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3fn", "e5m2"]
K_SCALE, V_SCALE = 0.05, 0.3


def _quantize(x, dtype, scale):
    """``(x / scale)`` clamped to the format's range and rounded to ``dtype`` (fp8 or not)."""
    if dtype in FP8:
        fmax = torch.finfo(dtype).max
        return (x / scale).clamp(-fmax, fmax).to(dtype)
    return (x / scale).to(dtype)


def _dequant(stored, scale):
    return stored.double() * scale


def _check(out, ref, dtype):
    assert not torch.isnan(out).any(), "some output element was not written (or NaN)"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- decode


def _decode_inputs(gen, paged, *, lens, hq, hkv, dk, dv, page_size, window=-1, max_kv_splits=4):
    """Random true K/V/q and the decode index tensors (slots from a shuffled page layout)."""
    bs = len(lens)
    r2t, rows, num_slots = paged(lens, page_size, gen)
    kv_start = [max(n - window - 1, 0) if window >= 0 else 0 for n in lens]
    k_true = torch.randn(num_slots, hkv, dk, generator=gen)
    v_true = torch.randn(num_slots, hkv, dv, generator=gen)
    q = torch.randn(bs, hq, dk, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    start_t = torch.tensor(kv_start, dtype=torch.int32, device=DEVICE)
    kernel_lens = seq_lens - start_t
    kv_indptr = compute_kv_indptr(kernel_lens)
    kv_indices = torch.empty(int(sum(lens)) + 1, dtype=torch.int32, device=DEVICE)
    create_kv_indices(r2t.to(DEVICE), rows.to(DEVICE), kernel_lens, kv_indptr, start_t if window >= 0 else None,
                      kv_indices)
    num_kv_splits = torch.full((bs,), -1, dtype=torch.int32, device=DEVICE)
    compute_num_kv_splits(kernel_lens, num_kv_splits, max_kv_splits, num_sms=8, num_kv_heads=hkv,
                          split_tile_size=32, min_split_tokens=16)
    idx = dict(r2t=r2t, rows=rows, kv_start=kv_start, kv_indptr=kv_indptr, kv_indices=kv_indices,
               num_kv_splits=num_kv_splits, max_kv_splits=max_kv_splits)
    return q, k_true, v_true, idx


def _decode_call(q, k_buf, v_buf, idx, dv, sm_scale, logit_cap=0.0, config=None, **scales):
    bs, hq, _ = q.shape
    m = idx["max_kv_splits"]
    o = torch.full((bs, hq, dv), float("nan"), dtype=q.dtype, device=DEVICE)
    logits = torch.full((bs, hq, m, dv), float("nan"), device=DEVICE)
    lse = torch.full((bs, hq, m), float("nan"), device=DEVICE)
    decode_attention_fwd(q, k_buf, v_buf, o, idx["kv_indptr"], idx["kv_indices"], logits, lse, idx["num_kv_splits"],
                         m, sm_scale, logit_cap, config=config, **scales)
    return o.cpu()


def _run_decode(gen, paged, *, lens, hq, hkv, kv_dtype, q_dtype=torch.float32, dk=64, dv=64, page_size=16,
                logit_cap=0.0, window=-1, k_scale=K_SCALE, v_scale=V_SCALE, shared_kv=False, config=None):
    q, k_true, v_true, idx = _decode_inputs(gen, paged, lens=lens, hq=hq, hkv=hkv, dk=dk, dv=dv,
                                            page_size=page_size, window=window)
    q = q.to(q_dtype)
    k_buf = _quantize(k_true, kv_dtype, k_scale)
    v_buf = k_buf[..., :dv] if shared_kv else _quantize(v_true, kv_dtype, v_scale)
    sm_scale = dk ** -0.5
    k_dev = k_buf.to(DEVICE)
    v_dev = k_dev[..., :dv] if shared_kv else v_buf.to(DEVICE)
    out = _decode_call(q.to(DEVICE), k_dev, v_dev, idx, dv, sm_scale, logit_cap, config,
                       k_scale=k_scale, v_scale=v_scale)
    ref = _decode_reference64(q, _dequant(k_buf, k_scale), _dequant(v_buf, v_scale), idx["r2t"], idx["rows"],
                              idx["kv_start"], lens, sm_scale, logit_cap)
    return out, ref, idx["num_kv_splits"].cpu()


DECODE_LENS = [1, 7, 65, 300, 129]


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])  # GQA 1, 4, 8
def test_decode_fp8_gqa(hq, hkv, kv_dtype, gen, paged):
    out, ref, ns = _run_decode(gen, paged, lens=DECODE_LENS, hq=hq, hkv=hkv, kv_dtype=kv_dtype)
    assert ns.max() > 1, "v_scale must be right across several splits"
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("logit_cap", [0.0, 2.0])
def test_decode_fp8_pages_and_logit_cap(page_size, logit_cap, kv_dtype, gen, paged):
    out, ref, _ = _run_decode(gen, paged, lens=[200, 3, 97], hq=6, hkv=2, kv_dtype=kv_dtype, page_size=page_size,
                              logit_cap=logit_cap)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_fp8_half_queries(q_dtype, kv_dtype, gen, paged):
    out, ref, _ = _run_decode(gen, paged, lens=[40, 170, 1], hq=8, hkv=2, kv_dtype=kv_dtype, q_dtype=q_dtype,
                              page_size=4, logit_cap=4.0)
    _check(out, ref, q_dtype)


def test_decode_fp8_sliding_window_via_kv_start(gen, paged):
    out, ref, _ = _run_decode(gen, paged, lens=[1, 50, 230], hq=4, hkv=2, kv_dtype=torch.float8_e4m3fn,
                              q_dtype=torch.float16, page_size=4, window=37)
    _check(out, ref, torch.float16)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_decode_fp8_odd_head_dim_and_per_head_path(kv_dtype, gen, paged):
    """Dk 80 (main + remainder blocks), then the per-head (block_h=1) tuning path."""
    out, ref, _ = _run_decode(gen, paged, lens=[33, 150], hq=3, hkv=1, kv_dtype=kv_dtype, dk=80, dv=80, page_size=4)
    _check(out, ref, torch.float32)
    cfg = DecodeConfig(block_n=32, block_h=1, num_warps=4, num_stages=1)
    out, ref, _ = _run_decode(gen, paged, lens=[1, 70, 129], hq=3, hkv=3, kv_dtype=kv_dtype, q_dtype=torch.float16,
                              page_size=4, logit_cap=4.0, config=cfg)
    _check(out, ref, torch.float16)


def test_decode_fp8_shared_mla_buffer(gen, paged):
    """K and V as views of one fp8 latent buffer (Dk 576, Dv 512): one scale for both."""
    out, ref, _ = _run_decode(gen, paged, lens=[20, 45], hq=4, hkv=1, kv_dtype=torch.float8_e4m3fn, dk=576, dv=512,
                              page_size=4, k_scale=0.02, v_scale=0.02, shared_kv=True)
    _check(out, ref, torch.float32)


@pytest.mark.skipif(DEVICE != "cuda", reason="v_pairs is a CUDA code path (ignored by the interpreter)")
@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tile", [(64, 2, 4), (128, 5, 4), (256, 3, 4), (256, 3, 8)], ids=str)
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (32, 8, 128), (4, 4, 128)])
def test_decode_fp8_v_pairs(hq, hkv, d, tile, q_dtype, kv_dtype, gen, paged):
    """fp8 V read as int16 column pairs (`DecodeConfig.v_pairs`) against the float64
    reference: tile sizes, 4 and 8 warps, group sizes 1 and 4, head sizes 64 and 128."""
    n, stages, warps = tile
    cfg = DecodeConfig(block_n=n, block_h=16, num_warps=warps, num_stages=stages, v_pairs=True)
    out, ref, _ = _run_decode(gen, paged, lens=[1, 300, 17, 1030], hq=hq, hkv=hkv, kv_dtype=kv_dtype, q_dtype=q_dtype,
                              dk=d, dv=d, page_size=16, logit_cap=3.0 if hq == 8 else 0.0, config=cfg)
    _check(out, ref, q_dtype)


@pytest.mark.parametrize("name,pairs", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA H200", True),
                                        ("NVIDIA A100-SXM4-80GB", False), ("", False)])
def test_decode_config_fp8_pairs_on_hopper(name, pairs):
    """`decode_config` gives fp8 caches the V-pairs tile `FP8_HOPPER_TILE` on H100 / H200 only (measured
    there), the 5-stage byte tile on other GPUs with the shared memory, and leaves bf16 alone."""
    from attnserve.attention.triton_ops.decode_attention import FP8_HOPPER_TILE, decode_config

    smem = 227 * 1024
    for kv in FP8:
        cfg = decode_config(128, 4, kv, max_shared_mem=smem, device_name=name)
        assert cfg.v_pairs == pairs
        got = (cfg.block_n, cfg.num_stages, cfg.num_warps)
        assert got == (FP8_HOPPER_TILE if pairs else (128, 5, 4))
    bf16 = decode_config(128, 4, torch.bfloat16, max_shared_mem=smem, device_name=name)
    assert not bf16.v_pairs and (bf16.block_n, bf16.num_stages) == (128, 3)


@pytest.mark.skipif(DEVICE != "cuda", reason="v_pairs is a CUDA code path (ignored by the interpreter)")
def test_decode_fp8_v_pairs_shared_mla_buffer(gen, paged):
    """V as a strided view of K's fp8 buffer (Dk 576, Dv 512) through the pairs path."""
    cfg = DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2, v_pairs=True)
    out, ref, _ = _run_decode(gen, paged, lens=[20, 45], hq=16, hkv=1, kv_dtype=torch.float8_e4m3fn,
                              q_dtype=torch.bfloat16, dk=576, dv=512, page_size=4, k_scale=0.02, v_scale=0.02,
                              shared_kv=True, config=cfg)
    _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_scales_apply_to_unquantized_buffers(buf_dtype, gen, paged):
    out, ref, _ = _run_decode(gen, paged, lens=[9, 130], hq=4, hkv=2, kv_dtype=buf_dtype, q_dtype=buf_dtype,
                              page_size=4, k_scale=0.5, v_scale=2.0, logit_cap=3.0)
    _check(out, ref, buf_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_decode_default_scales_are_identical(dtype, gen, paged):
    q, k, v, idx = _decode_inputs(gen, paged, lens=[5, 90], hq=4, hkv=2, dk=64, dv=64, page_size=4)
    q, k, v = (x.to(dtype).to(DEVICE) for x in (q, k, v))
    plain = _decode_call(q, k, v, idx, 64, 0.125, 2.0)
    explicit = _decode_call(q, k, v, idx, 64, 0.125, 2.0, k_scale=1.0, v_scale=1.0)
    assert not torch.isnan(plain).any()
    assert torch.equal(plain, explicit)


# --------------------------------------------------------------------------- extend


def _extend_inputs(gen, paged, *, prefix, ext, hq, hkv, dk, dv, page_size, prefix_start=None, mask_kind=None,
                   mask_covers_prefix=True):
    bs = len(ext)
    r2t, rows, num_slots = paged(prefix, page_size, gen)
    prefix_start = prefix_start or [0] * bs
    t = sum(ext)
    k_pre = torch.randn(num_slots, hkv, dk, generator=gen)
    v_pre = torch.randn(num_slots, hkv, dv, generator=gen)
    q = torch.randn(t, hq, dk, generator=gen)
    k_ext = torch.randn(t, hkv, dk, generator=gen)
    v_ext = torch.randn(t, hkv, dv, generator=gen)
    qo = [0]
    for e in ext:
        qo.append(qo[-1] + e)
    masks = None
    if mask_kind is not None:
        masks = []
        for i, e in enumerate(ext):
            plen = prefix_start[i] + prefix[i]
            cols = plen + e if mask_covers_prefix else e
            m = torch.rand(e, cols, generator=gen) < 0.6
            if mask_kind == "tree":  # speculative tree: all prefix visible, random ancestors, self visible
                m[:, : cols - e] = True
                m[:, cols - e :] &= torch.ones(e, e, dtype=torch.bool).tril()
                m[:, cols - e :] |= torch.eye(e, dtype=torch.bool)
            elif e > 1 and mask_covers_prefix:
                m[1] = False  # a query that sees nothing must output zeros
            masks.append(m)
    mask_flat = mask_indptr = None
    if masks:
        mask_flat = torch.cat([m.reshape(-1) for m in masks]).to(DEVICE)
        offs = [0]
        for m in masks:
            offs.append(offs[-1] + m.numel())
        mask_indptr = torch.tensor(offs[:-1], dtype=torch.int64, device=DEVICE)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)
    kv_indptr = compute_kv_indptr(prefix_lens)
    kv_indices = torch.empty(sum(prefix) + 1, dtype=torch.int32, device=DEVICE)
    create_kv_indices(r2t.to(DEVICE), rows.to(DEVICE), prefix_lens, kv_indptr, None, kv_indices)
    idx = dict(
        qo=qo, qo_indptr=torch.tensor(qo, dtype=torch.int32, device=DEVICE), kv_indptr=kv_indptr,
        kv_indices=kv_indices, prefix_slots=[r2t[rows[i], : prefix[i]] for i in range(bs)], masks=masks,
        mask_flat=mask_flat, mask_indptr=mask_indptr, prefix_start=prefix_start, max_ext=max(ext),
        prefix_start_t=torch.tensor(prefix_start, dtype=torch.int32, device=DEVICE) if any(prefix_start) else None,
    )
    return q, k_ext, v_ext, k_pre, v_pre, idx


def _extend_call(q, k_ext, v_ext, k_buf, v_buf, idx, sm_scale, *, is_causal=True, logit_cap=0.0, window=-1,
                 mask_covers_prefix=True, **scales):
    o = torch.full((q.shape[0], q.shape[1], v_ext.shape[2]), float("nan"), dtype=q.dtype, device=DEVICE)
    extend_attention_fwd(q, k_ext, v_ext, o, k_buf, v_buf, idx["qo_indptr"], idx["kv_indptr"], idx["kv_indices"],
                         idx["mask_flat"], is_causal, idx["mask_indptr"], idx["max_ext"], sm_scale, logit_cap, window,
                         idx["prefix_start_t"], mask_covers_prefix=mask_covers_prefix, **scales)
    return o.cpu()


def _run_extend(gen, paged, *, prefix, ext, hq, hkv, kv_dtype, q_dtype=torch.float32, dk=64, dv=64, page_size=4,
                is_causal=True, window=-1, logit_cap=0.0, prefix_start=None, mask_kind=None, mask_covers_prefix=True,
                k_scale=K_SCALE, v_scale=V_SCALE, has_prefix=True):
    q, k_ext, v_ext, k_pre, v_pre, idx = _extend_inputs(
        gen, paged, prefix=prefix, ext=ext, hq=hq, hkv=hkv, dk=dk, dv=dv, page_size=page_size,
        prefix_start=prefix_start, mask_kind=mask_kind, mask_covers_prefix=mask_covers_prefix)
    q, k_ext, v_ext = (x.to(q_dtype) for x in (q, k_ext, v_ext))
    k_buf, v_buf = _quantize(k_pre, kv_dtype, k_scale), _quantize(v_pre, kv_dtype, v_scale)
    sm_scale = dk ** -0.5
    out = _extend_call(*(x.to(DEVICE) for x in (q, k_ext, v_ext, k_buf, v_buf)), idx, sm_scale, is_causal=is_causal,
                       logit_cap=logit_cap, window=window, mask_covers_prefix=mask_covers_prefix,
                       k_scale=k_scale, v_scale=v_scale, has_prefix=has_prefix)
    ref = _extend_reference64(q, k_ext, v_ext, _dequant(k_buf, k_scale), _dequant(v_buf, v_scale), idx["qo"],
                              idx["prefix_slots"], idx["prefix_start"], idx["masks"], is_causal, window, sm_scale,
                              logit_cap, mask_covers_prefix)
    return out, ref


# ragged: prefix 0..n, extend lengths around the interpreter tiles (BLOCK_M 32, BLOCK_N 16)
PREFIX = [0, 5, 40, 17]
EXT = [40, 1, 33, 16]


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2), (8, 1)])
def test_extend_fp8_causal_gqa(hq, hkv, kv_dtype, gen, paged):
    out, ref = _run_extend(gen, paged, prefix=PREFIX, ext=EXT, hq=hq, hkv=hkv, kv_dtype=kv_dtype)
    _check(out, ref, torch.float32)


@pytest.mark.skipif(DEVICE == "cpu", reason="the fp16 prefix dots (bf16 queries) run only on a GPU; the "
                    "interpreter computes in fp32 (bf16 queries on the CPU: the logit-cap test below)")
@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("hq,hkv,dk,mask_kind", [(8, 2, 128, None), (4, 1, 80, None), (4, 2, 64, "tree")])
def test_extend_fp8_bf16_queries_gpu(hq, hkv, dk, mask_kind, kv_dtype, gen, paged):
    """bf16 queries over an fp8 prefix (the engine's case): the prefix dots run in fp16
    (``PREFIX_F16``), the new tokens' in bf16; at bf16 tolerances."""
    out, ref = _run_extend(gen, paged, prefix=[300, 0, 77, 129], ext=[40, 65, 1, 128], hq=hq, hkv=hkv,
                           kv_dtype=kv_dtype, q_dtype=torch.bfloat16, dk=dk, dv=dk, page_size=16,
                           mask_kind=mask_kind)
    _check(out, ref, torch.bfloat16)


@pytest.mark.skipif(DEVICE == "cpu", reason="compares the GPU's fp8 and bf16 kernel variants")
@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("has_prefix", [False, True], ids=["hint", "no_hint"])
def test_extend_plain_prefill_fp8_pool_same_bits_as_bf16_pool_gpu(kv_dtype, has_prefix, gen, paged):
    """A plain prefill (no request has a prefix) reads no cached K/V: over an fp8 pool it
    gives the same bits as over a bf16 pool, with the engine's hint (``has_prefix=False``:
    the prefix stage compiled out) or without it."""
    q, k_ext, v_ext, k_pre, v_pre, idx = _extend_inputs(gen, paged, prefix=[0, 0, 0], ext=[300, 64, 129], hq=8, hkv=2,
                                                        dk=128, dv=128, page_size=16)
    q, k_ext, v_ext = (x.to(torch.bfloat16).to(DEVICE) for x in (q, k_ext, v_ext))
    outs = [_extend_call(q, k_ext, v_ext, _quantize(k_pre, dt, 1.0).to(DEVICE), _quantize(v_pre, dt, 1.0).to(DEVICE),
                         idx, 128 ** -0.5, has_prefix=has_prefix) for dt in (kv_dtype, torch.bfloat16)]
    assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_fp8_non_causal_pages(page_size, kv_dtype, gen, paged):
    out, ref = _run_extend(gen, paged, prefix=[3, 50], ext=[45, 20], hq=4, hkv=2, kv_dtype=kv_dtype,
                           page_size=page_size, is_causal=False)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_extend_fp8_logit_cap_window_half_queries(q_dtype, kv_dtype, gen, paged):
    out, ref = _run_extend(gen, paged, prefix=[10, 0, 37], ext=[40, 25, 3], hq=6, hkv=2, kv_dtype=kv_dtype,
                           q_dtype=q_dtype, logit_cap=3.0, window=30)
    _check(out, ref, q_dtype)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("mask_kind", ["tree", "random"])
def test_extend_fp8_custom_mask(mask_kind, kv_dtype, gen, paged):
    out, ref = _run_extend(gen, paged, prefix=[30, 0, 7], ext=[20, 5, 40], hq=4, hkv=2, kv_dtype=kv_dtype,
                           mask_kind=mask_kind)
    _check(out, ref, torch.float32)
    if mask_kind == "random":
        assert (out[1] == 0).all(), "a query with no visible key must output zeros"


def test_extend_fp8_custom_mask_new_tokens_only(gen, paged):
    """``mask_covers_prefix=False``: [E, E] blocks, every prefix key visible (unmasked prefix runs)."""
    out, ref = _run_extend(gen, paged, prefix=[35, 16, 0], ext=[6, 17, 4], hq=4, hkv=1,
                           kv_dtype=torch.float8_e4m3fn, mask_kind="tree", mask_covers_prefix=False, logit_cap=2.5)
    _check(out, ref, torch.float32)


def test_extend_fp8_window_with_trimmed_prefix(gen, paged):
    out, ref = _run_extend(gen, paged, prefix=[20, 8], ext=[50, 12], hq=4, hkv=1, kv_dtype=torch.float8_e5m2,
                           window=19, prefix_start=[100, 3])
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_extend_fp8_odd_head_dims(kv_dtype, gen, paged):
    out, ref = _run_extend(gen, paged, prefix=[18, 3], ext=[35, 9], hq=2, hkv=1, kv_dtype=kv_dtype, dk=80, dv=48)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_extend_scales_apply_to_unquantized_buffers(buf_dtype, gen, paged):
    out, ref = _run_extend(gen, paged, prefix=[21, 4], ext=[30, 7], hq=4, hkv=2, kv_dtype=buf_dtype,
                           q_dtype=buf_dtype, k_scale=0.5, v_scale=2.0)
    _check(out, ref, buf_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_extend_default_scales_are_identical(dtype, gen, paged):
    q, k_ext, v_ext, k_pre, v_pre, idx = _extend_inputs(gen, paged, prefix=[21, 4], ext=[30, 7], hq=4, hkv=2, dk=64,
                                                        dv=64, page_size=4)
    args = [x.to(dtype).to(DEVICE) for x in (q, k_ext, v_ext, k_pre, v_pre)]
    plain = _extend_call(*args, idx, 0.125, logit_cap=2.0)
    explicit = _extend_call(*args, idx, 0.125, logit_cap=2.0, k_scale=1.0, v_scale=1.0)
    assert not torch.isnan(plain).any()
    assert torch.equal(plain, explicit)


# --------------------------------------------------------------------------- argument checks


def test_fp8_argument_errors():
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    q = torch.zeros(2, 4, 64, device=DEVICE)
    kb = torch.zeros(10, 2, 64, device=DEVICE)
    o = torch.zeros(2, 4, 64, device=DEVICE)
    ip = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    ns = torch.ones(2, dtype=torch.int32, device=DEVICE)
    logits = torch.zeros(2, 4, 4, 64, device=DEVICE)
    lse = torch.zeros(2, 4, 4, device=DEVICE)

    def dec(qq, k, v, **kw):
        decode_attention_fwd(qq, k, v, o, ip, ip, logits, lse, ns, 4, 1.0, **kw)

    with pytest.raises(ValueError, match="float8"):
        dec(q, kb.to(e4), kb.to(e5))  # K and V in different fp8 formats
    with pytest.raises(ValueError, match="float8"):
        dec(q, kb.to(e4), kb)  # only one buffer fp8
    with pytest.raises(ValueError, match="float8"):
        dec(q.to(e4), kb.to(e4), kb.to(e4))  # fp8 queries
    with pytest.raises(ValueError, match="share"):
        dec(q, kb.half(), kb.half())  # non-fp8 buffers must still match q
    for bad in ({"k_scale": 0.0}, {"v_scale": -1.0}, {"k_scale": float("inf")}, {"v_scale": float("nan")}):
        with pytest.raises(ValueError, match="(k|v)_scale must be a finite number > 0"):
            dec(q, kb.to(e4), kb.to(e4), **bad)

    qe = torch.zeros(4, 2, 64, device=DEVICE)
    kve = torch.zeros(4, 1, 64, device=DEVICE)
    buf = torch.zeros(8, 1, 64, device=DEVICE)
    qo = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)

    def ext(k_ext, k, v, **kw):
        extend_attention_fwd(qe, k_ext, k_ext, qe.clone(), k, v, qo, qo, qo, None, True, None, 4, 1.0, **kw)

    with pytest.raises(ValueError, match="float8"):
        ext(kve, buf.to(e4), buf.to(e5))
    with pytest.raises(ValueError, match="float8"):
        ext(kve.to(e4), buf.to(e4), buf.to(e4))  # new tokens must be in q's dtype
    with pytest.raises(ValueError, match="share"):
        ext(kve, buf.bfloat16(), buf.bfloat16())
    with pytest.raises(ValueError, match="(k|v)_scale must be a finite number > 0"):
        ext(kve, buf.to(e5), buf.to(e5), v_scale=0.0)
