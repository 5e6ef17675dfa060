"""RMSNorm, RoPE and SiluAndMul against float64 formulas and HF transformers' Llama modules."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from attnserve.models.layers.activation import SiluAndMul
from attnserve.models.layers.norm import RMSNorm
from attnserve.models.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    base.update(kw)
    return LlamaConfig(**base)


# ---- RMSNorm --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rmsnorm_matches_float64_formula(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype) * 3
    norm = RMSNorm(96, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    x64, w64 = x.double(), norm.weight.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_rmsnorm_matches_hf_and_residual_form():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    ours, hf = RMSNorm(64, eps=1e-6), LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        w = torch.randn(64, generator=g)
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=1e-6)
    normed, s = ours(x, r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(normed, hf(x + r), atol=1e-6, rtol=1e-6)


# ---- activation -----------------------------------------------------------------------
def test_silu_and_mul():
    x = torch.randn(3, 2 * 40, dtype=torch.float64)
    gate, up = x[:, :40], x[:, 40:]
    torch.testing.assert_close(SiluAndMul()(x), gate / (1 + torch.exp(-gate)) * up)


# ---- RoPE -----------------------------------------------------------------------------
def _rope_ref64(x, positions, inv_freq, rotary_dim, neox):
    """float64 RoFormer rotation of ``x`` ``[T, H, D]``: pair (a, b) -> (a cos - b sin, b cos + a sin)."""
    x = x.double()
    ang = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, rot/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    rot = x[..., :rotary_dim]
    if neox:
        a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return torch.cat([out, x[..., rotary_dim:]], -1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_matches_float64_formula(neox, rotary_dim):
    head_dim, hq, hk, base = 64, 4, 2, 10000.0
    rope = RotaryEmbedding(head_dim, rotary_dim, 2048, base, is_neox_style=neox)
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 1, 2, 17, 500, 2047, 3, 3])
    q = torch.randn(len(positions), hq * head_dim, generator=g)
    k = torch.randn(len(positions), hk, head_dim, generator=g)  # 3-D input is accepted too
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    q_out, k_out = rope(positions, q, k)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    ref_q = _rope_ref64(q.view(-1, hq, head_dim), positions, inv_freq, rotary_dim, neox).view_as(q)
    ref_k = _rope_ref64(k, positions, inv_freq, rotary_dim, neox)
    # float32 angles at position 2047 carry ~1e-4 relative phase error
    torch.testing.assert_close(q_out.double(), ref_q, atol=2e-4, rtol=0)
    torch.testing.assert_close(k_out.double(), ref_k, atol=2e-4, rtol=0)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_of_fused_qkv_views_matches_separate_tensors(neox, rotary_dim):
    # q and k as adjacent column blocks of one qkv output take the one-rotation path
    head_dim, hq, hk = 64, 4, 2
    rope = RotaryEmbedding(head_dim, rotary_dim, 1024, 10000.0, is_neox_style=neox)
    g = torch.Generator().manual_seed(5)
    positions = torch.tensor([0, 3, 900, 17, 5])
    qkv = torch.randn(len(positions), (hq + 2 * hk) * head_dim, generator=g)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    before = qkv.clone()
    q_out, k_out = rope(positions, q, k)
    q_ref, k_ref = rope(positions, q.contiguous(), k.contiguous())  # two separate tensors
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert torch.equal(qkv, before)  # out of place: the qkv output (and v in it) untouched


def test_rope_reuses_a_lookup_only_for_the_same_unchanged_positions():
    rope = RotaryEmbedding(64, 64, 512, 10000.0)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 128, generator=g)
    pos = torch.tensor([1, 2, 3])

    def fresh(p):  # the rotation computed by a module that has never seen ``p``
        return RotaryEmbedding(64, 64, 512, 10000.0)(p.clone(), q, None)[0]

    assert torch.equal(rope(pos, q, None)[0], fresh(pos))
    assert torch.equal(rope(pos, q, None)[0], fresh(pos))  # reused lookup, same values
    pos[1] = 400  # in place: the step's positions buffer rewritten
    assert torch.equal(rope(pos, q, None)[0], fresh(pos))
    other = torch.tensor([7, 8, 9])
    assert torch.equal(rope(other, q, None)[0], fresh(other))


def test_rope_keeps_dtype_bf16():
    rope = RotaryEmbedding(64, 64, 128, 10000.0)
    q = torch.randn(3, 128, dtype=torch.bfloat16)
    q_out, k_out = rope(torch.tensor([0, 5, 9]), q, None)
    assert q_out.dtype == torch.bfloat16 and k_out is None
    torch.testing.assert_close(q_out[0], q[0])  # position 0 is the identity


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ],
)
def test_rope_matches_hf_llama(rope_scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    kw = {"rope_theta": 500000.0}
    if rope_scaling:
        kw["rope_scaling"] = rope_scaling
    cfg = _llama_config(**kw)
    ours = get_rope(64, cfg.max_position_embeddings, rope_parameters_from_config(cfg))
    hf = LlamaRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 1, 100, 1023, 1024, 3000, 4095])
    q = torch.randn(len(positions), 4, 64, generator=g)
    k = torch.randn(len(positions), 2, 64, generator=g)
    cos, sin = hf(q, positions[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, hq[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, hk[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_llama3_inv_freq_matches_meta_reference():
    params = {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = get_rope(128, 16, params)
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    ref = []  # Meta's apply_scaling, written out in float64
    for f in base.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            ref.append(f)
        elif wavelen > 8192 / 1.0:
            ref.append(f / 8.0)
        else:
            s = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            ref.append((1 - s) * f / 8.0 + s * f)
    angle = torch.atan2(rope.cos_sin_cache[1, 64:], rope.cos_sin_cache[1, :64]).double()  # position 1
    torch.testing.assert_close(angle, torch.tensor(ref, dtype=torch.float64), atol=1e-6, rtol=1e-5)


def test_rope_is_graph_capturable():
    """No data-dependent Python branching: dynamo traces it as one graph."""
    rope = RotaryEmbedding(64, 64, 256, 10000.0)
    compiled = torch.compile(rope, backend="eager", fullgraph=True)
    pos = torch.tensor([3, 4, 200])
    q, k = torch.randn(3, 128), torch.randn(3, 64)
    for a, b in zip(compiled(pos, q, k), rope(pos, q, k)):
        torch.testing.assert_close(a, b)


def test_rope_parameters_from_configs():
    # transformers >= 5: rope_parameters
    p = rope_parameters_from_config(_llama_config(rope_theta=123.0))
    assert p["rope_theta"] == 123.0 and p["rope_type"] == "default"
    # legacy attribute style (e.g. a SimpleNamespace or an old config object)
    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    p = rope_parameters_from_config(legacy)
    assert p["rope_theta"] == 5e5 and p["rope_type"] == "linear" and p["factor"] == 2.0
    assert rope_parameters_from_config(SimpleNamespace())["rope_theta"] == 10000.0
    # per layer type (Gemma 3)
    from transformers import Gemma3TextConfig

    gcfg = Gemma3TextConfig()
    assert rope_parameters_from_config(gcfg, "full_attention")["rope_theta"] == 1e6
    assert rope_parameters_from_config(gcfg, "sliding_attention")["rope_theta"] == 1e4
    with pytest.raises(ValueError, match="per layer type"):
        rope_parameters_from_config(gcfg)


def test_unknown_rope_type_lists_supported():
    with pytest.raises(ValueError, match="llama3"):
        get_rope(64, 16, {"rope_type": "nonsense", "rope_theta": 1.0})


def test_rope_table_stays_float32_when_module_is_cast():
    rope = RotaryEmbedding(64, 64, 32, 10000.0)
    ref = rope.cos_sin_cache.clone()
    parent = torch.nn.ModuleDict({"a": rope, "b": rope}).to(torch.bfloat16)
    assert parent["a"].cos_sin_cache.dtype == torch.float32
    assert torch.equal(parent["a"].cos_sin_cache, ref)
