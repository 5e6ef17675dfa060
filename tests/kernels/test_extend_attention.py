"""Extend attention (cached paged prefix + new tokens) vs a float64 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnserve.attention.triton_ops.extend_attention as ext_mod
from attnserve.attention.triton_ops.extend_attention import extend_attention_fwd, extend_config
from attnserve.attention.triton_ops.kv_indices import compute_kv_indptr, create_kv_indices

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}


def _reference(q, k_ext, v_ext, k_buf, v_buf, qo, prefix_slots, prefix_start, masks, is_causal, window, sm_scale, cap,
               mask_covers_prefix=True):
    """float64 attention; keys = prefix (positions prefix_start + j) then new tokens.
    ``masks[i]``: ``[e, plen + e]`` (``mask_covers_prefix``) or ``[e, e]`` over the new
    tokens with every prefix key visible."""
    hq, hkv = q.shape[1], k_ext.shape[1]
    out = torch.zeros(q.shape[0], hq, v_ext.shape[2], dtype=torch.float64)
    for i, slots in enumerate(prefix_slots):
        a, b = qo[i], qo[i + 1]
        n_pre, e = slots.numel(), b - a
        plen = prefix_start[i] + n_pre
        k = torch.cat([k_buf[slots.long()], k_ext[a:b]]).double().repeat_interleave(hq // hkv, dim=1)
        v = torch.cat([v_buf[slots.long()], v_ext[a:b]]).double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k) * sm_scale
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        k_pos = torch.cat([torch.arange(prefix_start[i], plen), torch.arange(plen, plen + e)])
        q_pos = torch.arange(plen, plen + e)
        if masks is not None and mask_covers_prefix:
            vis = masks[i].view(e, plen + e)[:, k_pos]
        elif masks is not None:
            vis = torch.cat([torch.ones(e, n_pre, dtype=torch.bool), masks[i].view(e, e)], dim=1)
        elif is_causal:
            vis = k_pos[None, :] <= q_pos[:, None]
        else:
            vis = torch.ones(e, k_pos.numel(), dtype=torch.bool)
        if window >= 0:
            vis = vis & (k_pos[None, :] >= q_pos[:, None] - window)
        s = s.masked_fill(~vis, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def _run(gen, paged, device, *, prefix, ext, hq, hkv, dk=64, dv=64, dtype=torch.float32, page_size=1,
         is_causal=True, window=-1, logit_cap=0.0, prefix_start=None, mask_kind=None, variants=(), has_prefix=True):
    """Run the kernel (default config) on seeded inputs and the float64 reference ->
    ``(out, ref)``; with ``variants`` (`ExtendConfig` s) also ``[out of each variant]`` on the
    same inputs, third. ``has_prefix``: the launch hint (False only with all prefixes 0)."""
    bs = len(ext)
    r2t, rows, num_slots = paged(prefix, page_size, gen)
    prefix_start = prefix_start or [0] * bs
    k_buf = torch.randn(num_slots, hkv, dk, generator=gen).to(dtype)
    v_buf = torch.randn(num_slots, hkv, dv, generator=gen).to(dtype)
    t = sum(ext)
    q = torch.randn(t, hq, dk, generator=gen).to(dtype)
    k_ext = torch.randn(t, hkv, dk, generator=gen).to(dtype)
    v_ext = torch.randn(t, hkv, dv, generator=gen).to(dtype)
    qo = [0]
    for e in ext:
        qo.append(qo[-1] + e)

    masks = None
    if mask_kind is not None:
        masks = []
        for i, e in enumerate(ext):
            plen = prefix_start[i] + prefix[i]
            m = torch.rand(e, plen + e, generator=gen) < 0.6
            if mask_kind == "tree":  # speculative tree: all prefix visible, random ancestors, self visible
                m[:, :plen] = True
                m[:, plen:] &= torch.ones(e, e, dtype=torch.bool).tril()
                m[:, plen:] |= torch.eye(e, dtype=torch.bool)
            if e > 1:
                m[1] = False  # a query that sees nothing must output zeros
            masks.append(m)
    mask_flat = torch.cat([m.reshape(-1) for m in masks]) if masks else None
    mask_indptr = None
    if masks:
        offs = [0]
        for m in masks:
            offs.append(offs[-1] + m.numel())
        mask_indptr = torch.tensor(offs[:-1], dtype=torch.int64, device=device)

    prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=device)
    kv_indptr = compute_kv_indptr(prefix_lens)
    kv_indices = torch.empty(sum(prefix) + 1, dtype=torch.int32, device=device)
    create_kv_indices(r2t.to(device), rows.to(device), prefix_lens, kv_indptr, None, kv_indices)
    prefix_slots = [r2t[rows[i], : prefix[i]] for i in range(bs)]

    sm_scale = dk ** -0.5
    outs = []
    for cfg in (None,) + tuple(variants):
        o = torch.full((t, hq, dv), float("nan"), dtype=dtype, device=device)
        extend_attention_fwd(
            q.to(device), k_ext.to(device), v_ext.to(device), o, k_buf.to(device), v_buf.to(device),
            torch.tensor(qo, dtype=torch.int32, device=device), kv_indptr, kv_indices,
            mask_flat.to(device) if mask_flat is not None else None, is_causal, mask_indptr, max(ext), sm_scale,
            logit_cap, window,
            torch.tensor(prefix_start, dtype=torch.int32, device=device) if any(prefix_start) else None,
            config=cfg, has_prefix=has_prefix,
        )
        outs.append(o.cpu())
    ref = _reference(q, k_ext, v_ext, k_buf, v_buf, qo, prefix_slots, prefix_start, masks, is_causal, window,
                     sm_scale, logit_cap)
    return (outs[0], ref, outs[1:]) if variants else (outs[0], ref)


def _check(out, ref, dtype):
    assert not torch.isnan(out).any(), "some output element was not written (or NaN)"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


# ragged: prefix 0..n, extend lengths around the interpreter tiles (BLOCK_M 32, BLOCK_N 16)
PREFIX = [0, 5, 40, 17]
EXT = [70, 1, 33, 16]


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_causal_gqa(hq, hkv, dtype, gen, paged, device):
    out, ref = _run(gen, paged, device, prefix=PREFIX, ext=EXT, hq=hq, hkv=hkv, dtype=dtype, page_size=4)
    _check(out, ref, dtype)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_non_causal_pages(page_size, gen, paged, device):
    out, ref = _run(gen, paged, device, prefix=[3, 50], ext=[45, 20], hq=4, hkv=2, page_size=page_size, is_causal=False)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("window", [0, 7, 40])
def test_extend_sliding_window(window, gen, paged, device):
    out, ref = _run(gen, paged, device, prefix=[0, 100, 9], ext=[80, 20, 37], hq=4, hkv=2, page_size=4, window=window)
    _check(out, ref, torch.float32)


def test_extend_window_with_trimmed_prefix(gen, paged, device):
    """The caller kept only the prefix keys inside the window: positions start at prefix_kv_start."""
    out, ref = _run(gen, paged, device, prefix=[20, 8], ext=[50, 12], hq=4, hkv=1, page_size=4, window=19,
                    prefix_start=[100, 3])
    _check(out, ref, torch.float32)


def test_extend_logit_cap_fp16(gen, paged, device):
    out, ref = _run(gen, paged, device, prefix=[10, 0], ext=[40, 25], hq=6, hkv=2, dtype=torch.float16, page_size=4,
                    logit_cap=3.0, window=30)
    _check(out, ref, torch.float16)


@pytest.mark.parametrize("mask_kind", ["tree", "random"])
def test_extend_custom_mask(mask_kind, gen, paged, device):
    out, ref = _run(gen, paged, device, prefix=[30, 0, 7], ext=[20, 5, 40], hq=4, hkv=2, page_size=4,
                    mask_kind=mask_kind)
    _check(out, ref, torch.float32)
    assert (out[1] == 0).all(), "a query with no visible key must output zeros"


def test_extend_custom_mask_window_and_prefix_start(gen, paged, device):
    out, ref = _run(gen, paged, device, prefix=[25], ext=[36], hq=2, hkv=1, page_size=4, mask_kind="random",
                    window=20, prefix_start=[6])
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("dk,dv", [(80, 80), (96, 64), (576, 512)])
def test_extend_head_dims(dk, dv, gen, paged, device):
    out, ref = _run(gen, paged, device, prefix=[18], ext=[35], hq=2, hkv=1, dk=dk, dv=dv, page_size=4)
    _check(out, ref, torch.float32)


def test_extend_bf16(gen, paged, device):
    out, ref = _run(gen, paged, device, prefix=[21], ext=[40], hq=4, hkv=2, dtype=torch.bfloat16, page_size=4)
    _check(out, ref, torch.bfloat16)


def test_extend_argument_errors(device):
    q = torch.zeros(4, 2, 64, device=device)
    kv = torch.zeros(4, 1, 64, device=device)
    ip = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="shape"):
        extend_attention_fwd(q, kv, kv, q[:, :, :32], kv, kv, ip, ip, ip, None, True, None, 4, 1.0)
    with pytest.raises(ValueError, match="mask_indptr"):
        extend_attention_fwd(q, kv, kv, q, kv, kv, ip, ip, ip, torch.ones(16, dtype=torch.bool, device=device),
                             True, None, 4, 1.0)


# ------------------------------------------------ opt-in forms of the unmasked new-token run
def _variants():
    """The interpreter's tiles (as `extend_config`) with each ``kv_desc`` of `ExtendConfig`."""
    base = extend_config(64, 64, torch.float32, interpret=True)
    return {f"desc {x}": dataclasses.replace(base, kv_desc=x) for x in ("kv", "k", "v")}


