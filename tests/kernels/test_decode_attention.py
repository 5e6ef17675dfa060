"""Split-K paged decode attention vs a float64 reference (Triton interpreter on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnserve.attention.triton_ops.decode_attention import DecodeConfig, decode_attention_fwd, decode_config
from attnserve.attention.triton_ops.decode_splits import compute_num_kv_splits
from attnserve.attention.triton_ops.decode_tuning import batch_merge_heads
from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}


def _reference(q, k_buffer, v_buffer, r2t, rows, starts, lens, sm_scale, logit_cap):
    """float64 softmax(q K^T) V per request over slots req_to_token[row, start:len]."""
    bs, hq, _ = q.shape
    hkv = k_buffer.shape[1]
    out = torch.zeros(bs, hq, v_buffer.shape[2], dtype=torch.float64)
    for i in range(bs):
        slots = r2t[rows[i], starts[i] : lens[i]].long()
        if slots.numel() == 0:
            continue
        k = k_buffer[slots].double().repeat_interleave(hq // hkv, dim=1)  # [n, hq, dk]
        v = v_buffer[slots].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * sm_scale
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def _run(gen, paged, device, *, lens, hq, hkv, dk, dv, dtype, page_size, logit_cap=0.0, window=-1,
         max_kv_splits=4, deterministic=False, grid_splits=None, shared_kv=False, config=None):
    bs = len(lens)
    r2t, rows, num_slots = paged(lens, page_size, gen)
    kv_start = [max(n - window - 1, 0) if window >= 0 else 0 for n in lens]
    k_buffer = torch.randn(num_slots, hkv, dk, generator=gen).to(dtype)
    v_buffer = k_buffer[..., :dv] if shared_kv else torch.randn(num_slots, hkv, dv, generator=gen).to(dtype)
    q = torch.randn(bs, hq, dk, generator=gen).to(dtype)
    sm_scale = dk ** -0.5

    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    start_t = torch.tensor(kv_start, dtype=torch.int32, device=device)
    kernel_lens = seq_lens - start_t
    kv_indptr = compute_kv_indptr(kernel_lens)
    kv_indices = torch.empty(int(sum(lens)) + 1, dtype=torch.int32, device=device)
    create_kv_indices(r2t.to(device), rows.to(device), kernel_lens, kv_indptr, start_t if window >= 0 else None, kv_indices)
    num_kv_splits = torch.full((bs,), -1, dtype=torch.int32, device=device)
    compute_num_kv_splits(kernel_lens, num_kv_splits, max_kv_splits, num_sms=8, num_kv_heads=hkv,
                          deterministic=deterministic, split_tile_size=32, min_split_tokens=16)
    o = torch.full((bs, hq, dv), float("nan"), dtype=dtype, device=device)
    attn_logits = torch.full((bs, hq, max_kv_splits, dv), float("nan"), device=device)
    attn_lse = torch.full((bs, hq, max_kv_splits), float("nan"), device=device)
    k_dev = k_buffer.to(device)
    v_dev = k_dev[..., :dv] if shared_kv else v_buffer.to(device)
    decode_attention_fwd(q.to(device), k_dev, v_dev, o, kv_indptr, kv_indices, attn_logits, attn_lse,
                         num_kv_splits, max_kv_splits, sm_scale, logit_cap, grid_splits=grid_splits, config=config)
    ref = _reference(q, k_buffer, v_buffer, r2t, rows, kv_start, lens, sm_scale, logit_cap)
    return o.cpu(), ref, num_kv_splits.cpu()


def _check(out, ref, dtype):
    assert not torch.isnan(out).any(), "some output element was not written"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


LENS = [1, 7, 64, 65, 300, 129]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1), (16, 2)])  # GQA 1, 3, MQA 8, GQA 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_gqa_ratios(hq, hkv, dtype, gen, paged, device):
    out, ref, _ = _run(gen, paged, device, lens=LENS, hq=hq, hkv=hkv, dk=64, dv=64, dtype=dtype, page_size=4)
    _check(out, ref, dtype)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("logit_cap", [0.0, 2.0])
def test_decode_pages_and_logit_cap(page_size, logit_cap, gen, paged, device):
    out, ref, _ = _run(gen, paged, device, lens=[200, 3, 97], hq=6, hkv=2, dk=64, dv=64, dtype=torch.float32,
                       page_size=page_size, logit_cap=logit_cap)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("window", [0, 5, 100])
def test_decode_sliding_window_via_kv_start(window, gen, paged, device):
    out, ref, _ = _run(gen, paged, device, lens=[1, 50, 230], hq=4, hkv=2, dk=64, dv=64, dtype=torch.float16,
                       page_size=4, window=window)
    _check(out, ref, torch.float16)


@pytest.mark.parametrize("dk,dv,hq,hkv,shared", [(80, 80, 3, 1, False), (96, 96, 2, 2, False), (576, 512, 4, 1, True)])
def test_decode_head_dims(dk, dv, hq, hkv, shared, gen, paged, device):
    out, ref, _ = _run(gen, paged, device, lens=[33, 150], hq=hq, hkv=hkv, dk=dk, dv=dv, dtype=torch.float32,
                       page_size=4, shared_kv=shared)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("dk,hq,hkv", [(96, 4, 4), (80, 4, 2)])
def test_decode_whole_dk_tile(dk, hq, hkv, gen, paged, device):
    """``DecodeConfig.whole_dk``: K's odd head size read as one masked power-of-two tile
    (96 -> 128) instead of main + remainder tiles, against the reference."""
    cfg = DecodeConfig(block_n=32, block_h=16, num_warps=4, num_stages=2, whole_dk=True)
    out, ref, _ = _run(gen, paged, device, lens=[1, 45, 130], hq=hq, hkv=hkv, dk=dk, dv=dk, dtype=torch.float32,
                       page_size=4, logit_cap=3.0, config=cfg)
    _check(out, ref, torch.float32)


def test_whole_dk_rule_takes_head_size_96_on_big_shared_memory(monkeypatch):
    """`decode_tuning.WHOLE_DK_TILE`: a 16-bit cache of head size 96 on a GPU with the big shared
    memory reads K whole with the 32-key / 5-stage tile at every batch; fp8 caches, other head
    sizes, small shared memory and the switch off keep the tiles they had."""
    from attnserve.attention.triton_ops import decode_tuning as dtn

    monkeypatch.delenv(dtn.WHOLE_DK_ENV, raising=False)

    def cfg(d=96, dtype=torch.bfloat16, bs=96, smem=227 * 1024, group=1):
        return decode_config(d, group, dtype, max_shared_mem=smem, device_name="NVIDIA H200", batch_size=bs,
                             num_kv_heads=32, num_sms=132)

    for bs in (0, 1, 32, 96, 256):
        c = cfg(bs=bs)
        assert c.whole_dk and (c.block_n, c.num_stages, c.num_warps, c.maxnreg) == dtn.WHOLE_DK_TILE, bs
    assert cfg(group=4).whole_dk
    assert not any(c.whole_dk for c in (cfg(dtype=torch.float8_e4m3fn), cfg(d=128), cfg(d=80), cfg(d=64),
                                        cfg(smem=100 * 1024)))
    monkeypatch.setenv(dtn.WHOLE_DK_ENV, "0")
    off_small, off_batch = cfg(bs=1), cfg(bs=256)
    assert not off_small.whole_dk and (off_small.block_n, off_small.num_stages) == (128, 3)
    assert not off_batch.whole_dk and (off_batch.block_n, off_batch.num_stages) == dtn.BATCH_TILE[:2]


@pytest.mark.parametrize("dk,dv", [(64, 64), (80, 80), (576, 512)])
def test_decode_per_head_reduction_path(dk, dv, gen, paged, device):
    """The tuning option block_h=1 (MHA without tl.dot) against the reference."""
    cfg = DecodeConfig(block_n=32, block_h=1, num_warps=4, num_stages=1)
    out, ref, _ = _run(gen, paged, device, lens=[1, 70, 129], hq=3, hkv=3, dk=dk, dv=dv, dtype=torch.float16,
                       page_size=4, logit_cap=4.0, config=cfg)
    _check(out, ref, torch.float16)


def test_decode_bf16(gen, paged, device):
    out, ref, _ = _run(gen, paged, device, lens=[40, 170], hq=8, hkv=2, dk=64, dv=64, dtype=torch.bfloat16, page_size=4)
    _check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("grid_splits", [1, 2, 8])
def test_decode_split_grid_sizes(grid_splits, gen, paged, device):
    """Programs loop over splits when the grid axis is smaller than a request's splits."""
    out, ref, ns = _run(gen, paged, device, lens=[300, 20, 257], hq=4, hkv=1, dk=64, dv=64, dtype=torch.float32,
                        page_size=1, max_kv_splits=8, grid_splits=grid_splits)
    assert ns.max() > 1
    _check(out, ref, torch.float32)


