"""The small-batch decode rule (issues 37/38): one-tile splits while they fit in one wave
(`compute_num_kv_splits`'s ``small_split_tokens``), the vectorised split merge of stage 2
(`decode_merge`, ``DecodeConfig.merge_block``) and the PDL choice of `decode_config`;
kernels against a float64 reference under the Triton interpreter (or the GPU when there is
one), split counts hand-computed."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention.triton_ops.decode_attention import DecodeConfig, decode_attention_fwd, decode_config
from attnserve.attention.triton_ops.decode_merge import MAX_SPLIT_BLOCK, merge_split_block
from attnserve.attention.triton_ops.decode_splits import SMALL_SPLIT_TOKENS, compute_num_kv_splits
from attnserve.attention.triton_ops.decode_tuning import PDL_ALL_ENV, SMALL_BATCH_ENV
from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

H100_SMS = 132


def _splits(lens, device, heads=8, max_kv_splits=32, num_sms=H100_SMS, **kw):
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.full((len(lens),), -7, dtype=torch.int32, device=device)
    compute_num_kv_splits(seq, out, max_kv_splits, num_sms, heads, **kw)
    return out.cpu().tolist()


def test_small_split_rule_counts(device):
    """H100, Llama-3-8B heads (8 KV heads: 132 // 8 = 16 one-tile units). bs 1 x 576: the
    whole-wave rule gives 576 // 128 = 4 (stage 1 then cuts 3 splits of 256/256/64 keys),
    the small rule cdiv(576, 128) = 5 one-tile splits; 2048 = 16 tiles fits (16 either
    way); 4096 = 32 tiles does not (whole-wave rule: 32); 8 x 2048 does not (128 tiles).
    tp 4 (2 KV heads, 66 units): 8192 = 64 tiles fits, capped at max_kv_splits 32. Empty and
    one-key requests take one split; deterministic mode ignores the rule."""
    small = {"small_split_tokens": SMALL_SPLIT_TOKENS}
    assert _splits([576], device) == [4] and _splits([576], device, **small) == [5]
    assert _splits([2048], device, **small) == [16]
    assert _splits([4096], device, **small) == _splits([4096], device) == [32]
    assert _splits([2048] * 8, device, **small) == _splits([2048] * 8, device)
    assert _splits([8192], device, heads=2, **small) == [32]
    assert _splits([0, 1, 300, 129], device, **small) == [1, 1, 3, 2]
    det = {"deterministic": True, "split_tile_size": 256}
    assert _splits([576, 1], device, **det, **small) == _splits([576, 1], device, **det) == [3, 1]
    with pytest.raises(ValueError, match="small_split_tokens"):
        _splits([5], device, small_split_tokens=-1)


def test_decode_config_small_batch_rule(monkeypatch):
    """Rule on (default): merge 32 splits a step; PDL from one to num_sms stage-1 programs at
    one split a request (bs x KV heads x head blocks), not when any count is unknown (0, as
    batch-invariant callers pass). Rule off: merge_block 1 and no PDL, tiles unchanged."""
    smem, name = 227 * 1024, "NVIDIA H100 80GB HBM3"

    def cfg(bs, heads=8, sms=H100_SMS):
        return decode_config(128, 4, torch.bfloat16, max_shared_mem=smem, device_name=name, batch_size=bs,
                             num_kv_heads=heads, num_sms=sms)

    monkeypatch.delenv(SMALL_BATCH_ENV, raising=False)
    monkeypatch.delenv(PDL_ALL_ENV, raising=False)
    assert cfg(1).pdl and cfg(16).pdl and cfg(66, heads=2).pdl
    assert not cfg(17).pdl and not cfg(0).pdl and not cfg(1, sms=0).pdl
    assert cfg(1).merge_block == cfg(64).merge_block == MAX_SPLIT_BLOCK
    tiles = {bs: (cfg(bs).block_n, cfg(bs).num_stages) for bs in (17, 1024)}
    monkeypatch.setenv(PDL_ALL_ENV, "1")  # opt-in: PDL at every batch, tiles unchanged
    assert cfg(17).pdl and cfg(1024).pdl and cfg(0).pdl
    assert {bs: (cfg(bs).block_n, cfg(bs).num_stages) for bs in (17, 1024)} == tiles
    monkeypatch.delenv(PDL_ALL_ENV)
    assert not cfg(1024).pdl
    monkeypatch.setenv(SMALL_BATCH_ENV, "0")
    monkeypatch.setenv(PDL_ALL_ENV, "1")  # the rule off wins: the kernels as before the rule
    off = cfg(1)
    assert off.merge_block == 1 and not off.pdl
    assert (off.block_n, off.num_stages, off.block_h) == (cfg(0).block_n, cfg(0).num_stages, cfg(0).block_h)


def test_merge_split_block():
    assert merge_split_block(32, 32) == 32 and merge_split_block(32, 5) == 8 and merge_split_block(1, 32) == 1
    assert merge_split_block(64, 128) == MAX_SPLIT_BLOCK and merge_split_block(3, 32) == 4
    assert merge_split_block(0, 0) == 1
    assert merge_split_block(32, 32, block_dv=512) == 16 and merge_split_block(32, 32, block_dv=256) == 32


def _reference(q, kb, vb, slots_per_req, sm_scale):
    bs, hq, _ = q.shape
    group = hq // kb.shape[1]
    out = torch.zeros(bs, hq, vb.shape[2], dtype=torch.float64)
    for i, slots in enumerate(slots_per_req):
        if slots.numel() == 0:
            continue
        k = kb[slots].double().repeat_interleave(group, dim=1)
        v = vb[slots].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * sm_scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


# (KV heads, group): GQA ratios 1, 4 and 8
@pytest.mark.parametrize("hkv,group,page_size,merge_block", [(2, 1, 1, 32), (1, 4, 16, 4), (1, 8, 1, 32),
                                                             (1, 8, 16, 1)])
def test_small_rule_kernels_match_float64(hkv, group, page_size, merge_block, gen, paged, device):
    """Ragged lengths with 0 and 1 key; 16-key tiles and one-tile splits (the small rule at
    16 tokens on a pretend 64-SM GPU), so the 90-key request has 6 splits: stage 2 merges
    them in one step (merge_block 32), in two (4) or one at a time (1)."""
    lens, d, max_splits = [0, 1, 90, 17, 33], 32, 8
    r2t, rows, num_slots = paged(lens, page_size, gen)
    kb = torch.randn(num_slots, hkv, d, generator=gen).to(torch.float16)
    vb = torch.randn(num_slots, hkv, d, generator=gen).to(torch.float16)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(torch.float16)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    indptr = compute_kv_indptr(seq)
    idx = torch.empty(sum(lens), dtype=torch.int32, device=device)
    create_kv_indices(r2t.to(device), rows.to(device), seq, indptr, None, idx)
    ns = torch.empty(len(lens), dtype=torch.int32, device=device)
    compute_num_kv_splits(seq, ns, max_splits, 64, hkv, small_split_tokens=16)
    assert ns.cpu().tolist() == [1, 1, 6, 2, 3]
    cfg = DecodeConfig(block_n=16, block_h=16, num_warps=4, num_stages=1, merge_block=merge_block)
    o = torch.full((len(lens), hkv * group, d), float("nan"), dtype=torch.float16, device=device)
    logits = torch.full((len(lens), hkv * group, max_splits, d), float("nan"), device=device)
    lse = torch.full((len(lens), hkv * group, max_splits), float("nan"), device=device)
    decode_attention_fwd(q.to(device), kb.to(device), vb.to(device), o, indptr, idx, logits, lse, ns, max_splits,
                         d ** -0.5, config=cfg)
    slots = [r2t[rows[i], : lens[i]].long() for i in range(len(lens))]
    ref = _reference(q, kb, vb, slots, d ** -0.5)
    out = o.cpu()
    assert not torch.isnan(out).any()
    assert (out[0] == 0).all()
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)


def test_backend_passes_the_small_rule(monkeypatch, device):
    """The triton backend's decode metadata: one-tile splits with the rule on, the
    whole-wave rule with ATTNSERVE_DECODE_SMALL_BATCH=0 (pretend GPU of 132 SMs)."""
    import os

    from attention_harness import backend_config, make_batch
    from attnserve.attention.triton_backend import TritonAttnBackend
    from attnserve.forward_batch import ForwardMode

    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    case = make_batch(ForwardMode.DECODE, [575], [1], 8, 8, 16, 1, seed=3, device=str(device))
    counts = {}
    for env in ("1", "0"):
        monkeypatch.setenv(SMALL_BATCH_ENV, env)
        backend = TritonAttnBackend(backend_config(case, num_sms=H100_SMS))
        backend.init_forward_metadata(case.fb)
        counts[env] = backend.forward_metadata.num_kv_splits.cpu().tolist()
    assert counts == {"1": [5], "0": [4]}
