"""merge_state vs a float64 reference, including empty parts (-inf log-sum-exp)."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention.triton_ops.merge_state import merge_state

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def _attn_state(q, k, v):
    """float64 attention of each (t, h) query over its keys: (normalised output, natural-log LSE)."""
    s = torch.einsum("thd,tnhd->thn", q, k)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("thn,tnhd->thd", torch.softmax(s, dim=-1), v)
    return out, lse


def _merge_ref(va, sa, vb, sb):
    """float64 merge by log-sum-exp; an empty part (-inf) contributes nothing."""
    s = torch.logaddexp(sa, sb)
    wa = torch.where(sa == float("-inf"), 0.0, torch.exp(sa - s)).nan_to_num(0.0)
    wb = torch.where(sb == float("-inf"), 0.0, torch.exp(sb - s)).nan_to_num(0.0)
    va = torch.where(wa[..., None] > 0, va, 0.0)
    vb = torch.where(wb[..., None] > 0, vb, 0.0)
    return wa[..., None] * va + wb[..., None] * vb, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,h,d", [(5, 3, 64), (7, 32, 128), (2, 4, 80)])
def test_merge_state_matches_attention_over_union(dtype, t, h, d, gen, device):
    na, nb = 6, 9
    q = torch.randn(t, h, d, generator=gen, dtype=torch.float64) * 0.3
    k = torch.randn(t, na + nb, h, d, generator=gen, dtype=torch.float64)
    v = torch.randn(t, na + nb, h, d, generator=gen, dtype=torch.float64)
    va, sa = _attn_state(q, k[:, :na], v[:, :na])
    vb, sb = _attn_state(q, k[:, na:], v[:, na:])
    ref_v, ref_s = _attn_state(q, k, v)
    # empty parts: (0, 1) a empty, (1, 0) b empty, (2, 2) both empty
    va[0, 1] = float("nan")  # junk in an empty part must be ignored
    sa[0, 1] = float("-inf")
    ref_v[0, 1], ref_s[0, 1] = vb[0, 1], sb[0, 1]
    sb[1, 0] = float("-inf")
    vb[1, 0] = 123.0
    ref_v[1, 0], ref_s[1, 0] = va[1, 0], sa[1, 0]
    if t > 2 and h > 2:
        sa[2, 2] = sb[2, 2] = float("-inf")
        ref_v[2, 2], ref_s[2, 2] = 0.0, float("-inf")

    if dtype == torch.float32:  # the merge of the parts is the attention over the union
        merged_v, merged_s = _merge_ref(va, sa, vb, sb)
        torch.testing.assert_close(merged_v, ref_v, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(merged_s, ref_s, atol=1e-12, rtol=1e-12)
    va_in, vb_in = va.to(dtype), vb.to(dtype)
    ref_v, ref_s = _merge_ref(va_in.double(), sa.float().double(), vb_in.double(), sb.float().double())

    v_out = torch.full((t, h, d), float("nan"), dtype=dtype, device=device)
    s_out = torch.full((t, h), float("nan"), device=device)
    got_v, got_s = merge_state(va_in.to(device), sa.float().to(device), vb_in.to(device), sb.float().to(device),
                               v_out, s_out)
    assert got_v.data_ptr() == v_out.data_ptr() and got_s.data_ptr() == s_out.data_ptr()
    got_v, got_s = got_v.cpu(), got_s.cpu()
    assert not torch.isnan(got_v).any() and not torch.isnan(got_s).any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got_v.double(), ref_v, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_s.double(), ref_s, atol=1e-5, rtol=1e-5)


def test_merge_state_strided_and_allocating(gen, device):
    t, h, d = 6, 5, 64
    big = torch.randn(t, 2 * h, d, generator=gen)
    va, vb = big[:, :h], big[:, h:]  # non-contiguous head stride
    sa = torch.randn(t, 2 * h, generator=gen)[:, ::2]  # strided LSE
    sb = torch.randn(t, h, generator=gen)
    got_v, got_s = merge_state(va.to(device), sa.to(device), vb.to(device), sb.to(device))
    wa = torch.sigmoid(sa.double() - sb.double())[..., None]
    ref_v = wa * va.double() + (1 - wa) * vb.double()
    ref_s = torch.logaddexp(sa.double(), sb.double())
    torch.testing.assert_close(got_v.cpu().double(), ref_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_s.cpu().double(), ref_s, atol=1e-5, rtol=1e-5)


def test_merge_state_in_place_into_a(gen, device):
    t, h, d = 3, 2, 32
    va = torch.randn(t, h, d, generator=gen).to(device)
    vb = torch.randn(t, h, d, generator=gen).to(device)
    sa = torch.randn(t, h, generator=gen).to(device)
    sb = torch.randn(t, h, generator=gen).to(device)
    w = torch.sigmoid(sa.double() - sb.double()).cpu()[..., None]
    ref = w * va.cpu().double() + (1 - w) * vb.cpu().double()
    ref_s = torch.logaddexp(sa.cpu().double(), sb.cpu().double())
    merge_state(va, sa, vb, sb, va, sa)
    torch.testing.assert_close(va.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sa.cpu().double(), ref_s, atol=1e-5, rtol=1e-5)


def test_merge_state_errors(device):
    v = torch.zeros(2, 3, 8, device=device)
    s = torch.zeros(2, 3, device=device)
    with pytest.raises(ValueError, match="float32"):
        merge_state(v, s.half(), v, s)
    with pytest.raises(ValueError, match="s_a and s_b"):
        merge_state(v, s[:1], v, s)
    with pytest.raises(ValueError, match="v_a and v_b"):
        merge_state(v, s, v[:1], s)