@pytest.mark.parametrize("prefix,page_size,hq,hkv,dtype", [
    ([0, 0, 0, 0], 1, 2, 2, torch.float32),      # plain ragged prefill, MHA
    ([0, 0, 0, 0], 16, 8, 2, torch.float16),     # plain ragged prefill, GQA 4, 16-bit descriptors
    ([5, 40, 0, 17], 1, 8, 2, torch.float32),    # paged prefix, GQA 4, page 1
    ([5, 40, 0, 17], 16, 2, 2, torch.float32),   # paged prefix, MHA, page 16
])
def test_extend_variants_same_bits_as_default(prefix, page_size, hq, hkv, dtype, gen, paged, device, monkeypatch):
    """Descriptor reads compute every tile with the default's operations in its order: the same
    bits as the default kernel on ragged causal batches (tiles of 16 keys: EXT has 0..4
    unmasked tiles a query block), and within the float64 reference's bound. With prefixes
    (``has_prefix=True``) the variants are off: same bits, and no descriptor is built."""
    built = []
    real = ext_mod._new_token_descriptors

    def spy(*args):
        built.append(real(*args))
        return built[-1]

    monkeypatch.setattr(ext_mod, "_new_token_descriptors", spy)
    variants = _variants()
    if any(prefix):  # the variants are off there: one launch shows it
        variants = {"desc kv": variants["desc kv"]}
    out, ref, outs = _run(gen, paged, device, prefix=prefix, ext=[70, 1, 33, 50], hq=hq, hkv=hkv, dtype=dtype,
                          page_size=page_size, variants=list(variants.values()), has_prefix=any(prefix))
    _check(out, ref, dtype)
    for name, o in zip(variants, outs):
        assert torch.equal(o, out), f"{name}: max |diff| {(o.double() - out.double()).abs().max():.3g}"
    if any(prefix):
        assert built == [], "variants apply to plain prefills only"
    else:
        assert len(built) == 3 and all(d is not None for d in built), "the desc variants must use descriptors"