def test_decode_empty_request_outputs_zero(gen, paged, device):
    out, ref, _ = _run(gen, paged, device, lens=[0, 9, 0], hq=4, hkv=2, dk=64, dv=64, dtype=torch.float32, page_size=1)
    _check(out, ref, torch.float32)
    assert (out[0] == 0).all() and (out[2] == 0).all()


def test_deterministic_is_batch_invariant(gen, paged, device):
    """Deterministic splits: one request's output is bitwise the same alone and in a batch."""
    hq, hkv, d, dtype = 4, 2, 64, torch.float16
    lens = [150, 9, 77, 300]
    r2t, rows, num_slots = paged(lens, 4, gen)
    k_buffer = torch.randn(num_slots, hkv, d, generator=gen).to(dtype).to(device)
    v_buffer = torch.randn(num_slots, hkv, d, generator=gen).to(dtype).to(device)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype).to(device)
    r2t, rows = r2t.to(device), rows.to(device)

    def run(sel):
        seq = torch.tensor([lens[i] for i in sel], dtype=torch.int32, device=device)
        indptr = compute_kv_indptr(seq)
        idx = torch.empty(int(seq.sum()), dtype=torch.int32, device=device)
        create_kv_indices(r2t, rows[sel], seq, indptr, None, idx)
        ns = torch.empty(len(sel), dtype=torch.int32, device=device)
        compute_num_kv_splits(seq, ns, 16, num_sms=8, num_kv_heads=hkv, deterministic=True, split_tile_size=64)
        o = torch.full((len(sel), hq, d), float("nan"), dtype=dtype, device=device)
        logits = torch.empty(len(sel), hq, 16, d, device=device)
        lse = torch.empty(len(sel), hq, 16, device=device)
        decode_attention_fwd(q[sel], k_buffer, v_buffer, o, indptr, idx, logits, lse, ns, 16, d ** -0.5)
        return o.cpu(), ns.cpu()

    alone, ns_alone = run([3])
    batched, ns_batched = run([0, 1, 2, 3])
    assert ns_alone.tolist() == [5] and ns_batched.tolist() == [3, 1, 2, 5]
    assert torch.equal(alone[0], batched[3])


