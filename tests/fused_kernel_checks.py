"""Shared checks of `attnserve.models.layers.fused_kernels` against the PyTorch reference
layers (their ``use_fused`` switched off) and float64 formulas.

Used on CPU under the Triton interpreter (``tests/models/test_fused_kernels.py``: float32 and
float16) and on CUDA (``tests/gpu/test_fused_kernels_gpu.py``: bfloat16 too). Every check
draws fresh random inputs, poisons outputs (NaN) where the kernel writes into a given
buffer, and checks that what must stay untouched does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from attnserve.mem_cache.memory_pool import MHATokenToKVPool
from attnserve.models.layers import fused_kernels as fk
from attnserve.models.layers.activation import GeluAndMul, SiluAndMul
from attnserve.models.layers.norm import GemmaRMSNorm, RMSNorm
from attnserve.models.layers.rotary import RotaryEmbedding

#: (rtol, atol) by dtype: one rounding of the storage dtype on either side
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=tol, atol=tol)


def _rand(gen: torch.Generator, *shape, device, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def _make_norm(hidden: int, gemma: bool, device, dtype, gen) -> RMSNorm:
    norm = (GemmaRMSNorm if gemma else RMSNorm)(hidden, 1e-6, dtype=dtype).to(device)
    norm.use_fused = False  # the PyTorch reference path on any device
    with torch.no_grad():
        norm.weight.copy_(_rand(gen, hidden, device=device, dtype=dtype, scale=0.5) + (0.0 if gemma else 1.0))
    return norm


def _norm_ref64(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    xd = x.double()
    w = norm.weight.double() + (1.0 if isinstance(norm, GemmaRMSNorm) else 0.0)
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * w


def _input(gen, tokens: int, hidden: int, layout: str, device, dtype) -> torch.Tensor:
    """``[T, hidden]`` contiguous, a strided 2-D column slice, or a ``[T, H, 16]``-style 3-D view."""
    if layout == "contiguous":
        return _rand(gen, tokens, hidden, device=device, dtype=dtype, scale=2.0)
    if layout == "strided":
        wide = _rand(gen, tokens, 3 * hidden + 5, device=device, dtype=dtype, scale=2.0)
        return wide[:, hidden + 3 : 2 * hidden + 3]
    assert layout == "heads3d"  # q of a fused qkv, per head: rows of `hidden`, head stride `hidden`
    heads = 3
    wide = _rand(gen, tokens, heads * hidden + 2 * hidden, device=device, dtype=dtype, scale=2.0)
    return wide[:, : heads * hidden].view(tokens, heads, hidden)


def check_rmsnorm(device, dtype, tokens: int, hidden: int, gemma: bool, layout: str, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    norm = _make_norm(hidden, gemma, device, dtype, gen)
    x = _input(gen, tokens, hidden, layout, device, dtype)
    x_before = x.clone()
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=device)
    got = fk.rmsnorm(x, norm.weight, norm.variance_epsilon, norm.fused_weight_offset, out=out)
    assert got is out and not torch.isnan(out).any()
    assert torch.equal(x, x_before)
    close(out, norm(x), dtype)
    close(out, _norm_ref64(x, norm), dtype)
    fresh = fk.rmsnorm(x, norm.weight, norm.variance_epsilon, norm.fused_weight_offset)
    assert fresh.shape == x.shape and fresh.dtype == dtype and fresh.is_contiguous()
    assert torch.equal(fresh, out)


def check_fused_add_rmsnorm(device, dtype, tokens: int, hidden: int, gemma: bool, layout: str, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    norm = _make_norm(hidden, gemma, device, dtype, gen)
    x = _input(gen, tokens, hidden, layout, device, dtype)
    residual = _rand(gen, *x.shape, device=device, dtype=dtype, scale=3.0)
    ref_out, ref_sum = norm(x, residual.clone())
    x_before = x.clone()
    out = fk.fused_add_rmsnorm(x, residual, norm.weight, norm.variance_epsilon, norm.fused_weight_offset)
    assert torch.equal(x, x_before)
    # the new residual stream is the storage-dtype sum, bit for bit
    assert torch.equal(residual, ref_sum)
    assert out.dtype == dtype and not torch.isnan(out).any()
    close(out, ref_out, dtype)
    close(out, _norm_ref64(ref_sum, norm), dtype)


def _short_rows(gen, tokens: int, heads: int, dim: int, layout: str, device, dtype, pad: int):
    """A ``[..., dim]`` tensor of short rows and the tensor it is a view of (or itself).

    ``strided2d``: ``[tokens, dim]`` column slice of ``[tokens, dim + pad + 5]`` (from column
    ``pad``); ``heads3d``: ``[tokens, heads, dim]`` view of the first ``heads * dim`` columns of
    ``[tokens, (heads + 2) * dim + pad]`` (the q part of a fused qkv output); ``padded3d``:
    ``[tokens, heads, dim]`` cut from ``[tokens, heads, dim + pad]`` (head stride ``dim + pad``);
    ``contig4d``: contiguous ``[2, tokens, heads, dim]``."""
    if layout == "strided2d":
        base = _rand(gen, tokens, dim + pad + 5, device=device, dtype=dtype, scale=2.0)
        return base[:, pad : pad + dim], base
    if layout == "heads3d":
        base = _rand(gen, tokens, (heads + 2) * dim + pad, device=device, dtype=dtype, scale=2.0)
        return base[:, : heads * dim].view(tokens, heads, dim), base
    if layout == "padded3d":
        base = _rand(gen, tokens, heads, dim + pad, device=device, dtype=dtype, scale=2.0)
        return base[..., :dim], base
    assert layout == "contig4d"
    x = _rand(gen, 2, tokens, heads, dim, device=device, dtype=dtype, scale=2.0)
    return x, x


def check_norm_short_rows(device, dtype, tokens: int, heads: int, dim: int, layout: str, gemma: bool,
                          exact_sum: bool = True, seed: int = 0) -> None:
    """`rmsnorm` and `fused_add_rmsnorm` on rows short enough that one program normalises
    ``BLOCK_M > 1`` of them (`fused_kernels._norm_launch`), with a row count that leaves the
    last program partly masked (the only one when ``rows < BLOCK_M``): outputs against float64 and the PyTorch layer; ``x`` and
    every element around the views untouched; the residual (laid out unlike ``x``:
    ``padded3d`` for 3-D ``x``, a column slice for 2-D) updated in place to the
    storage-dtype sum -- bit for bit, or within one rounding where the Triton interpreter
    truncates bfloat16 (``exact_sum=False``)."""
    gen = torch.Generator().manual_seed(seed)
    _, block_m, _ = fk._norm_launch(dim)
    norm = _make_norm(dim, gemma, device, dtype, gen)
    x, x_base = _short_rows(gen, tokens, heads, dim, layout, device, dtype, pad=3)
    rows = x.numel() // dim
    assert block_m > 1 and rows % block_m, (rows, block_m)  # multi-row programs, the last one partial
    x_base_before = x_base.clone()
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=device)
    assert fk.rmsnorm(x, norm.weight, norm.variance_epsilon, norm.fused_weight_offset, out=out) is out
    assert torch.equal(x_base, x_base_before) and not torch.isnan(out).any()
    close(out, _norm_ref64(x, norm), dtype)
    close(out, norm(x), dtype)

    r_layout = "padded3d" if layout in ("heads3d", "padded3d") else ("contig4d" if layout == "contig4d" else "strided2d")
    residual, r_base = _short_rows(gen, tokens, heads, dim, r_layout, device, dtype, pad=5)
    if layout == "strided2d":
        assert residual.stride(0) != x.stride(0)
    ref_sum = x + residual
    r_base_before = r_base.clone()
    got = fk.fused_add_rmsnorm(x, residual, norm.weight, norm.variance_epsilon, norm.fused_weight_offset)
    assert torch.equal(x_base, x_base_before)
    if exact_sum:
        assert torch.equal(residual, ref_sum)
    else:  # one bfloat16 rounding (2**-7 relative: truncation instead of rounding to nearest)
        torch.testing.assert_close(residual.double(), ref_sum.double(), rtol=2.0**-7, atol=0.0)
    outside = torch.ones(r_base.shape, dtype=torch.bool, device=device)
    if r_layout == "padded3d":
        outside[..., :dim] = False
    elif r_layout == "strided2d":
        outside[:, 5 : 5 + dim] = False
    else:
        outside[...] = False
    assert torch.equal(r_base[outside], r_base_before[outside])
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous() and not torch.isnan(got).any()
    close(got, _norm_ref64(residual, norm), dtype)


def _rope_ref64(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, rotary_dim: int, neox: bool):
    """float64 rotation of ``[T, H, D]`` with the module's own (float32) cos/sin table."""
    cs = cache.double()[positions.long()]
    half = rotary_dim // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    xd = x.double()
    rot = xd[..., :rotary_dim]
    if neox:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return torch.cat([out, xd[..., rotary_dim:]], -1)