def test_extend_desc_falls_back_on_unpacked_heads(gen, device):
    """K/V whose heads are not packed rows (a strided view) cannot be one TMA descriptor: the
    kernel falls back to pointers and stays exact."""
    t, hq, hkv, d = 40, 4, 2, 64
    q = torch.randn(t, hq, d, generator=gen)
    kv = torch.randn(t, hkv, 2 * d, generator=gen)  # K and V interleaved per head: stride(1) = 2 * d
    k, v = kv[:, :, :d], kv[:, :, d:]
    assert ext_mod._new_token_descriptors(k, v, 16, True) is None
    assert ext_mod._new_token_descriptors(k.contiguous(), v.contiguous(), 16, True) is not None
    ip = torch.tensor([0, t], dtype=torch.int32, device=device)
    zero = torch.zeros(2, dtype=torch.int32, device=device)
    outs = []
    for cfg in (None, _variants()["desc kv"]):
        o = torch.empty(t, hq, d, device=device)
        extend_attention_fwd(q.to(device), k.to(device), v.to(device), o, k.to(device), v.to(device), ip, zero,
                             zero, None, True, None, t, d ** -0.5, config=cfg, has_prefix=False)
        outs.append(o.cpu())
    assert torch.equal(outs[0], outs[1])
    ref = _reference(q, k, v, k, v, [0, t], [torch.zeros(0, dtype=torch.long)], [0], None, True, -1, d ** -0.5, 0.0)
    _check(outs[1], ref, torch.float32)


def test_extend_config_env_override(monkeypatch):
    """``ATTNSERVE_EXTEND_CONFIG`` replaces the GPU default's tiles and flags, keeps the prefix
    tile, and refuses malformed values."""
    monkeypatch.setenv(ext_mod.EXTEND_CONFIG_ENV, "128,128,8,2,desc")
    cfg = extend_config(128, 128, torch.bfloat16, has_prefix=True)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (128, 128, 8, 2)
    assert cfg.kv_desc == "kv" and cfg.block_n_prefix == 128
    monkeypatch.setenv(ext_mod.EXTEND_CONFIG_ENV, "64,64,4,3")
    cfg = extend_config(128, 128, torch.bfloat16, has_prefix=False)
    assert (cfg.block_m, cfg.num_warps, cfg.kv_desc, cfg.block_n_prefix) == (64, 4, "", None)
    monkeypatch.setenv(ext_mod.EXTEND_CONFIG_ENV, "128,64,8,4,descv")
    assert extend_config(128, 128, torch.bfloat16, has_prefix=False).kv_desc == "v"
    for bad in ("128,64,8", "128,64,8,3,lookahead", "a,b,c,d", "128,64,8,3,desck,descv"):
        monkeypatch.setenv(ext_mod.EXTEND_CONFIG_ENV, bad)
        with pytest.raises(ValueError, match=ext_mod.EXTEND_CONFIG_ENV):
            extend_config(128, 128, torch.bfloat16)
    monkeypatch.delenv(ext_mod.EXTEND_CONFIG_ENV)
    assert extend_config(128, 128, torch.bfloat16) == ext_mod.ExtendConfig(128, 64, 8, 3, 128)