def test_decode_argument_errors(device):
    q = torch.zeros(2, 4, 64, device=device)
    kb = torch.zeros(10, 2, 64, device=device)
    o = torch.zeros(2, 4, 64, device=device)
    ip = torch.zeros(3, dtype=torch.int32, device=device)
    ns = torch.ones(2, dtype=torch.int32, device=device)
    logits = torch.zeros(2, 4, 4, 64, device=device)
    lse = torch.zeros(2, 4, 4, device=device)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_fwd(q[:, :3], kb, kb, o[:, :3], ip, ip, logits[:, :3], lse[:, :3], ns, 4, 1.0)
    with pytest.raises(ValueError, match="attn_logits"):
        decode_attention_fwd(q, kb, kb, o, ip, ip, logits, lse, ns, 8, 1.0)
    with pytest.raises(ValueError, match="share"):
        decode_attention_fwd(q.half(), kb, kb, o, ip, ip, logits, lse, ns, 4, 1.0)


def test_decode_clamps_bad_split_counts(gen, paged, device):
    """num_kv_splits beyond max_kv_splits (a caller bug) is clamped, never written out of bounds."""
    lens, hq, hkv, d, max_splits = [90, 200], 4, 2, 64, 2
    r2t, rows, slots = paged(lens, 1, gen)
    kb = torch.randn(slots, hkv, d, generator=gen).to(device)
    vb = torch.randn(slots, hkv, d, generator=gen).to(device)
    q = torch.randn(2, hq, d, generator=gen)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    indptr = compute_kv_indptr(seq)
    idx = torch.empty(sum(lens), dtype=torch.int32, device=device)
    create_kv_indices(r2t.to(device), rows.to(device), seq, indptr, None, idx)
    ns = torch.tensor([50, 0], dtype=torch.int32, device=device)
    o = torch.full((2, hq, d), float("nan"), device=device)
    logits = torch.full((2, hq, max_splits + 1, d), 7.0, device=device)  # one guard split
    lse = torch.full((2, hq, max_splits + 1), 7.0, device=device)
    decode_attention_fwd(q.to(device), kb, vb, o, indptr, idx, logits, lse, ns, max_splits, d ** -0.5)
    assert (logits[:, :, max_splits].cpu() == 7.0).all() and (lse[:, :, max_splits].cpu() == 7.0).all()
    ref = _reference(q, kb.cpu(), vb.cpu(), r2t, rows, [0, 0], lens, d ** -0.5, 0.0)
    _check(o.cpu(), ref, torch.float32)