def check_rope(
    device,
    dtype,
    tokens: int,
    hq: int,
    hk: Optional[int],
    head_dim: int,
    rotary_dim: int,
    neox: bool,
    layout: str = "qkv",
    cos_sin_scale: float = 1.0,
    seed: int = 0,
) -> None:
    """``layout``: ``qkv`` (q, k: 2-D strided views of one fused qkv output), ``contiguous``
    (separate 2-D tensors) or ``mla`` (q ``[T, H, rope]`` cut from ``[T, H, nope + rope]``,
    k ``[T, rope]`` cut from a latent row, as DeepSeek-V2 calls it; ``head_dim = rope``)."""
    gen = torch.Generator().manual_seed(seed)
    max_pos = 300
    rope = RotaryEmbedding(head_dim, rotary_dim, max_pos, 10000.0, is_neox_style=neox, cos_sin_scale=cos_sin_scale)
    rope = rope.to(device)
    rope.use_fused = False
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    nk = hk or 0
    if layout == "qkv":
        base = _rand(gen, tokens, (hq + 2 * nk) * head_dim, device=device, dtype=dtype)
        q = base[:, : hq * head_dim]
        k = base[:, hq * head_dim : (hq + nk) * head_dim] if hk else None
    elif layout == "contiguous":
        base = None
        q = _rand(gen, tokens, hq * head_dim, device=device, dtype=dtype)
        k = _rand(gen, tokens, nk * head_dim, device=device, dtype=dtype) if hk else None
    else:
        assert layout == "mla" and hk == 1
        nope = 24
        base = _rand(gen, tokens, hq, nope + head_dim, device=device, dtype=dtype)
        latent = _rand(gen, tokens, 40 + head_dim, device=device, dtype=dtype)
        q = base[..., nope:]
        k = latent[:, 40:]
    base_before = None if base is None else base.clone()
    latent_before = latent.clone() if layout == "mla" else None
    ref_q, ref_k = rope(positions, q.clone(), None if k is None else k.clone())
    q_before = q.clone()
    k_before = None if k is None else k.clone()

    assert fk.rope_layout_supported(q, k, head_dim)
    fk.rotary_embedding_inplace(positions, q, k, rope.cos_sin_cache, head_dim, rotary_dim, neox)

    close(q, ref_q, dtype)
    q3 = q_before.reshape(tokens, hq, head_dim)
    close(q.reshape(tokens, hq, head_dim), _rope_ref64(q3, positions, rope.cos_sin_cache, rotary_dim, neox), dtype)
    # channels past rotary_dim pass through untouched
    assert torch.equal(q.reshape(tokens, hq, head_dim)[..., rotary_dim:], q3[..., rotary_dim:])
    if k is not None:
        close(k, ref_k, dtype)
        k3 = k_before.reshape(tokens, -1, head_dim)
        close(k.reshape(tokens, -1, head_dim), _rope_ref64(k3, positions, rope.cos_sin_cache, rotary_dim, neox), dtype)
    if layout == "qkv":  # v (and k when absent) untouched
        assert torch.equal(base[:, (hq + nk) * head_dim :], base_before[:, (hq + nk) * head_dim :])
    if layout == "mla":
        assert torch.equal(base[..., :24], base_before[..., :24])
        assert torch.equal(latent[:, :40], latent_before[:, :40])


