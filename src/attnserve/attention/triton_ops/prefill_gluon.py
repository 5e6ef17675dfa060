"""Causal prefill attention on Hopper (sm_90): a warp-specialized Gluon kernel in the style of
FlashAttention-3 (Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony
and Low-precision", 2024; read for the algorithm, not copied).

Scope: prefills of a ragged batch, bf16 / fp16, head dim 128, ``Hq % Hkv == 0``, causal, no
sliding window, logit cap, custom mask or attention sinks (those keep the Triton extend
kernel, `extend_attention`, which implements them). Request ``b`` owns rows ``extend_start_loc[b] .. + extend_seq_lens[b]``
of ``q_extend`` / ``k_extend`` / ``v_extend`` / ``o_extend``. With ``k_buffer`` /
``v_buffer`` given (a 16-bit paged KV cache, scales 1), request ``b`` also attends to its
cached prefix, the token slots ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (any page
size): a separate specialization, `prefill_gluon_prefix_kernel`, whose loader gathers those
rows by cp.async after the new-token tiles (the plain kernel is unchanged).

One program (a CTA of 3 warpgroups) computes 128 query rows of one request and one query
head: grid ``(Hq, bs, cdiv(max_len_extend, 128))``, the query tiles with the most keys
launched first. Partitions (`prefill_gluon_partitions`): a 1-warp TMA loader (Q as two
``[64, 128]`` boxes, then K and V ``[BLOCK_N, 128]`` boxes of the 2-D views ``[T, H * 128]``
at column ``head * 128`` into a ``STAGES``-deep ring), and two consumer warpgroups of 64 rows
each that share every K/V tile, alternate their wgmma groups (ping-pong) and keep tile
``i``'s PV wgmma in flight during tile ``i + 1``'s softmax. Causal tiles past the diagonal
are never visited; the diagonal tile(s) are masked. Scores use ``exp2`` with ``sm_scale *
log2(e)`` folded in; accumulation is float32.

Shared memory (BLOCK_N 128, 2 stages): Q 32 KB + K/V ring 128 KB = 160 KB: one program an SM.
Registers: 12 warps x 32 x ``maxnreg`` (168) at launch; ``setmaxnreg`` then gives each
consumer warpgroup ``consumer_regs`` (240) and the loader's ``loader_regs`` (24), as the MLA
seesaw kernel (`mla_decode_seesaw`) does. Gluon is experimental; written against Triton 3.6
and imported only when used (`gluon_prefill_fwd`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

GLUON_PREFILL_ENV = "ATTNSERVE_EXTEND_GLUON"
#: auto mode: plain prefills whose longest request has at least this many tokens take the Gluon
#: kernel. H100, Llama-3-8B heads (`benchmarks/prefill_gluon_bench.py`, 2026-11-27): Gluon /
#: Triton default 1.25x at 1 x 8,190 and 2 x 4,096, 1.14x at 4 x 2,048, 0.96x at 16 x 512.
GLUON_PREFILL_MIN_LEN = 1024
#: launches with a cached prefix take the Gluon kernel unless this switch is off (``0``); the
#: length rule then applies to the new tokens (``max_len_extend``: the prefix lengths live on
#: the device and the route must not read them). H100 (2026-11-27): 1.12-1.14x the Triton
#: kernel at 4,096 / 2,048-token prefixes; issue 33's long-prompt workload, prefill share
#: Qwen3-0.6B 0.70 -> 0.77, Llama-3-8B 0.88 -> 0.93 (benchmarks/NOTES.md)
GLUON_PREFILL_PREFIX_ENV = "ATTNSERVE_EXTEND_GLUON_PREFIX"
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class GluonPrefillConfig:
    """Launch parameters of the Gluon prefill kernel.

    ``block_m``: query rows a program (128: two consumer warpgroups of 64). ``block_n``: keys
    a tile (64 or 128). ``stages``: K/V ring depth (shared memory ``32 KB + stages * 4 *
    block_n * 128`` bytes <= 227 KB). ``consumer_regs`` / ``loader_regs``: ``setmaxnreg`` of
    the consumer warpgroups / the loader warp's warpgroup (multiples of 8, 24..256), whose
    sum with one more consumer must fit 12 warps x ``maxnreg``."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 2
    consumer_regs: int = 240
    loader_regs: int = 24
    maxnreg: int = 168

    def shared_bytes(self, head_dim: int = 128, elem: int = 2) -> int:
        """Shared memory of the Q tile and the K/V ring (bytes; barriers excluded)."""
        return self.block_m * head_dim * elem + self.stages * 2 * self.block_n * head_dim * elem

    def validate(self) -> "GluonPrefillConfig":
        """Raise ValueError on a configuration the kernel cannot run; return self."""
        if self.block_m != 128:
            raise ValueError(f"block_m must be 128 (two warpgroups of 64 rows), got {self.block_m}")
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n must be 64 or 128, got {self.block_n}")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"stages must be in 1..4, got {self.stages}")
        if self.shared_bytes() > 227 * 1024 - 1024:
            raise ValueError(f"{self.shared_bytes()} B of shared memory exceed the H100's 227 KB (less barriers)")
        for name in ("consumer_regs", "loader_regs"):
            r = getattr(self, name)
            if r % 8 or not 24 <= r <= 256:
                raise ValueError(f"{name} must be a multiple of 8 in 24..256, got {r}")
        if 2 * self.consumer_regs + self.loader_regs > 3 * self.maxnreg or self.maxnreg * 12 * 32 > 65536:
            raise ValueError("registers: 2 x consumer_regs + loader_regs must fit 3 x maxnreg <= 3 x 170")
        return self