@pytest.mark.parametrize("hq,hkv,grid_splits", [(4, 4, None), (8, 1, None), (16, 2, 2), (6, 2, 1), (4, 1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_small_grids_and_empty_requests(hq, hkv, grid_splits, dtype, gen, paged, device):
    """Programs that own several splits (small grid) and requests with 0/1/many splits."""
    out, ref, ns = _run(gen, paged, device, lens=[0, 1, 64, 300, 129, 257], hq=hq, hkv=hkv, dk=64, dv=64,
                        dtype=dtype, page_size=4, max_kv_splits=8, grid_splits=grid_splits)
    assert ns.max() > 1 and ns.min() == 1
    _check(out, ref, dtype)
    assert (out[0] == 0).all()


@pytest.mark.parametrize("kv_dtype,device_name,tile", [
    (torch.bfloat16, "NVIDIA H100 80GB HBM3", "BATCH_TILE"),
    (torch.float8_e4m3fn, "NVIDIA H200", "FP8_HOPPER_BATCH_TILE"),
    (torch.float8_e4m3fn, "NVIDIA A100-SXM4-80GB", None),
])
def test_decode_config_batch_tiles_from_the_program_count(kv_dtype, device_name, tile):
    """`decode_config` switches to the batch tiles at BATCH_PROGRAMS_PER_SM stage-1 programs
    per SM (not one below, not when the count is unknown), for 16-bit caches and for fp8
    caches on an H100 / H200 only; wide heads and small shared memory are unaffected."""
    from attnserve.attention.triton_ops import decode_attention as da

    smem, sms, hkv = 227 * 1024, 132, 8
    small = da.decode_config(128, 4, kv_dtype, max_shared_mem=smem, device_name=device_name)
    at = da.BATCH_PROGRAMS_PER_SM * sms // hkv  # requests (group 4: one head block per KV head)
    below = da.decode_config(128, 4, kv_dtype, max_shared_mem=smem, device_name=device_name,
                             batch_size=at - 1, num_kv_heads=hkv, num_sms=sms)
    unknown = da.decode_config(128, 4, kv_dtype, max_shared_mem=smem, device_name=device_name, batch_size=at,
                               num_kv_heads=hkv)
    big = da.decode_config(128, 4, kv_dtype, max_shared_mem=smem, device_name=device_name, batch_size=at,
                           num_kv_heads=hkv, num_sms=sms)
    assert below == small and unknown == small
    # stage 2's head blocks follow the program count whatever the stage-1 tile (decode_merge)
    assert big.merge_heads == batch_merge_heads() > 1 and small.merge_heads == 1
    big = dataclasses.replace(big, merge_heads=1)
    if tile is None:
        assert big == small
    else:
        assert (big.block_n, big.num_stages, big.num_warps, big.maxnreg) == getattr(da, tile)
        assert (big.block_n, big.num_stages, big.maxnreg) != (small.block_n, small.num_stages, small.maxnreg)
        assert big.block_h == small.block_h and big.v_pairs == small.v_pairs
    for dk, mem in ((576, smem), (128, 100 * 1024)):
        wide = da.decode_config(dk, 4, kv_dtype, max_shared_mem=mem, device_name=device_name, batch_size=at,
                                num_kv_heads=hkv, num_sms=sms)
        assert dataclasses.replace(wide, merge_heads=1) == da.decode_config(dk, 4, kv_dtype, max_shared_mem=mem,
                                                                            device_name=device_name)
