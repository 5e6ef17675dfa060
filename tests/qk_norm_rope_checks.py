"""Shared checks of the per-head q/k RMSNorm folded into the RoPE launch
(`fused_kernels.rotary_embedding_inplace` with ``q_norm_weight`` / ``k_norm_weight``).

Used on CPU under the Triton interpreter (``tests/models/test_qk_norm_rope.py``) and on
CUDA (``tests/gpu/test_fused_kernels_gpu.py``). The fused launch is compared with the
un-fused kernel sequence it replaces -- `fused_kernels.rmsnorm` on q, on k, then the
rotation (+ KV store) -- bit for bit, and with a float64 reference within a bound derived
from the roundings involved.
"""

from __future__ import annotations

from typing import Optional

import torch

from attnserve.mem_cache.kv_quant import is_fp8
from attnserve.models.layers import fused_kernels as fk
from attnserve.models.layers.norm import GemmaRMSNorm, RMSNorm
from attnserve.models.layers.rotary import RotaryEmbedding

MAX_POS = 4096


def make_qk_norms(head_dim: int, gemma: bool, device, dtype, gen: torch.Generator):
    """(q_norm, k_norm): `RMSNorm` (or `GemmaRMSNorm`) modules with random gains around 1."""
    norms = []
    for _ in range(2):
        norm = (GemmaRMSNorm if gemma else RMSNorm)(head_dim, 1e-6, dtype=dtype).to(device)
        w = torch.randn(head_dim, generator=gen, dtype=torch.float64) * 0.3 + (0.0 if gemma else 1.0)
        with torch.no_grad():
            norm.weight.copy_(w.to(device=device, dtype=dtype))
        norms.append(norm)
    return norms