def check_act_and_mul(device, dtype, kind: str, tokens: int, inter: int, strided: bool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    if strided:
        x = _rand(gen, tokens, 2 * inter + 7, device=device, dtype=dtype, scale=3.0)[:, 3 : 3 + 2 * inter]
    else:
        x = _rand(gen, tokens, 2 * inter, device=device, dtype=dtype, scale=3.0)
    x_before = x.clone()
    module = SiluAndMul() if kind == "silu" else GeluAndMul("tanh")
    module.use_fused = False
    ref = module(x)
    out = fk.silu_and_mul(x) if kind == "silu" else fk.gelu_tanh_and_mul(x)
    assert torch.equal(x, x_before)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    close(out, ref, dtype)
    g, u = x.double()[:, :inter], x.double()[:, inter:]
    if kind == "silu":
        ref64 = g / (1 + torch.exp(-g)) * u
    else:
        ref64 = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    close(out, ref64, dtype)


def check_store_kv(
    device, src_dtype, buf_dtype, tokens: int, heads: int, dk: int, dv: int, strided: bool, seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(seed)
    slots = 3 * tokens + 11
    k_buf = torch.full((slots, heads, dk), float("nan"), dtype=buf_dtype, device=device)
    v_buf = torch.full((slots, heads, dv), float("nan"), dtype=buf_dtype, device=device)
    loc = torch.randperm(slots, generator=gen)[:tokens].to(device)
    if strided:  # k, v as views of one fused qkv output, as RadixAttention passes them
        qkv = _rand(gen, tokens, 2 * dk * heads + heads * dk + heads * dv, device=device, dtype=src_dtype)
        k = qkv[:, 2 * dk * heads : 3 * dk * heads].view(tokens, heads, dk)
        v = qkv[:, 3 * dk * heads :].view(tokens, heads, dv)
    else:
        k = _rand(gen, tokens, heads, dk, device=device, dtype=src_dtype)
        v = _rand(gen, tokens, heads, dv, device=device, dtype=src_dtype)
    fk.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k.to(buf_dtype))
    assert torch.equal(v_buf[loc], v.to(buf_dtype))
    untouched = torch.ones(slots, dtype=torch.bool, device=device)
    untouched[loc] = False
    assert torch.isnan(k_buf[untouched]).all() and torch.isnan(v_buf[untouched]).all()
    # same bytes as the pool's index_put path
    pool = MHATokenToKVPool(slots - 1, 1, buf_dtype, heads, dk, 1, device, v_head_dim=dv)
    pool.use_fused_store = False
    pool.set_kv_buffer(type("L", (), {"layer_id": 0, "k_scale": 1.0, "v_scale": 1.0})(), loc, k, v)
    assert torch.equal(pool.k_buffer[0][loc], k_buf[loc]) and torch.equal(pool.v_buffer[0][loc], v_buf[loc])


def check_rope_store_kv(
    device, dtype, buf_dtype, tokens: int, hq: int, hk: int, head_dim: int, rotary_dim: int, neox: bool,
    seed: int = 0,
) -> None:
    """RoPE with the fused KV-cache write (`rotary_embedding_inplace(kv_store=...)`): q and k
    end exactly as after the rotation alone, the cache rows ``loc`` hold the rotated k and
    v converted to the cache dtype, every other row keeps its NaN poison, and the PyTorch
    path of `RotaryEmbedding` (rotate, then ``index_put``) fills the same rows."""
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim, rotary_dim, 64, 10000.0, is_neox_style=neox).to(device)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(device)
    qkv = _rand(gen, tokens, (hq + 2 * hk) * head_dim, device=device, dtype=dtype)
    q = qkv[:, : hq * head_dim]
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim]
    v = qkv[:, (hq + hk) * head_dim :]
    v_before = v.clone()
    qkv2 = qkv.clone()
    slots = 2 * tokens + 5
    loc = torch.randperm(slots, generator=gen)[:tokens].to(device)
    k_buf = torch.full((slots, hk, head_dim), float("nan"), dtype=buf_dtype, device=device)
    v_buf = torch.full((slots, hk, head_dim), float("nan"), dtype=buf_dtype, device=device)

    q_only, k_only = q.clone(), k.clone()
    fk.rotary_embedding_inplace(positions, q_only, k_only, rope.cos_sin_cache, head_dim, rotary_dim, neox)
    target = fk.KVStoreTarget(k_buf, v_buf, loc, v)
    fk.rotary_embedding_inplace(positions, q, k, rope.cos_sin_cache, head_dim, rotary_dim, neox, kv_store=target)

    assert torch.equal(q, q_only) and torch.equal(k, k_only)
    assert torch.equal(v, v_before)
    assert torch.equal(k_buf[loc], k.reshape(tokens, hk, head_dim).to(buf_dtype))
    assert torch.equal(v_buf[loc], v.reshape(tokens, hk, head_dim).to(buf_dtype))
    untouched = torch.ones(slots, dtype=torch.bool, device=device)
    untouched[loc] = False
    assert torch.isnan(k_buf[untouched]).all() and torch.isnan(v_buf[untouched]).all()

    # the reference path of the layer: rotate with PyTorch, then index_put into the cache
    rope.use_fused = False
    k_ref = torch.full_like(k_buf, float("nan"))
    v_ref = torch.full_like(v_buf, float("nan"))
    q2, k2 = rope(positions, qkv2[:, : hq * head_dim], qkv2[:, hq * head_dim : (hq + hk) * head_dim],
                  kv_store=fk.KVStoreTarget(k_ref, v_ref, loc, qkv2[:, (hq + hk) * head_dim :]))
    close(k_ref[loc], k_buf[loc], dtype)
    assert torch.equal(v_ref[loc], v_buf[loc])
    assert torch.isnan(k_ref[untouched]).all()


