"""`attention.mla_expanded_prefix`: the cost rule that sends an MLA extend step with cached
prefixes to the expanded form, and the prefix plan (slots in request order, CSR)."""

import pytest
import torch

from attnserve.attention.mla_expanded_prefix import (
    MAX_EXPANDED_PREFIX_BYTES,
    expanded_prefix_worthwhile,
    gather_prefix_latent,
    plan_expanded_prefix,
)

# DeepSeek-V2-Lite's MLA dims: 16 heads, kv_lora_rank 512, nope 128, rope 64, v 128
LITE = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def test_rule_by_pairs_per_prefix_token():
    # a prefill chunk: 14 fresh prompts and one carried over with a 500-token prefix
    assert expanded_prefix_worthwhile([0] * 14 + [500], [570] * 14 + [500], setting="", **LITE)
    # a long prompt after a radix hit
    assert expanded_prefix_worthwhile([2000], [1200], setting="", **LITE)
    # a few tokens over a long prefix stays absorbed
    assert not expanded_prefix_worthwhile([4000], [20], setting="", **LITE)
    # the boundary: S * 2 * (1088 - 320) >= 2 * 2 * 512 * 256 * P  <=>  S >= 341.33 P
    p = 300
    need = 2.0 * 2 * 512 * 256 * p / (2 * (1088 - 320))
    e = next(e for e in range(1, 2000) if e * (p + e / 2) >= need)
    assert expanded_prefix_worthwhile([p], [e], setting="", **LITE)
    assert not expanded_prefix_worthwhile([p], [e - 1], setting="", **LITE)


def test_rule_switch_and_size_cap():
    assert not expanded_prefix_worthwhile([500], [5000], setting="0", **LITE)
    assert expanded_prefix_worthwhile([4000], [1], setting="1", **LITE)
    assert not expanded_prefix_worthwhile([0, 0], [100, 100], setting="1", **LITE)  # nothing cached
    per_token = 16 * (192 + 128 + 128) * 2
    cap = MAX_EXPANDED_PREFIX_BYTES // per_token
    assert expanded_prefix_worthwhile([cap], [1], setting="1", **LITE)
    assert not expanded_prefix_worthwhile([cap + 1], [10**6], setting="1", **LITE)
    assert not expanded_prefix_worthwhile([cap + 1], [10**6], setting="", **LITE)


def test_rule_reads_the_environment(monkeypatch):
    monkeypatch.setenv("ATTNSERVE_MLA_EXPANDED_PREFIX", "0")
    assert not expanded_prefix_worthwhile([500], [5000], **LITE)
    monkeypatch.setenv("ATTNSERVE_MLA_EXPANDED_PREFIX", "1")
    assert expanded_prefix_worthwhile([4000], [1], **LITE)
    monkeypatch.delenv("ATTNSERVE_MLA_EXPANDED_PREFIX")
    assert not expanded_prefix_worthwhile([4000], [1], **LITE)


def test_plan_and_gather_follow_req_to_token():
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randperm(6 * 40, generator=g).view(6, 40).to(torch.int32)
    rows = torch.tensor([4, 1, 3])
    prefix_lens = [7, 0, 12]
    plan = plan_expanded_prefix(prefix_lens, rows, req_to_token)
    want = torch.cat([req_to_token[4, :7], req_to_token[3, :12]]).to(torch.int64)
    assert torch.equal(plan.slots, want)
    # the step's own int32 lengths tensor (what the model passes) gives the same plan
    same = plan_expanded_prefix(prefix_lens, rows, req_to_token, torch.tensor(prefix_lens, dtype=torch.int32))
    assert torch.equal(same.slots, want) and torch.equal(same.kv_indptr, plan.kv_indptr)
    assert plan.kv_indptr.tolist() == [0, 7, 7, 19] and plan.kv_indptr.dtype == torch.int32
    assert torch.equal(plan.kv_indices, torch.arange(19, dtype=torch.int32)) and plan.num_tokens == 19
    latent = torch.randn(240, 1, 10, generator=g)
    rows_out = gather_prefix_latent(latent, plan, 1.0, torch.float64)
    assert rows_out.dtype == torch.float64 and torch.equal(rows_out, latent[want, 0].double())


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 dtype")
def test_gather_dequantises_fp8():
    latent = (torch.randn(16, 1, 8) * 4).to(torch.float8_e4m3fn)
    plan = plan_expanded_prefix([5], torch.tensor([0]), torch.arange(16, dtype=torch.int32).view(1, 16))
    out = gather_prefix_latent(latent, plan, 0.5, torch.float32)
    assert torch.equal(out, latent[:5, 0].float() * 0.5)