DEFAULT_CONFIG = GluonPrefillConfig()


def gluon_prefill_enabled(max_len_extend: int = 0, batch_invariant: bool = False, has_prefix: bool = False) -> bool:
    """Whether the extend kernel's causal prefills on sm_90 run `gluon_prefill_fwd`.

    ``ATTNSERVE_EXTEND_GLUON`` (read at every call): set, it decides (`env_options.env_flag`:
    on unless ``0`` / ``off`` / ...); unset or empty (auto), a launch whose longest request has
    ``max_len_extend >= GLUON_PREFILL_MIN_LEN`` new tokens takes it, unless ``batch_invariant``
    (``--enable-deterministic-inference``: the kernel must not depend on the rest of the batch,
    and the length rule does). ``has_prefix`` launches (cached prefixes) follow the same rule unless
    ``ATTNSERVE_EXTEND_GLUON_PREFIX`` is off (default on).
    """
    import os

    from attnserve.env_options import env_flag

    if has_prefix and not env_flag(GLUON_PREFILL_PREFIX_ENV, default=True):
        return False
    if os.environ.get(GLUON_PREFILL_ENV, "").strip():
        return env_flag(GLUON_PREFILL_ENV)
    return not batch_invariant and int(max_len_extend) >= GLUON_PREFILL_MIN_LEN