def check_rope_store_kv_fp8(
    device, dtype, buf_dtype, tokens: int, hq: int, hk: int, head_dim: int, rotary_dim: int, neox: bool,
    k_scale: float, v_scale: float, on_grid: bool = False, seed: int = 0,
) -> None:
    """The fused RoPE + KV store into an FP8 cache: the rows ``loc`` hold exactly the bytes
    `kv_quant.quantize_kv` gives for the rotated k (as left in ``k``) and for v with the
    target's scales (saturated: k is drawn large enough that some entries clip), the other
    rows keep their poison bytes; the PyTorch path of `RotaryEmbedding` quantises its own
    rotated key the same way.

    ``on_grid`` (for the CPU interpreter, whose float32 -> fp8 cast rounds wrongly near
    powers of two): position 0 (RoPE is the identity) and k / v drawn as fp8 values times
    power-of-two scales, so no entry needs rounding and the check covers the scales, the
    saturation and the rows; on a GPU use random positions and inputs (``on_grid=False``)."""
    from attnserve.mem_cache.kv_quant import quantize_kv

    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim, rotary_dim, 64, 10000.0, is_neox_style=neox).to(device)
    qkv = _rand(gen, tokens, (hq + 2 * hk) * head_dim, device=device, dtype=dtype, scale=40.0)
    if on_grid:
        positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        k_cols = slice(hq * head_dim, (hq + hk) * head_dim)
        v_cols = slice((hq + hk) * head_dim, None)
        for cols, scale in ((k_cols, k_scale), (v_cols, v_scale)):
            grid = (qkv[:, cols].float() / 40.0 * 300.0).to(buf_dtype).float()  # |x| up to ~1000: some saturate
            qkv[:, cols] = (grid * scale).to(dtype)
    else:
        positions = torch.randint(0, 64, (tokens,), generator=gen).to(device)
    # past the format's max (after any rotation one of the pair stays above it: max(|cos|, |sin|) >= 0.7)
    qkv[:, hq * head_dim] = 2.0 * torch.finfo(buf_dtype).max * k_scale
    qkv2 = qkv.clone()
    q = qkv[:, : hq * head_dim]
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim]
    v = qkv[:, (hq + hk) * head_dim :]
    slots = 2 * tokens + 5
    loc = torch.randperm(slots, generator=gen)[:tokens].to(device)
    poison = 0x5A

    def buffers():
        kb = torch.empty((slots, hk, head_dim), dtype=buf_dtype, device=device)
        vb = torch.empty((slots, hk, head_dim), dtype=buf_dtype, device=device)
        kb.view(torch.uint8).fill_(poison)
        vb.view(torch.uint8).fill_(poison)
        return kb, vb

    def as_bytes(x):
        return x.view(torch.uint8).cpu()

    k_buf, v_buf = buffers()
    fk.rotary_embedding_inplace(positions, q, k, rope.cos_sin_cache, head_dim, rotary_dim, neox,
                                kv_store=fk.KVStoreTarget(k_buf, v_buf, loc, v, k_scale, v_scale))
    k_rows, v_rows = k.reshape(tokens, hk, head_dim), v.reshape(tokens, hk, head_dim)
    assert torch.equal(as_bytes(k_buf[loc]), as_bytes(quantize_kv(k_rows, k_scale, buf_dtype)))
    assert torch.equal(as_bytes(v_buf[loc]), as_bytes(quantize_kv(v_rows, v_scale, buf_dtype)))
    assert (k_rows.float().abs() / k_scale > torch.finfo(buf_dtype).max).any()  # saturation was exercised
    untouched = torch.ones(slots, dtype=torch.bool, device=device)
    untouched[loc] = False
    assert (as_bytes(k_buf[untouched]) == poison).all() and (as_bytes(v_buf[untouched]) == poison).all()

    rope.use_fused = False
    k_ref, v_ref = buffers()
    _, k2 = rope(positions, qkv2[:, : hq * head_dim], qkv2[:, hq * head_dim : (hq + hk) * head_dim],
                 kv_store=fk.KVStoreTarget(k_ref, v_ref, loc, qkv2[:, (hq + hk) * head_dim :], k_scale, v_scale))
    assert torch.equal(as_bytes(k_ref[loc]), as_bytes(quantize_kv(k2.reshape(tokens, hk, head_dim), k_scale, buf_dtype)))
    assert torch.equal(as_bytes(v_ref[loc]), as_bytes(v_buf[loc]))
    assert (as_bytes(k_ref[untouched]) == poison).all()
