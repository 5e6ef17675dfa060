"""Stage 2 of decode attention with several query heads per program (`decode_merge`,
``merge_heads``; the batch tiles' default, `decode_tuning.batch_merge_heads`): against a
float64 log-sum-exp merge of the same partials and against the one-head kernel, under the
Triton interpreter (or on the GPU when there is one).

Bound: every output is a convex combination of float32 partials (weights exp(lse - max) /
sum), so float32 rounding of the weights and the sum is a few ulps of the partials'
magnitude (~1): 1e-5 absolute fails for a wrong weight, split or head (those move outputs
by O(1)); the two kernels differ only in the order of that sum."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention.triton_ops.decode_attention import decode_config
from attnserve.attention.triton_ops.decode_merge import decode_stage2
from attnserve.attention.triton_ops.decode_tuning import BATCH_MERGE_HEADS, MERGE_HEADS_ENV, batch_merge_heads


def _case(device, bs, hq, dv, max_splits, gen):
    """Random partials / LSEs, request lengths giving 1..max_splits splits of 16 keys, and
    the float64 merge (requests with one split keep ``o``'s sentinel: stage 1 wrote them)."""
    splits = torch.randint(1, max_splits + 1, (bs,), generator=gen)
    splits[0] = 1
    lens = splits * 16 - torch.randint(0, 15, (bs,), generator=gen)
    indptr = torch.zeros(bs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    logits = torch.randn(bs, hq, max_splits, dv, generator=gen)
    lse = torch.randn(bs, hq, max_splits, generator=gen) * 3
    want = torch.full((bs, hq, dv), -5.0, dtype=torch.float64)
    for b in range(bs):
        n = int(splits[b])
        if n > 1:
            w = torch.softmax(lse[b, :, :n].double(), dim=-1)
            want[b] = (w[:, :, None] * logits[b, :, :n].double()).sum(1)
    dev = [t.to(device) for t in (logits, lse, indptr, splits.to(torch.int32))]
    return dev, want


@pytest.mark.parametrize("bs,hq,dv,max_splits,heads", [(5, 32, 128, 3, 8), (4, 12, 64, 9, 8), (3, 16, 128, 40, 4),
                                                       (3, 6, 64, 5, 16)])
def test_head_blocks_match_float64_and_one_head(device, gen, bs, hq, dv, max_splits, heads):
    """Head counts that are not a multiple of the block (12, 6: masked rows), more splits
    than one split block holds (40 at 4 heads x 128: blocks of 16), one-split requests left
    untouched."""
    (logits, lse, indptr, splits), want = _case(device, bs, hq, dv, max_splits, gen)
    outs = []
    for merge_heads in (heads, 1):
        o = torch.full((bs, hq, dv), -5.0, device=device)
        decode_stage2(logits, lse, o, indptr, splits, max_splits, split_align=16, merge_block=32, num_warps=2,
                      merge_heads=merge_heads)
        outs.append(o.cpu().double())
        assert (o.cpu().double() - want).abs().max().item() < 1e-5, merge_heads
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5


def test_batch_tiles_take_head_blocks(monkeypatch):
    """H100, Llama-3-8B heads: 144 requests (1,152 stage-1 programs >= 8 per SM) merge
    `BATCH_MERGE_HEADS` heads a program; 64 requests, unknown counts (batch-invariant
    callers pass 0) and the rule switched off keep one head; the override is read per call
    and checked."""
    def cfg(bs, sms=132):
        return decode_config(128, 4, torch.bfloat16, max_shared_mem=227 * 1024, device_name="NVIDIA H100 80GB HBM3",
                             batch_size=bs, num_kv_heads=8, num_sms=sms)

    monkeypatch.delenv(MERGE_HEADS_ENV, raising=False)
    monkeypatch.delenv("ATTNSERVE_DECODE_SMALL_BATCH", raising=False)
    assert cfg(144).merge_heads == BATCH_MERGE_HEADS == batch_merge_heads() == 16
    assert cfg(64).merge_heads == 1 and cfg(0).merge_heads == 1 and cfg(144, sms=0).merge_heads == 1
    monkeypatch.setenv(MERGE_HEADS_ENV, "2")
    assert cfg(144).merge_heads == 2
    monkeypatch.setenv("ATTNSERVE_DECODE_SMALL_BATCH", "0")
    assert cfg(144).merge_heads == 1
    monkeypatch.delenv("ATTNSERVE_DECODE_SMALL_BATCH")
    for bad in ("0", "x", "-3"):
        monkeypatch.setenv(MERGE_HEADS_ENV, bad)
        with pytest.raises(ValueError, match=MERGE_HEADS_ENV):
            cfg(144)
