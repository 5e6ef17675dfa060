"""Extend (prefill with a cached prefix) attention over a paged KV cache.

Request ``i`` brings ``E_i`` new tokens (``q_extend`` / ``k_extend`` / ``v_extend`` rows
``qo_indptr[i]:qo_indptr[i+1]``) on top of a cached prefix whose keys are read from the
paged buffers through ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``. One program handles a
tile of ``BLOCK_M`` queries of one request and one query head, and runs a single online
softmax (FlashAttention-2, Dao, arXiv:2307.08691) first over the prefix keys (gathered by
slot), then over the new keys (read contiguously).

Each of the two stages walks its key tiles in three runs: a masked run where the sliding
window starts, an unmasked run of tiles every query of the tile sees, and a masked run at
the causal diagonal / the end of the keys. Tiles that the causal or window mask excludes
entirely are never visited, so causal prefill costs about half of a full one and a
windowed layer reads about ``window`` keys per query tile. With a custom mask every
visited tile is masked (the window still bounds the visited range).

FP8 KV cache: the paged buffers may hold float8 (e4m3fn / e5m2) entries with per-tensor
scales (true value = stored * scale); the new tokens' K/V are true values in q's dtype.
Prefix tiles are converted to q's dtype after loading (with bf16 queries on a GPU: to fp16,
with q clamped to fp16's range, since fp8 -> fp16 is one instruction and fp8 -> bf16 two;
the prefix dots then run in fp16), score with ``sm_scale * k_scale``,
and the accumulator is multiplied by ``v_scale`` once, after the prefix stage and before
the new-token stage (the online-softmax rescaling is linear, so this equals scaling every
prefix V tile). With scales of 1.0 nothing extra runs.

The key-tile loops live in `extend_runs`, with the TMA-descriptor form of the new-token
stage's unmasked run (``ExtendConfig.kv_desc``); the launch tuning in `extend_tuning`.

Attention sinks (gpt-oss, ``sinks``; `attnserve.attention.sinks`): a virtual key of logit
``sinks[h]`` and value 0; after both stages, ``exp2(sinks[h] * log2(e) - m)`` joins the
softmax denominator (the running max ``m`` is in log2 units; both are rescaled to
``max(m, sink)`` first). Behind the ``HAS_SINK`` constexpr (without sinks the kernel is the
one before). The Gluon prefill kernels do not implement sinks: `_use_gluon_prefill`
declines a launch with sinks, which keeps this kernel.

Positions: prefix key ``j`` of request ``i`` has absolute position ``prefix_kv_start[i] + j``
(``prefix_kv_start`` > 0 when the caller trimmed the prefix to a sliding window); with
``P_i = prefix_kv_start[i] + n_prefix_i``, new token ``t`` has position ``P_i + t``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attnserve.attention.sinks import check_kernel_sinks
from attnserve.attention.triton_ops.decode_attention import _k_dims, _saturate_to_f16
from attnserve.attention.triton_ops.extend_runs import _attn_run, _attn_run_desc, _load_tile, _runs
from attnserve.attention.triton_ops.extend_tuning import (  # noqa: F401  (re-exported)
    EXTEND_CONFIG_ENV,
    EXTEND_DEFAULTS_ENV,
    ExtendConfig,
    _env_override,
    extend_config,
)
from attnserve.mem_cache.kv_quant import FP8_DTYPES, check_scale
from attnserve.triton_env import triton_interpreting


@triton.jit
def _extend_fwd_kernel(
    q_ptr, k_ext_ptr, v_ext_ptr, o_ptr, k_buf_ptr, v_buf_ptr, k_ext_desc, v_ext_desc,
    qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
    mask_ptr, mask_indptr_ptr, prefix_start_ptr, sinks_ptr,
    sm_scale, logit_cap, window, k_scale, v_scale,
    stride_qt, stride_qh,
    stride_ket, stride_keh,
    stride_vet, stride_veh,
    stride_ot, stride_oh,
    stride_kbt, stride_kbh,
    stride_vbt, stride_vbh,
    num_m_blocks,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PREFIX_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_PREFIX_START: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    PREFIX_F16: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    EVEN_DK: tl.constexpr,
    EVEN_DPE: tl.constexpr,
    EVEN_DV: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    K_DESC: tl.constexpr,
    V_DESC: tl.constexpr,
    HAS_SINK: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = num_m_blocks - 1 - tl.program_id(2)  # heaviest causal tiles are launched first
    qo_start = tl.load(qo_indptr_ptr + b)
    ext_len = tl.load(qo_indptr_ptr + b + 1) - qo_start
    m0 = mblk * BLOCK_M
    if m0 >= ext_len:
        return
    m1 = tl.minimum(ext_len, m0 + BLOCK_M)
    kv_start = tl.load(kv_indptr_ptr + b)
    n_prefix = tl.load(kv_indptr_ptr + b + 1) - kv_start
    prefix_start = 0
    if HAS_PREFIX_START:
        prefix_start = tl.load(prefix_start_ptr + b)
    prefix_len = prefix_start + n_prefix
    kv_head = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_valid = offs_m < ext_len
    q_pos = prefix_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    offs_dpe = offs_d  # placeholder when there is no remainder block
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + (qo_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q = _load_tile(q_rows + offs_d[None, :], row_valid, offs_d < DK, True, not EVEN_DK, COMPUTE_FP32)
    q_pe = q  # placeholder when there is no remainder block
    if BLOCK_DPE > 0:
        q_pe = _load_tile(q_rows + offs_dpe[None, :], row_valid, offs_dpe < DK, True, not EVEN_DPE, COMPUTE_FP32)

    mask_base = mask_ptr
    mask_rows = offs_m
    if HAS_MASK:  # int32 offsets inside the request's block keep the mask tile cheap
        mask_base = mask_ptr + tl.load(mask_indptr_ptr + b).to(tl.int64)
        if PREFIX_MASK:  # [E, P + E] blocks, column = key position
            mask_rows = offs_m * (prefix_len + ext_len)
        else:  # [E, E] blocks over the new tokens (the prefix is fully visible)
            mask_rows = offs_m * ext_len
            mask_base = mask_base - prefix_len

    qk_scale = sm_scale * 1.4426950408889634
    # prefix keys are stored as K / k_scale: their scores use sm_scale * k_scale
    pre_sm_scale = sm_scale
    pre_qk_scale = qk_scale
    if K_SCALED:
        pre_sm_scale = sm_scale * k_scale
        pre_qk_scale = pre_sm_scale * 1.4426950408889634
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)

    # ---- stage 1: cached prefix, keys j in [0, n_prefix), positions prefix_start + j ----
    # (compiled out when the host says no request has a prefix: HAS_PREFIX)
    if HAS_PREFIX:
        lo = 0
        a = 0
        if HAS_WINDOW:
            lo = (tl.maximum(n_prefix + m0 - window, 0) // BLOCK_NP) * BLOCK_NP
            a = tl.cdiv(tl.maximum(n_prefix + m1 - 1 - window, 0), BLOCK_NP) * BLOCK_NP
        full_end = (n_prefix // BLOCK_NP) * BLOCK_NP
        if PREFIX_MASK:
            full_end = lo
        s1, s2 = _runs(lo, a, full_end)
        k_buf_head = k_buf_ptr + kv_head.to(tl.int64) * stride_kbh
        v_buf_head = v_buf_ptr + kv_head.to(tl.int64) * stride_vbh
        idx_ptr = kv_indices_ptr + kv_start
        # PREFIX_F16 (fp8 prefix, bf16 queries): the prefix dots run in fp16, whose conversion
        # from fp8 is one instruction on sm_89+ (bf16 needs two), as in the decode kernel; q is
        # clamped to fp16's range, p (in [0, 1]) is rounded to fp16 instead of bf16
        q_pre = q
        q_pe_pre = q_pe
        if PREFIX_F16:
            q_pre = _saturate_to_f16(q)
            if BLOCK_DPE > 0:
                q_pe_pre = _saturate_to_f16(q_pe)
        acc, l_i, m_i = _attn_run(
            acc, l_i, m_i, q_pre, q_pe_pre, lo, s1, n_prefix, k_buf_head, v_buf_head, stride_kbt, stride_vbt, idx_ptr,
            q_pos, prefix_start, mask_base, mask_rows, row_valid, pre_qk_scale, pre_sm_scale, logit_cap, window,
            offs_d, offs_dpe, offs_dv, True, True, IS_CAUSAL, PREFIX_MASK, HAS_WINDOW, HAS_CAP,
            DK, DV, BLOCK_NP, BLOCK_DPE, EVEN_DK, EVEN_DPE, EVEN_DV, COMPUTE_FP32, DOT_PREC,
        )
        if not PREFIX_MASK:
            acc, l_i, m_i = _attn_run(
                acc, l_i, m_i, q_pre, q_pe_pre, s1, s2, n_prefix, k_buf_head, v_buf_head, stride_kbt, stride_vbt, idx_ptr,
                q_pos, prefix_start, mask_base, mask_rows, row_valid, pre_qk_scale, pre_sm_scale, logit_cap, window,
                offs_d, offs_dpe, offs_dv, True, False, IS_CAUSAL, PREFIX_MASK, HAS_WINDOW, HAS_CAP,
                DK, DV, BLOCK_NP, BLOCK_DPE, EVEN_DK, EVEN_DPE, EVEN_DV, COMPUTE_FP32, DOT_PREC,
            )
        acc, l_i, m_i = _attn_run(
            acc, l_i, m_i, q_pre, q_pe_pre, s2, n_prefix, n_prefix, k_buf_head, v_buf_head, stride_kbt, stride_vbt, idx_ptr,
            q_pos, prefix_start, mask_base, mask_rows, row_valid, pre_qk_scale, pre_sm_scale, logit_cap, window,
            offs_d, offs_dpe, offs_dv, True, True, IS_CAUSAL, PREFIX_MASK, HAS_WINDOW, HAS_CAP,
            DK, DV, BLOCK_NP, BLOCK_DPE, EVEN_DK, EVEN_DPE, EVEN_DV, COMPUTE_FP32, DOT_PREC,
        )

        if V_SCALED:  # acc holds only prefix terms so far (sum of p * V_stored): make them true values
            acc = acc * v_scale

    # ---- stage 2: new tokens, keys t in [0, ext_len), positions prefix_len + t ----
    hi = ext_len
    full_end = (ext_len // BLOCK_N) * BLOCK_N
    if IS_CAUSAL and not HAS_MASK:
        hi = m1
        full_end = ((m0 + 1) // BLOCK_N) * BLOCK_N
    lo = 0
    a = 0
    if HAS_WINDOW:
        lo = (tl.maximum(m0 - window, 0) // BLOCK_N) * BLOCK_N
        a = tl.cdiv(tl.maximum(m1 - 1 - window, 0), BLOCK_N) * BLOCK_N
    if HAS_MASK:
        full_end = lo
    s1, s2 = _runs(lo, a, full_end)
    k_ext_head = k_ext_ptr + qo_start.to(tl.int64) * stride_ket + kv_head.to(tl.int64) * stride_keh
    v_ext_head = v_ext_ptr + qo_start.to(tl.int64) * stride_vet + kv_head.to(tl.int64) * stride_veh
    acc, l_i, m_i = _attn_run(
        acc, l_i, m_i, q, q_pe, lo, s1, ext_len, k_ext_head, v_ext_head, stride_ket, stride_vet, kv_indices_ptr,
        q_pos, prefix_len, mask_base, mask_rows, row_valid, qk_scale, sm_scale, logit_cap, window,
        offs_d, offs_dpe, offs_dv, False, True, IS_CAUSAL, HAS_MASK, HAS_WINDOW, HAS_CAP,
        DK, DV, BLOCK_N, BLOCK_DPE, EVEN_DK, EVEN_DPE, EVEN_DV, COMPUTE_FP32, DOT_PREC,
    )
    if (K_DESC or V_DESC) and not HAS_PREFIX and not HAS_MASK and not HAS_CAP and BLOCK_DPE == 0:  # kv_desc
        acc, l_i, m_i = _attn_run_desc(
            acc, l_i, m_i, q, s1, s2, k_ext_head, v_ext_head, stride_ket, stride_vet,
            k_ext_desc, v_ext_desc, qo_start.to(tl.int32), kv_head * DK, kv_head * DV, qk_scale, offs_d, offs_dv,
            K_DESC, V_DESC, DK, DV, BLOCK_N, EVEN_DK, EVEN_DV, COMPUTE_FP32, DOT_PREC,
        )
    elif not HAS_MASK:
        acc, l_i, m_i = _attn_run(
            acc, l_i, m_i, q, q_pe, s1, s2, ext_len, k_ext_head, v_ext_head, stride_ket, stride_vet, kv_indices_ptr,
            q_pos, prefix_len, mask_base, mask_rows, row_valid, qk_scale, sm_scale, logit_cap, window,
            offs_d, offs_dpe, offs_dv, False, False, IS_CAUSAL, HAS_MASK, HAS_WINDOW, HAS_CAP,
            DK, DV, BLOCK_N, BLOCK_DPE, EVEN_DK, EVEN_DPE, EVEN_DV, COMPUTE_FP32, DOT_PREC,
        )
    acc, l_i, m_i = _attn_run(
        acc, l_i, m_i, q, q_pe, s2, hi, ext_len, k_ext_head, v_ext_head, stride_ket, stride_vet, kv_indices_ptr,
        q_pos, prefix_len, mask_base, mask_rows, row_valid, qk_scale, sm_scale, logit_cap, window,
        offs_d, offs_dpe, offs_dv, False, True, IS_CAUSAL, HAS_MASK, HAS_WINDOW, HAS_CAP,
        DK, DV, BLOCK_N, BLOCK_DPE, EVEN_DK, EVEN_DPE, EVEN_DV, COMPUTE_FP32, DOT_PREC,
    )

    if HAS_SINK:  # head h's sink: a key of logit sinks[h] (natural units -> log2) and value 0
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_fin)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
    # Queries that saw no key (l_i == 0) output zeros (with a sink: acc is 0 there).
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    o_ptrs = o_ptr + (qo_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_dv < DV)[None, :])


def _use_gluon_prefill(q_extend, k_extend, v_extend, o_extend, is_causal, custom_mask, logit_cap,
                       sliding_window_size, max_len_extend: int = 0, batch_invariant: bool = False,
                       has_prefix: bool = False, k_buffer=None, v_buffer=None, k_scale: float = 1.0,
                       v_scale: float = 1.0, sinks: Optional[torch.Tensor] = None) -> bool:
    """The Gluon kernel for this causal prefill (`prefill_gluon.gluon_prefill_enabled`:
    ``ATTNSERVE_EXTEND_GLUON``, else by ``max_len_extend``, never for ``batch_invariant``
    launches by default; with ``has_prefix`` unless ``ATTNSERVE_EXTEND_GLUON_PREFIX`` is off)
    where `prefill_gluon.gluon_prefill_supported` (sm_90; a prefix needs a 16-bit cache of
    scale 1). Its bits differ from this kernel's (other tiles), within bf16 rounding. Never
    with attention ``sinks`` (the Gluon kernels do not implement them; this kernel does)."""
    if sinks is not None:
        return False
    from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_enabled, gluon_prefill_supported

    if not gluon_prefill_enabled(max_len_extend, batch_invariant, has_prefix=bool(has_prefix)):
        return False
    return gluon_prefill_supported(q_extend, k_extend, v_extend, o_extend, is_causal=bool(is_causal),
                                   has_prefix=bool(has_prefix), custom_mask=custom_mask, logit_cap=float(logit_cap),
                                   sliding_window_size=-1 if sliding_window_size is None else int(sliding_window_size),
                                   k_buffer=k_buffer, v_buffer=v_buffer, k_scale=k_scale, v_scale=v_scale,
                                   sinks=sinks)


def _new_token_descriptors(k_extend: torch.Tensor, v_extend: torch.Tensor, block_n: int, interpret: bool):
    """Host TMA descriptors of the new tokens' K and V as ``[T, Hkv * D]`` (tile ``[block_n,
    D]`` at column ``kv_head * D``), or None where TMA cannot read them (the kernel then uses
    pointers): heads not packed, rows or base not 16-byte aligned, a GPU below sm 90, or a
    Triton without host tensor descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton < 3.3
        return None
    if not interpret and (k_extend.device.type != "cuda" or torch.cuda.get_device_capability(k_extend.device)[0] < 9):
        return None
    descs = []
    for x in (k_extend, v_extend):
        t, h, d = x.shape
        row_bytes = x.stride(0) * x.element_size()
        if x.stride(1) != d or row_bytes % 16 or x.data_ptr() % 16 or (d * x.element_size()) % 16:
            return None
        descs.append(TensorDescriptor(x, [t, h * d], [x.stride(0), 1], [block_n, d]))
    return descs


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: Optional[torch.Tensor],
    is_causal: bool,
    mask_indptr: Optional[torch.Tensor],
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    sliding_window_size: int = -1,
    prefix_kv_start: Optional[torch.Tensor] = None,
    *,
    mask_covers_prefix: bool = True,
    config: Optional[ExtendConfig] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    has_prefix: bool = True,
    batch_invariant: bool = False,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of new tokens over their cached prefix (paged) and over each other.

    One online softmax (FlashAttention-2, arXiv:2307.08691) covers the prefix keys (read
    from ``k_buffer``/``v_buffer`` at slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``)
    and the new keys ``k_extend``/``v_extend``; accumulation is float32. Prefix keys/values
    are dequantised as ``k_scale * k_buffer`` / ``v_scale * v_buffer``; the new tokens'
    ``k_extend``/``v_extend`` are used as given.

    Args:
        q_extend: ``[T, Hq, Dk]``; k_extend: ``[T, Hkv, Dk]``; v_extend: ``[T, Hkv, Dv]``
            (fp16/bf16/fp32, one dtype; last dim contiguous; requests concatenated).
        o_extend: ``[T, Hq, Dv]``, written (every row of every request).
        k_buffer / v_buffer: paged cache ``[num_slots, Hkv, Dk / Dv]`` (one dtype: q's, or
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` for an fp8 KV cache).
        qo_indptr: int32/int64 ``[bs + 1]`` new-token offsets.
        kv_indptr: int32/int64 ``[bs + 1]``; kv_indices: prefix token slots.
        custom_mask: None, or bool/uint8 flat mask; request i's block starts at
            ``mask_indptr[i]`` and is row-major ``[E_i, P_i + E_i]`` (column = absolute key
            position). Replaces causal masking when given (tree verification). With
            ``mask_covers_prefix=False`` the blocks are ``[E_i, E_i]`` over the new tokens
            only and every prefix key is visible (the prefix tiles then run unmasked;
            fixed-size blocks, as CUDA-graph verify needs).
        is_causal: causal masking over the new tokens (ignored with ``custom_mask``).
        mask_indptr: int32/int64 ``[bs]`` (or ``[bs+1]``), required with ``custom_mask``.
        max_len_extend: host int >= max ``E_i`` (sets the grid; no device read).
        sm_scale: softmax scale.
        logit_cap: if > 0, scores become ``logit_cap * tanh(score / logit_cap)``.
        sliding_window_size: if >= 0, a query at position p sees keys at positions k with
            ``p - sliding_window_size <= k <= p``: the lower bound is applied on top of the
            causal or custom mask, which provides ``k <= p`` (with ``is_causal=False`` and
            no custom mask only the lower bound applies). Key tiles below the window are
            skipped.
        prefix_kv_start: int32/int64 ``[bs]`` absolute position of each request's first
            prefix key (None: 0).
        config: override of `extend_config` (tuning). The default depends on the device,
            the dtype, the head sizes, ``has_prefix``, causality and, for plain causal
            prefills on sm_90, on ``max_len_extend`` (`extend_tuning`). Without a config,
            plain causal prefills on sm_90 (bf16/fp16, D 128, no window / cap / mask,
            ``has_prefix=False``) whose longest request has >= ``GLUON_PREFILL_MIN_LEN``
            tokens run the Gluon kernel (`prefill_gluon.gluon_prefill_fwd`); the switch
            ``ATTNSERVE_EXTEND_GLUON`` (1 / 0) overrides the length rule. With
            ``has_prefix`` (a 16-bit cache, scales 1) the same rule applies unless
            ``ATTNSERVE_EXTEND_GLUON_PREFIX`` is off (default on).
        has_prefix: False promises that no request has a cached prefix (a plain prefill:
            ``kv_indptr`` all zeros); the prefix stage is then compiled out and the
            buffers are not read, and the default config has no separate prefix tile.
            With an fp8 pool the prefix stage's code alone made a plain prefill 1.3x
            slower (H100, benchmarks/NOTES.md session 15). A wrong False drops the
            prefixes from the attention. True (default) is right for any batch.
        batch_invariant: the default config must not depend on the rest of the batch
            (``max_len_extend``): ``--enable-deterministic-inference`` (`extend_config`).
        k_scale / v_scale: host floats > 0, per-tensor dequantisation scales of
            ``k_buffer`` / ``v_buffer`` (true value = stored value * scale; applied with any
            buffer dtype, to the prefix only: ``k_extend`` / ``v_extend`` are true values).
            The defaults (1.0) run exactly the unscaled kernel.
        sinks: None, or attention sinks (gpt-oss): float32 (bf16 / fp16 accepted)
            contiguous ``[Hq]`` on q's device, head ``h``'s sink logit in the units of the
            scaled scores (not soft-capped); it joins each query's softmax as a key of value
            0 (`attnserve.attention.sinks`). A launch with sinks never takes the Gluon
            prefill kernels (`_use_gluon_prefill`).

    Returns:
        ``o_extend``; queries that see no key get zeros.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices, or a custom mask without
            ``mask_indptr`` (host-side checks only).
    """
    if q_extend.dim() != 3 or k_extend.dim() != 3 or v_extend.dim() != 3 or o_extend.dim() != 3:
        raise ValueError("q_extend, k_extend, v_extend and o_extend must be 3-D ([tokens, heads, dim])")
    if k_buffer.dim() != 3 or v_buffer.dim() != 3:
        raise ValueError("k_buffer and v_buffer must be 3-D ([slots, heads, dim])")
    t, hq, dk = q_extend.shape
    hkv = k_extend.shape[1]
    dv = v_extend.shape[2]
    if (
        k_extend.shape != (t, hkv, dk) or v_extend.shape[:2] != (t, hkv) or o_extend.shape != (t, hq, dv)
        or k_buffer.shape[1:] != (hkv, dk) or v_buffer.shape[1:] != (hkv, dv)
    ):
        raise ValueError(
            f"shape mismatch: q_extend {tuple(q_extend.shape)}, k_extend {tuple(k_extend.shape)}, "
            f"v_extend {tuple(v_extend.shape)}, o_extend {tuple(o_extend.shape)}, "
            f"k_buffer {tuple(k_buffer.shape)}, v_buffer {tuple(v_buffer.shape)}"
        )
    if hkv < 1 or hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    tensors = [q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices]
    tensors += [x for x in (custom_mask, mask_indptr, prefix_kv_start) if x is not None]
    if len({x.device for x in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted({str(x.device) for x in tensors})}")
    dtypes = {x.dtype for x in (q_extend, k_extend, v_extend)}
    if (
        len(dtypes) != 1 or q_extend.dtype not in (torch.float16, torch.bfloat16, torch.float32)
        or v_buffer.dtype != k_buffer.dtype or k_buffer.dtype not in (q_extend.dtype,) + FP8_DTYPES
    ):
        got = sorted(map(str, dtypes | {k_buffer.dtype, v_buffer.dtype}))
        raise ValueError(
            f"q/k/v (extend and buffers) must share one of fp16/bf16/fp32 (or k_buffer/v_buffer both "
            f"float8_e4m3fn/float8_e5m2), got {got}"
        )
    k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    for name, x in (("q_extend", q_extend), ("k_extend", k_extend), ("v_extend", v_extend),
                    ("o_extend", o_extend), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    bs = qo_indptr.shape[0] - 1
    if qo_indptr.dim() != 1 or bs < 0 or kv_indptr.dim() != 1 or kv_indptr.shape[0] < bs + 1:
        raise ValueError("qo_indptr must be [bs+1] and kv_indptr [>= bs+1]")
    if custom_mask is not None:
        if mask_indptr is None or mask_indptr.dim() != 1 or mask_indptr.shape[0] < bs:
            raise ValueError("custom_mask needs mask_indptr [>= bs]")
        if custom_mask.dtype not in (torch.bool, torch.uint8, torch.int8):
            raise ValueError(f"custom_mask must be bool/uint8, got {custom_mask.dtype}")
        custom_mask = custom_mask.reshape(-1)
        if custom_mask.dtype == torch.bool:
            custom_mask = custom_mask.view(torch.uint8)
    if prefix_kv_start is not None and (prefix_kv_start.dim() != 1 or prefix_kv_start.shape[0] < bs):
        raise ValueError("prefix_kv_start must be [>= bs]")
    check_kernel_sinks(sinks, hq, q_extend.device)
    interpret = triton_interpreting()
    if q_extend.device.type == "cpu" and not interpret:
        raise ValueError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    if bs == 0 or t == 0 or max_len_extend <= 0:
        return o_extend
    if config is None and not interpret and _use_gluon_prefill(
            q_extend, k_extend, v_extend, o_extend, is_causal, custom_mask, logit_cap, sliding_window_size,
            int(max_len_extend), bool(batch_invariant), bool(has_prefix), k_buffer, v_buffer, k_scale, v_scale,
            sinks):
        from attnserve.attention.triton_ops.prefill_gluon import gluon_prefill_fwd

        prefix = dict(k_buffer=k_buffer, v_buffer=v_buffer, kv_indptr=kv_indptr, kv_indices=kv_indices)
        return gluon_prefill_fwd(q_extend, k_extend, v_extend, o_extend, None, None, int(max_len_extend),
                                 float(sm_scale), qo_indptr=qo_indptr, **(prefix if has_prefix else {}))

    if config is None:
        cuda = q_extend.device.type == "cuda" and not interpret
        config = extend_config(dk, dv, q_extend.dtype, is_hip=torch.version.hip is not None, interpret=interpret,
                               has_custom_mask=custom_mask is not None, has_prefix=has_prefix,
                               is_causal=bool(is_causal) and custom_mask is None, max_len_extend=int(max_len_extend),
                               capability=torch.cuda.get_device_capability(q_extend.device) if cuda else None,
                               batch_invariant=batch_invariant)
    cfg = config
    block_d, block_dpe = _k_dims(dk, cfg.whole_dk)
    block_dv = max(16, triton.next_power_of_2(dv))
    num_m_blocks = triton.cdiv(int(max_len_extend), cfg.block_m)
    compute_fp32 = interpret
    dot_prec = "ieee" if (compute_fp32 or q_extend.dtype == torch.float32) else None
    window = int(sliding_window_size) if sliding_window_size is not None else -1
    dummy = qo_indptr
    plain_run = custom_mask is None and logit_cap <= 0 and block_dpe == 0 and block_dv == dv
    plain_run = plain_run and not has_prefix
    descs = _new_token_descriptors(k_extend, v_extend, cfg.block_n, interpret) if cfg.kv_desc and plain_run else None
    _extend_fwd_kernel[(bs, hq, num_m_blocks)](
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        *(descs or (dummy, dummy)),
        qo_indptr, kv_indptr, kv_indices,
        custom_mask if custom_mask is not None else dummy,
        mask_indptr if custom_mask is not None else dummy,
        prefix_kv_start if prefix_kv_start is not None else dummy,
        sinks if sinks is not None else dummy,
        float(sm_scale), float(logit_cap), max(window, 0), k_scale, v_scale,
        q_extend.stride(0), q_extend.stride(1),
        k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1),
        o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        num_m_blocks,
        GROUP=hq // hkv,
        DK=dk,
        DV=dv,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_NP=cfg.block_n_prefix or cfg.block_n,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv,
        IS_CAUSAL=bool(is_causal),
        HAS_MASK=custom_mask is not None,
        PREFIX_MASK=custom_mask is not None and bool(mask_covers_prefix),
        HAS_WINDOW=window >= 0,
        HAS_CAP=logit_cap > 0,
        HAS_PREFIX_START=prefix_kv_start is not None,
        K_SCALED=k_scale != 1.0,
        V_SCALED=v_scale != 1.0,
        PREFIX_F16=k_buffer.dtype in FP8_DTYPES and q_extend.dtype == torch.bfloat16 and not compute_fp32,
        HAS_PREFIX=bool(has_prefix),
        EVEN_DK=block_d <= dk,  # the main block never crosses Dk
        EVEN_DPE=block_d + block_dpe == dk,
        EVEN_DV=block_dv == dv,
        COMPUTE_FP32=compute_fp32,
        DOT_PREC=dot_prec,
        K_DESC=descs is not None and "k" in cfg.kv_desc,
        V_DESC=descs is not None and "v" in cfg.kv_desc,
        HAS_SINK=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o_extend