def _norm64(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    xd = x.double()
    w = norm.weight.double() + float(norm.fused_weight_offset)
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * w


def _rope64_with_partner(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, neox: bool):
    """float64 rotation of ``[T, H, D]`` (all channels rotate) and, per output channel, the
    magnitude of the input pair ``|x_i| + |x_partner(i)|`` it was formed from."""
    cs = cache.double()[positions.long().to(cache.device)].to(x.device)
    half = x.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    if neox:
        a, b = x[..., :half], x[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
        pair = (a.abs() + b.abs()).repeat(1, 1, 2)
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
        pair = (a.abs() + b.abs()).repeat_interleave(2, dim=-1)
    return out, pair


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, norm: RMSNorm, positions: torch.Tensor,
                           cache: torch.Tensor, neox: bool, what: str) -> None:
    """``got`` ``[T, H, D]`` against float64 norm-then-rope of ``x`` ``[T, H, D]``.

    Bound per element: ``u * (|y| + |n_i| + |n_j|)`` with ``n`` the float64 normalised pair
    and ``y`` the float64 rotated value. The kernel rounds twice: the normalised values to
    the storage dtype (relative error ``u``, so ``|c n_i| u + |s n_j| u <= u (|n_i| + |n_j|)``
    after the rotation, ``|cos|, |sin| <= 1``) and the rotated value (``u |y|``).
    ``u = finfo(dtype).eps`` (twice the round-to-nearest unit: it covers the interpreter's
    truncating bfloat16 casts) and at least ``head_dim * eps_float32`` for the float32 sum
    of squares and the rotation's float32 products (Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., section 4.2).
    """
    n = _norm64(x, norm)
    ref, pair = _rope64_with_partner(n, positions, cache, neox)
    u = max(torch.finfo(got.dtype).eps, x.shape[-1] * torch.finfo(torch.float32).eps)
    bound = u * (ref.abs() + pair) + 1e-30
    err = (got.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error up to {worst:.3f} x the rounding bound (u = {u:.2e})"


def check_qk_norm_rope(
    device, dtype, tokens: int, hq: int, hk: int, head_dim: int, neox: bool, gemma: bool,
    buf_dtype: Optional[torch.dtype] = None, k_scale: float = 1.0, v_scale: float = 1.0, seed: int = 0,
    float64_check: bool = True, exact: bool = True,
) -> dict:
    """One fused norm + rope (+ KV store into ``buf_dtype`` caches when given) on q / k views
    of a fused qkv output, against the un-fused kernel sequence (`rmsnorm` on q and k, then
    the rope launch with the same store): q, k and both caches bit for bit; v untouched;
    the cache rows not in ``loc`` keep their poison bytes; q and k within the rounding bound
    of float64 norm-then-rope (`assert_within_rounding`). Returns mismatch counts (all 0).

    ``exact=False`` (the FP8-store variant on a GPU, which the engine does not use: Triton lays
    it out differently, so ~0.02% of q / k values round the other way on an H100): at most
    0.1% of q / k values and of the cache bytes may differ; the float64 bound still holds."""
    gen = torch.Generator().manual_seed(seed)
    q_norm, k_norm = make_qk_norms(head_dim, gemma, device, dtype, gen)
    rope = RotaryEmbedding(head_dim, head_dim, MAX_POS, 1e6, is_neox_style=neox).to(device)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=gen).to(device)
    width = (hq + 2 * hk) * head_dim
    qkv = (torch.randn(tokens, width, generator=gen, dtype=torch.float64) * 3.0).to(device=device, dtype=dtype)
    # heads of very different scales (the norm must not care) and a tiny one (eps matters)
    qkv[:, :head_dim] *= 50.0
    qkv[:, hq * head_dim : (hq + 1) * head_dim] *= 1e-3
    qs, ks, vs = slice(0, hq * head_dim), slice(hq * head_dim, (hq + hk) * head_dim), slice((hq + hk) * head_dim, width)
    x_q = qkv[:, qs].reshape(tokens, hq, head_dim).clone()
    x_k = qkv[:, ks].reshape(tokens, hk, head_dim).clone()
    fused, unfused = qkv.clone(), qkv.clone()

    slots = 2 * tokens + 5
    loc = torch.randperm(slots, generator=gen)[:tokens].to(device)
    poison = 0x5A

    def target(base):
        if buf_dtype is None:
            return None
        bufs = [torch.empty((slots, hk, head_dim), dtype=buf_dtype, device=device) for _ in range(2)]
        for b in bufs:
            b.view(torch.uint8).fill_(poison)
        return fk.KVStoreTarget(bufs[0], bufs[1], loc, base[:, vs], k_scale, v_scale)

    t_fused, t_ref = target(fused), target(unfused)
    fk.rotary_embedding_inplace(positions, fused[:, qs], fused[:, ks], rope.cos_sin_cache, head_dim, head_dim, neox,
                                kv_store=t_fused, q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight,
                                eps=q_norm.variance_epsilon, weight_offset=q_norm.fused_weight_offset)
    q_ref = fk.rmsnorm(unfused[:, qs].view(tokens, hq, head_dim), q_norm.weight, q_norm.variance_epsilon,
                       q_norm.fused_weight_offset).view(tokens, -1)
    k_ref = fk.rmsnorm(unfused[:, ks].view(tokens, hk, head_dim), k_norm.weight, k_norm.variance_epsilon,
                       k_norm.fused_weight_offset).view(tokens, -1)
    if t_ref is not None:
        t_ref = fk.KVStoreTarget(t_ref.k_buffer, t_ref.v_buffer, loc, unfused[:, vs], k_scale, v_scale)
    fk.rotary_embedding_inplace(positions, q_ref, k_ref, rope.cos_sin_cache, head_dim, head_dim, neox, kv_store=t_ref)

    mismatches = {"q": int((fused[:, qs] != q_ref).sum()), "k": int((fused[:, ks] != k_ref).sum())}
    if t_fused is not None:
        for name in ("k_buffer", "v_buffer"):
            a = getattr(t_fused, name).view(torch.uint8)
            b = getattr(t_ref, name).view(torch.uint8)
            mismatches[name] = int((a != b).sum())
    if exact:
        assert all(v == 0 for v in mismatches.values()), f"fused norm+rope differs from rmsnorm-then-rope: {mismatches}"
    else:
        sizes = {"q": tokens * hq * head_dim, "k": tokens * hk * head_dim, "k_buffer": slots * hk * head_dim,
                 "v_buffer": slots * hk * head_dim}
        assert all(v <= 1e-3 * sizes[n] for n, v in mismatches.items()), f"too many differences: {mismatches}"
    assert torch.equal(fused[:, vs], qkv[:, vs])  # v untouched
    if t_fused is not None:
        untouched = torch.ones(slots, dtype=torch.bool, device=device)
        untouched[loc] = False
        for buf in (t_fused.k_buffer, t_fused.v_buffer):
            assert (buf[untouched].view(torch.uint8) == poison).all()
        if not is_fp8(buf_dtype):  # the cache holds what is left in k (converted)
            assert torch.equal(t_fused.k_buffer[loc], fused[:, ks].reshape(tokens, hk, head_dim).to(buf_dtype))
    if float64_check:
        assert_within_rounding(fused[:, qs].reshape(tokens, hq, head_dim), x_q, q_norm, positions,
                               rope.cos_sin_cache, neox, "q")
        assert_within_rounding(fused[:, ks].reshape(tokens, hk, head_dim), x_k, k_norm, positions,
                               rope.cos_sin_cache, neox, "k")
    return mismatches