def num_query_tiles(max_len_extend: int, block_m: int = 128) -> int:
    """Grid size along the query tiles: ``cdiv(max_len_extend, block_m)`` (0 for no tokens)."""
    return max(0, -(-int(max_len_extend) // block_m))


def key_tiles(m0: int, ext_len: int, block_m: int = 128, block_n: int = 128) -> int:
    """Key tiles the program of query rows ``[m0, m0 + block_m)`` of a request of ``ext_len``
    tokens visits (the kernel's arithmetic; 0 when the tile lies past the request):
    ``cdiv(min(m0 + block_m, ext_len), block_n)``."""
    if m0 >= ext_len:
        return 0
    return -(-min(m0 + block_m, ext_len) // block_n)


def causal_flops(seq_lens, num_q_heads: int, head_dim: int = 128) -> float:
    """FLOPs of causal attention as usually quoted (FA papers): ``4 * Hq * D * L^2 / 2`` a
    request (QK^T and PV, half the score matrix)."""
    return float(sum(4 * num_q_heads * head_dim * int(n) * int(n) / 2 for n in seq_lens))


def attention_flops(ext_lens, prefix_lens, num_q_heads: int, head_dim: int = 128) -> float:
    """FLOPs of causal attention over a cached prefix: a request of ``E`` new tokens over ``P``
    prefix keys does ``4 * Hq * D * (E * P + E^2 / 2)`` (every new token sees all ``P`` prefix
    keys, then the causal half of its own; `causal_flops` for ``P = 0``)."""
    return float(sum(4 * num_q_heads * head_dim * (int(e) * int(p) + int(e) * int(e) / 2)
                     for e, p in zip(ext_lens, prefix_lens)))


def _cache_ok(buf, like: torch.Tensor, hkv: int) -> bool:
    """A paged cache ``[num_slots, Hkv, 128]`` in q's dtype whose 256-byte rows cp.async can
    read 16 bytes at a time (base, slot and head strides 16-byte aligned, dims contiguous)."""
    if buf is None or buf.dim() != 3 or buf.dtype != like.dtype or tuple(buf.shape[1:]) != (hkv, 128):
        return False
    e = buf.element_size()
    return (buf.stride(2) == 1 and buf.data_ptr() % 16 == 0 and (buf.stride(0) * e) % 16 == 0
            and (buf.stride(1) * e) % 16 == 0 and buf.device == like.device)


def gluon_prefill_supported(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                            o_extend: torch.Tensor, *, is_causal: bool = True, has_prefix: bool = False,
                            custom_mask=None, logit_cap: float = 0.0, sliding_window_size: int = -1,
                            capability=None, k_buffer: Optional[torch.Tensor] = None,
                            v_buffer: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, sinks: Optional[torch.Tensor] = None) -> bool:
    """Whether `gluon_prefill_fwd` can compute this launch: a CUDA device of compute
    capability 9.0 (``capability``: given, or read from q's device), q/k/v/o of one 16-bit
    dtype (bf16 / fp16), head dim 128 for q, k, v and o, ``Hq % Hkv == 0``, causal, no
    custom mask, logit cap, sliding window or attention ``sinks`` (gpt-oss; declined, so
    the Triton extend kernel, which implements them, runs), and TMA-readable q / k / v (each head's 128
    values contiguous and heads packed: ``stride(2) == 1``, ``stride(1) == 128``; rows and
    base 16-byte aligned). ``has_prefix`` (a cached prefix) also needs ``k_buffer`` /
    ``v_buffer`` ``[num_slots, Hkv, 128]`` in q's dtype with 16-byte aligned base and strides
    and scales 1 (fp8 caches keep the Triton kernel). Never raises; False for anything else
    (e.g. CPU tensors)."""
    try:
        if not is_causal or custom_mask is not None or logit_cap > 0 or sinks is not None:
            return False
        if has_prefix and (float(k_scale) != 1.0 or float(v_scale) != 1.0
                           or not _cache_ok(k_buffer, q_extend, k_extend.shape[1])
                           or not _cache_ok(v_buffer, q_extend, k_extend.shape[1])):
            return False
        if sliding_window_size is not None and sliding_window_size >= 0:
            return False
        xs = (q_extend, k_extend, v_extend, o_extend)
        if any(x.dim() != 3 for x in xs) or len({x.dtype for x in xs}) != 1:
            return False
        if q_extend.dtype not in (torch.bfloat16, torch.float16):
            return False
        t, hq, d = q_extend.shape
        hkv = k_extend.shape[1]
        if d != 128 or hkv < 1 or hq % hkv or k_extend.shape != (t, hkv, d) or v_extend.shape != (t, hkv, d):
            return False
        if o_extend.shape != (t, hq, d) or o_extend.stride(2) != 1:
            return False
        for x in (q_extend, k_extend, v_extend):
            if x.stride(2) != 1 or x.stride(1) != d or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
                return False
        if capability is None:
            if q_extend.device.type != "cuda":
                return False
            capability = torch.cuda.get_device_capability(q_extend.device)
        return tuple(capability) == (9, 0)
    except Exception:  # noqa: BLE001  (a predicate: anything odd means "not supported")
        return False


def gluon_prefill_fwd(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                      o_extend: torch.Tensor, extend_start_loc: Optional[torch.Tensor],
                      extend_seq_lens: Optional[torch.Tensor], max_len_extend: int, sm_scale: float, *,
                      qo_indptr: Optional[torch.Tensor] = None,
                      config: Optional[GluonPrefillConfig] = None,
                      k_buffer: Optional[torch.Tensor] = None, v_buffer: Optional[torch.Tensor] = None,
                      kv_indptr: Optional[torch.Tensor] = None,
                      kv_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over each other and, with ``k_buffer``
    given, over its cached prefix first.

    Args:
        q_extend: ``[T, Hq, 128]``; k_extend / v_extend: ``[T, Hkv, 128]`` (bf16 or fp16, one
            dtype; see `gluon_prefill_supported` for the strides).
        o_extend: ``[T, Hq, 128]``, written for every row of every request (other rows untouched).
        extend_start_loc / extend_seq_lens: int32 or int64 ``[bs]`` device tensors, request
            ``b``'s first row and length; or None with ``qo_indptr`` (``[bs + 1]`` offsets)
            given instead (what `extend_attention.extend_attention_fwd` holds).
        max_len_extend: host int >= every length (sets the grid; no device read).
        sm_scale: softmax scale (host float).
        config: launch parameters (default `DEFAULT_CONFIG`).
        k_buffer / v_buffer: the paged cache ``[num_slots, Hkv, 128]`` in q's dtype (scale 1),
            or None (no prefix: the plain kernel). With them: ``kv_indptr`` int32 / int64
            ``[>= bs + 1]`` and ``kv_indices`` (int32 / int64 token slots): request ``b``'s
            prefix is ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (keys before its new
            tokens, all visible to them); ``qo_indptr`` is required.

    Returns ``o_extend``. No host synchronisation (CUDA-graph capturable: the TMA descriptors
    are kernel parameters built on the host from fixed addresses).

    Raises:
        ValueError: unsupported inputs (`gluon_prefill_supported` is False) or an invalid
            config, or neither start/length tensors nor ``qo_indptr``; a prefix without
            ``qo_indptr``, ``kv_indptr`` and ``kv_indices``.
    """
    has_prefix = k_buffer is not None or v_buffer is not None
    if not gluon_prefill_supported(q_extend, k_extend, v_extend, o_extend, has_prefix=has_prefix,
                                   k_buffer=k_buffer, v_buffer=v_buffer):
        raise ValueError("gluon_prefill_fwd: unsupported inputs (needs sm_90, bf16/fp16, D 128, TMA-aligned q/k/v)")
    if has_prefix and (qo_indptr is None or kv_indptr is None or kv_indices is None):
        raise ValueError("gluon_prefill_fwd with a prefix needs qo_indptr, kv_indptr and kv_indices")
    cfg = (config or DEFAULT_CONFIG).validate()
    if qo_indptr is not None:
        starts, lens, from_indptr = qo_indptr, qo_indptr, True
        bs = qo_indptr.shape[0] - 1
    elif extend_start_loc is not None and extend_seq_lens is not None:
        starts, lens, from_indptr = extend_start_loc, extend_seq_lens, False
        bs = extend_start_loc.shape[0]
    else:
        raise ValueError("gluon_prefill_fwd needs extend_start_loc and extend_seq_lens, or qo_indptr")
    t, hq, d = q_extend.shape
    hkv = k_extend.shape[1]
    n_m = num_query_tiles(max_len_extend, cfg.block_m)
    if bs <= 0 or t == 0 or n_m == 0:
        return o_extend

    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from attnserve.attention.triton_ops.prefill_gluon_kernel import _prefill_fwd_kernel

    sw = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    def desc(x, rows):
        return TensorDescriptor(x, [x.shape[0], x.shape[1] * d], [x.stride(0), 1], [rows, d], sw)

    if has_prefix:
        from attnserve.attention.triton_ops.prefill_gluon_prefix_kernel import _prefill_prefix_fwd_kernel

        _prefill_prefix_fwd_kernel[(hq, bs, n_m)](
            desc(q_extend, cfg.block_m // 2), desc(k_extend, cfg.block_n), desc(v_extend, cfg.block_n),
            o_extend, qo_indptr, k_buffer, v_buffer, kv_indptr, kv_indices,
            o_extend.stride(0), o_extend.stride(1), k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1), float(sm_scale) * _LOG2E, n_m,
            GROUP=hq // hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
            CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
            num_warps=4, num_stages=1, maxnreg=cfg.maxnreg,
        )
        return o_extend

    _prefill_fwd_kernel[(hq, bs, n_m)](
        desc(q_extend, cfg.block_m // 2), desc(k_extend, cfg.block_n), desc(v_extend, cfg.block_n),
        o_extend, starts, lens, o_extend.stride(0), o_extend.stride(1), float(sm_scale) * _LOG2E, n_m,
        GROUP=hq // hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, FROM_INDPTR=from_indptr,
        CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
        num_warps=4, num_stages=1, maxnreg=cfg.maxnreg,
    )
    return o_extend
