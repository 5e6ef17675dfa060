"""Two-stage split-K decode attention over a paged KV cache ("flash-decoding").

One query token per request attends to the request's cached keys, which are read through
the CSR index ``kv_indptr`` / ``kv_indices`` (token slots into ``k_buffer`` / ``v_buffer``).

* Stage 1 (`_decode_stage1_kernel`): the request's keys are cut into ``num_kv_splits[b]``
  contiguous splits; one program per (request, KV-head block, split) computes the split's
  softmax-normalised partial output and its log-sum-exp with the online softmax of
  FlashAttention-2 (Dao, arXiv:2307.08691). All query heads that share a KV head (GQA/MQA)
  are processed together: each K/V tile is loaded once and multiplied with ``tl.dot``
  (the head block is padded to >= 16 rows).
* Stage 2 (`decode_merge`): per (request, query head) the partial outputs are merged by
  their log-sum-exp, as in Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023,
  "Flash-Decoding for long-context inference", PyTorch blog / FlashAttention repo), up to
  32 splits per step (one L2 round trip at small batches; `DecodeConfig.merge_block`).
  A request with one split (most of a large batch: `decode_splits`) is finished by stage 1,
  which writes ``o`` directly (the merge of one split is the identity, so the bits are the
  same), and its stage-2 programs return at once.
A fused "last program merges" variant (split-K with arrival counters, as in stream-K
GEMMs) was measured on an H100 and was not faster than stage 2 (its serial merge tail
costs more than the saved launch), so there is none here; see benchmarks/NOTES.md.
Nor is stage 2's launch skipped when every request has one split: a CUDA graph is captured
per batch size and replayed at every length, while the split counts are computed on the
device each step, so the host cannot know it. Small batches instead launch both stages
with programmatic dependent launch (`DecodeConfig.pdl`, `decode_tuning.decode_config`), so
stage 2's launch overlaps stage 1 and its programs for one-split requests only wait and
return.

FP8 KV cache: ``k_buffer`` / ``v_buffer`` may hold float8 (e4m3fn / e5m2) entries with
per-tensor scales (true value = stored * scale). Tiles are converted to q's dtype after
loading (float32 accumulation as always; on CUDA the V tile travels as int16 pairs of
adjacent columns and is converted in registers, see ``V_PAIRS`` in stage 1); K's scale is folded into ``sm_scale`` on the
host and V's scale multiplies each split's output in stage 1 (stage 2 is a convex
combination of the splits, so this is exact). With scales of 1.0 nothing extra runs.

Opt-in Gluon stage 1 for an e4m3 cache on Hopper (``ATTNSERVE_DECODE_FP8_GLUON=1``, default off;
`decode_fp8_gluon`): head size 128, no logit cap, non-deterministic launches, int32 indices.
It gathers K/V rows with cp.async into a multi-buffered shared ring (the Triton kernel keeps
one buffer for these gathered loads) and writes the same outputs, so stage 2 is unchanged.

Attention sinks (gpt-oss, ``sinks``: one logit per query head; `attnserve.attention.sinks`):
a virtual key of logit ``sinks[h]`` and value 0. Stage 2 merges it as one more partial
(log-sum-exp ``sinks[h]``, output 0); a request of one split, finished by stage 1, is
scaled there by ``1 / (1 + exp(sinks[h] - lse))``. Behind the ``HAS_SINK`` constexpr of
both stages (without sinks the kernels are the ones before). The Gluon fp8 stage 1 does
not implement them: a call with sinks keeps the Triton stage 1 whatever
``ATTNSERVE_DECODE_FP8_GLUON`` says.

Everything the launch depends on is host-known (bs, head counts, ``max_kv_splits``), and
no host synchronisation happens, so `decode_attention_fwd` is CUDA-graph capturable.
Tuning lives in `decode_tuning` (`decode_config`), split counts and the split grid in
`decode_splits` (`compute_num_kv_splits`, `decode_grid_splits`); both are re-exported here.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attnserve.attention.triton_ops.decode_tuning import (  # noqa: F401  (re-exported: callers import them here)
    BATCH_PROGRAMS_PER_SM,
    BATCH_TILE,
    FP8_HOPPER_BATCH_TILE,
    FP8_HOPPER_TILE,
    FP8_PAIRS_DEVICES,
    DecodeConfig,
    _head_blocks,
    decode_config,
)
from attnserve.attention.triton_ops.decode_splits import (  # noqa: F401  (re-exported: callers import them here)
    _split_bounds,
    compute_num_kv_splits,
    decode_grid_splits,
    device_num_sms,
)
from attnserve.attention.triton_ops.decode_merge import decode_stage2
from attnserve.attention.sinks import check_kernel_sinks
from attnserve.attention.triton_ops.fp8_pairs_asm import E4M3X2_TO_F16X2, E5M2X2_TO_F16X2
from attnserve.pdl import pdl_enabled
from attnserve.pdl_triton import gdc_launch_dependents, gdc_wait
from attnserve.mem_cache.kv_quant import FP8_DTYPES, check_scale
from attnserve.triton_env import triton_interpreting
from attnserve.triton_jit import tanh

def _split_dims(d: int):
    """Split a head size into a power-of-two main block and a power-of-two remainder block
    (576 -> 512 + 64, 80 -> 64 + 16, 96 -> 64 + 32, 128 -> 128 + 0) so that odd sizes are
    not padded to the next power of two."""
    main = 1 << (d.bit_length() - 1)
    rest = d - main
    if main < 16:
        return 16, 0
    pe = 0 if rest == 0 else max(16, triton.next_power_of_2(rest))
    return main, pe


def _k_dims(d: int, whole: bool):
    """``(BLOCK_D, BLOCK_DPE)`` for a K head of size ``d``: `_split_dims`, or with ``whole`` one
    tile of the next power of two (its tail masked) and no remainder tile."""
    return (max(16, triton.next_power_of_2(d)), 0) if whole else _split_dims(d)


@triton.jit
def _saturate_to_f16(x):
    """``x`` (bf16, fp16 or fp32) as fp16, clamped to fp16's finite range (+-65504) so that a
    bf16 query above it becomes the largest fp16 instead of inf (IEEE 754 binary16's
    largest finite value). For the fp16 dots over fp8 tiles: fp8 -> fp16 is one conversion
    on sm_89+, fp8 -> bf16 two."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


_E4M3X2_ASM = tl.constexpr(E4M3X2_TO_F16X2)
_E5M2X2_ASM = tl.constexpr(E5M2X2_TO_F16X2)


@triton.jit
def _fp8_pairs_to_f16(vp, E5M2: tl.constexpr):
    """Split int16 pairs of fp8 values (byte 0: column 2c, byte 1: column 2c+1) into two
    fp16 tensors (columns 2c, 2c+1). ``pack=2`` hands each asm instance the two
    consecutive register elements of a thread; in the 16-bit ``tl.dot`` B-operand layout
    (loaded with ``ldmatrix.trans``) these are rows k, k+1 of one column, so one ``prmt``
    regroups the four bytes into (row k, row k+1) pairs per fp8 column and one
    ``cvt.rn.f16x2.e4m3x2`` per pair converts them (PTX ISA, sm_89+; e5m2 is fp16's upper
    byte, so a ``prmt`` with zero low bytes is its exact conversion; the asm text is
    `fp8_pairs_asm`'s)."""
    if E5M2:
        ve, vo = tl.inline_asm_elementwise(
            _E5M2X2_ASM, "=r,=r,r", [vp], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        ve, vo = tl.inline_asm_elementwise(
            _E4M3X2_ASM, "=r,=r,r", [vp], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return ve, vo


@triton.jit
def _decode_stage1_kernel(
    q_ptr, k_ptr, v_ptr,
    kv_indptr_ptr, kv_indices_ptr, num_kv_splits_ptr,
    logits_ptr, lse_ptr, o_ptr, sinks_ptr,
    sm_scale, logit_cap, v_scale,
    stride_qb, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh,
    stride_ob, stride_oh,
    grid_splits,
    max_kv_splits,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CAP: tl.constexpr,
    V_SCALED: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
    F16_DOT: tl.constexpr,
    V_PAIRS: tl.constexpr = False,
    E5M2: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    HAS_SINK: tl.constexpr = False,
):
    # V_PAIRS (fp8 cache, 16-bit dots, see `_v_pairs_ok`): ``v_ptr`` / ``stride_vt`` /
    # ``stride_vh`` address the V buffer viewed as int16 (two fp8 values of adjacent columns
    # per element). The tile goes to shared memory as 16-bit pairs and is read with the
    # 16-bit ``ldmatrix.trans`` path; `_fp8_pairs_to_f16` then converts it in registers to
    # the even and odd columns, multiplied by two dots of BLOCK_DV / 2 columns. (Without
    # it, the fp8 V tile, row-major in memory, reaches the dot-operand layout, which wants
    # 4 consecutive keys per thread, through one 1-byte shared-memory load per element.)
    # F16_DOT (fp8 cache, bf16 queries): the dots run in fp16, whose conversion from fp8 is
    # one instruction on sm_89+ (bf16 needs two); q is clamped to fp16's range first.
    # sm_scale already includes K's dequantisation scale (folded on the host); V's scale
    # (``v_scale``, applied only when V_SCALED) multiplies each split's output. K/V tiles
    # of another dtype than q (fp8 caches) are converted to q's dtype before ``tl.dot``
    # (``.to`` is a no-op when the dtypes agree).
    # USE_PDL: nothing is read before the wait (q and this layer's new K/V come from the
    # kernels just before, the indices from the step's metadata kernels further back), and
    # stage 2 may launch once every program has passed its wait (`decode_merge`).
    # HAS_SINK: ``sinks_ptr`` holds one float logit per query head (natural-log units of the
    # scaled scores); only a one-split request's output, written here, needs it (stage 2
    # merges it for the others).
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    kv_head = pid_h // HEAD_BLOCKS
    h_in_group = (pid_h % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = h_in_group < GROUP
    q_head = kv_head * GROUP + h_in_group

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < DK
    mask_dv = offs_dv < DV
    # All first loads go out before anything waits on one: q (and its rope part), the
    # request's bounds and its split count (their addresses depend on the program id alone).
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < DK
        q_pe = tl.load(q_ptrs + offs_dpe[None, :], mask=mask_h[:, None] & mask_dpe[None, :], other=0.0)
    kv_start = tl.load(kv_indptr_ptr + b)
    kv_end = tl.load(kv_indptr_ptr + b + 1)
    splits_b = tl.load(num_kv_splits_ptr + b)
    kv_len = kv_end - kv_start
    per, n_splits = _split_bounds(kv_len, splits_b, max_kv_splits, BLOCK_N)
    if COMPUTE_FP32 or BLOCK_H == 1:
        q = q.to(tl.float32)
    elif F16_DOT:
        q = _saturate_to_f16(q)
    if BLOCK_DPE > 0:
        if COMPUTE_FP32 or BLOCK_H == 1:
            q_pe = q_pe.to(tl.float32)
        elif F16_DOT:
            q_pe = _saturate_to_f16(q_pe)
    qk_scale = sm_scale * 1.4426950408889634

    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_vh
    idx_ptr = kv_indices_ptr + kv_start
    out_ptrs = logits_ptr + b.to(tl.int64) * stride_lb + q_head[:, None] * stride_lh + offs_dv[None, :]
    lse_ptrs = lse_ptr + b.to(tl.int64) * stride_eb + q_head * stride_eh

    for split in range(pid_s, n_splits, grid_splits):
        lo = split * per
        hi = tl.minimum(lo + per, kv_len)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        if V_PAIRS:
            acc_e = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
            acc_o = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slots = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(
                k_head_ptr + slots[:, None] * stride_kt + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            if COMPUTE_FP32:
                k = k.to(tl.float32)
            if BLOCK_H == 1:
                qk = tl.sum(q[:, None, :] * k[None, :, :].to(tl.float32), axis=2)
            else:
                qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
            if BLOCK_DPE > 0:
                k_pe = tl.load(
                    k_head_ptr + slots[:, None] * stride_kt + offs_dpe[None, :],
                    mask=mask_n[:, None] & mask_dpe[None, :],
                    other=0.0,
                )
                if COMPUTE_FP32:
                    k_pe = k_pe.to(tl.float32)
                if BLOCK_H == 1:
                    qk += tl.sum(q_pe[:, None, :] * k_pe[None, :, :].to(tl.float32), axis=2)
                else:
                    qk += tl.dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), input_precision=DOT_PREC)
            if HAS_CAP:
                qk = logit_cap * tanh(qk * (sm_scale / logit_cap)) * 1.4426950408889634
            else:
                qk = qk * qk_scale
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if V_PAIRS:
                vp = tl.load(
                    v_head_ptr + slots[:, None] * stride_vt + tl.arange(0, BLOCK_DV // 2)[None, :],
                    mask=mask_n[:, None],
                    other=0,
                )
                v_e, v_o = _fp8_pairs_to_f16(vp, E5M2)
                p16 = p.to(tl.float16)
                acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_e)
                acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_o)
            else:
                v = tl.load(
                    v_head_ptr + slots[:, None] * stride_vt + offs_dv[None, :],
                    mask=mask_n[:, None] & mask_dv[None, :],
                    other=0.0,
                )
                if COMPUTE_FP32:
                    v = v.to(tl.float32)
                if BLOCK_H == 1:
                    pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
                else:
                    v = v.to(q.dtype)
                    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
                acc = acc * alpha[:, None] + pv
            m_i = m_new
        if V_PAIRS:  # columns 2c (acc_e) and 2c + 1 (acc_o) back in order
            acc = tl.reshape(tl.join(acc_e, acc_o), [BLOCK_H, BLOCK_DV])
        # Every visited split holds >= 1 key, so l_i > 0 for every row.
        part = acc / l_i[:, None]
        if V_SCALED:
            part = part * v_scale
        if n_splits == 1:
            # the whole request in one split: this is the output (what stage 2 would compute
            # from one split: weight exp(lse - lse) = 1), and stage 2 skips the request
            if HAS_SINK:  # the sink's share of the softmax: out *= 1 / (1 + exp(sink - lse)), in log2 units
                sink = tl.load(sinks_ptr + q_head, mask=mask_h, other=0.0).to(tl.float32)
                part = part / (1.0 + tl.exp2(sink * 1.4426950408889634 - (m_i + tl.log2(l_i))))[:, None]
            o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + q_head[:, None] * stride_oh + offs_dv[None, :]
            tl.store(o_ptrs, part.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_dv[None, :])
        else:
            tl.store(
                out_ptrs + split * stride_ls,
                part,
                mask=mask_h[:, None] & mask_dv[None, :],
            )
            tl.store(lse_ptrs + split, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=mask_h)


def _v_pairs_ok(q: torch.Tensor, v_buffer: torch.Tensor, block_dv: int) -> bool:
    """Whether stage 1 may read an fp8 V buffer as int16 pairs of adjacent columns
    (``V_PAIRS``; CUDA only, 16-bit queries, ``Dv`` a power of two >= 32, every stride and
    the base address even so that each pair is one aligned int16)."""
    return (
        v_buffer.dtype in FP8_DTYPES and q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
        and v_buffer.shape[2] == block_dv and block_dv >= 32
        and v_buffer.stride(0) % 2 == 0 and v_buffer.stride(1) % 2 == 0 and v_buffer.data_ptr() % 2 == 0
    )


def _fp8_gluon_route(q, k_buffer, v_buffer, kv_indptr, kv_indices, num_kv_splits, logit_cap, batch_invariant):
    """The `decode_fp8_gluon.GluonFp8DecodeConfig` with which ``ATTNSERVE_DECODE_FP8_GLUON``
    (default off, read at every call; `decode_fp8_gluon.gluon_config_from_env`) routes this
    stage 1 to the Gluon fp8 kernel, or None: the switch on, the call supported
    (`gluon_fp8_decode_supported`), int32 indices and 16-byte aligned K/V rows."""
    import os

    from attnserve.attention.triton_ops.decode_fp8_gluon import (FP8_GLUON_ENV, gluon_config_from_env,
                                                                 gluon_fp8_decode_supported, gluon_fp8_operands_ok)

    cfg = gluon_config_from_env(os.environ.get(FP8_GLUON_ENV))
    if cfg is None or q.device.type != "cuda":
        return None
    ok = gluon_fp8_decode_supported(
        q.dtype, k_buffer.dtype, k_buffer.shape[2], v_buffer.shape[2], q.shape[1], k_buffer.shape[1],
        float(logit_cap), torch.cuda.get_device_capability(q.device), batch_invariant=batch_invariant,
    ) and gluon_fp8_operands_ok(q, k_buffer, v_buffer, kv_indptr, kv_indices, num_kv_splits)
    return cfg if ok else None


def _max_shared_mem(device: torch.device) -> int:
    """Opt-in shared memory per block (bytes) of a CUDA device; 0 on CPU or when unknown."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0) or 0)


def _device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device ("" on CPU)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    *,
    config: Optional[DecodeConfig] = None,
    grid_splits: Optional[int] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    batch_invariant: bool = False,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Paged decode attention, split-K (Flash-Decoding) with log-sum-exp merge.

    ``o[b, h] = softmax(sm_scale * q[b, h] . K_b^T) V_b`` where ``K_b``/``V_b`` are the
    rows ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of the buffers at KV head
    ``h // (Hq // Hkv)``, dequantised as ``K = k_scale * k_buffer``, ``V = v_scale *
    v_buffer``. Accumulation is float32 (online softmax, FlashAttention-2,
    arXiv:2307.08691); ``tl.dot`` operands are in q's dtype on the GPU (fp8 tiles are
    converted after loading).

    Args:
        q: ``[bs, Hq, Dk]`` fp16/bf16/fp32 (last dim contiguous).
        k_buffer: ``[num_slots, Hkv, Dk]``; v_buffer: ``[num_slots, Hkv, Dv]`` (one dtype:
            q's, or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` for an fp8 KV cache;
            may be views of one MLA buffer, ``Dk != Dv`` is fine).
        o: ``[bs, Hq, Dv]``, written.
        kv_indptr: int32/int64 ``[bs + 1]``; kv_indices: int32/int64 token slots.
        attn_logits: float32 ``[bs, Hq, max_kv_splits, Dv]`` scratch (partial outputs;
            only requests of two or more splits write it and ``attn_lse``).
        attn_lse: float32 ``[bs, Hq, max_kv_splits]`` scratch (natural-log LSE per split).
        num_kv_splits: int32 ``[bs]``, each in ``1..max_kv_splits`` (see
            `compute_num_kv_splits`; values outside are clamped on the device); a request
            gets at most ``cdiv(len, block_n)`` non-empty splits.
        max_kv_splits: host int, the scratch's split capacity (sets the launch grid).
        sm_scale: softmax scale (usually ``Dk ** -0.5``).
        logit_cap: if > 0, scaled scores ``s`` become ``logit_cap * tanh(s / logit_cap)``.
        config: override of `decode_config` (tuning); grid_splits: override of the split
            grid axis (`decode_grid_splits`), mainly for tests.
        k_scale / v_scale: host floats > 0, per-tensor dequantisation scales of the
            buffers (true value = stored value * scale; applied with any buffer dtype).
            ``k_scale`` is folded into ``sm_scale`` on the host; ``v_scale`` multiplies
            each split's partial output, so ``attn_logits`` holds true-valued partials.
            The defaults (1.0) run exactly the unscaled kernels.
        batch_invariant: keep the tiles of `decode_config` that do not depend on the batch
            size (deterministic mode: a request's tiles and split alignment, and so its
            rounding, must not change with the batch it is in). Otherwise batches of at
            least `BATCH_PROGRAMS_PER_SM` stage-1 programs per SM take the batch tiles,
            and batches of at most one stage-1 program per SM at one split a request are
            launched with PDL (`decode_config`; never in batch-invariant mode, although PDL
            does not change any bit).
        sinks: None, or attention sinks (gpt-oss): float32 (bf16 / fp16 accepted)
            contiguous ``[Hq]`` on q's device, head ``h``'s sink logit in the units of the
            scaled scores (not soft-capped); it joins each softmax as a key of value 0
            (`attnserve.attention.sinks`). Read by pointer (CUDA-graph safe). Keeps the
            Triton stage 1 under ``ATTNSERVE_DECODE_FP8_GLUON``.

    Returns:
        ``o``. A request with zero keys gets zeros.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices (host-side checks only; the
            kernels trust ``kv_indptr`` / ``kv_indices`` values).
    """
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3 or o.dim() != 3:
        raise ValueError("q, k_buffer, v_buffer and o must be 3-D ([tokens, heads, dim])")
    tensors = (q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    bs, hq, dk = q.shape
    _, hkv, dk_buf = k_buffer.shape
    dv = v_buffer.shape[2]
    if dk_buf != dk or v_buffer.shape[1] != hkv or tuple(o.shape) != (bs, hq, dv):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k_buffer {tuple(k_buffer.shape)}, "
            f"v_buffer {tuple(v_buffer.shape)}, o {tuple(o.shape)}"
        )
    if hkv < 1 or hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if (
        q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or v_buffer.dtype != k_buffer.dtype
        or k_buffer.dtype not in (q.dtype,) + FP8_DTYPES
    ):
        raise ValueError(
            f"q/k_buffer/v_buffer must share one of fp16/bf16/fp32 (or k_buffer/v_buffer both "
            f"float8_e4m3fn/float8_e5m2), got {q.dtype}/{k_buffer.dtype}/{v_buffer.dtype}"
        )
    k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o), ("attn_logits", attn_logits)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if attn_logits.dtype != torch.float32 or attn_lse.dtype != torch.float32:
        raise ValueError("attn_logits and attn_lse must be float32")
    if (
        attn_logits.dim() != 4 or attn_logits.shape[0] < bs or attn_logits.shape[1] != hq
        or attn_logits.shape[2] < max_kv_splits or attn_logits.shape[3] < dv
    ):
        raise ValueError(f"attn_logits must be [>= {bs}, {hq}, >= {max_kv_splits}, >= {dv}], got {tuple(attn_logits.shape)}")
    if attn_lse.dim() != 3 or attn_lse.shape[0] < bs or attn_lse.shape[1] != hq or attn_lse.shape[2] < max_kv_splits:
        raise ValueError(f"attn_lse must be [>= {bs}, {hq}, >= {max_kv_splits}], got {tuple(attn_lse.shape)}")
    if attn_lse.stride(-1) != 1:
        raise ValueError("attn_lse must have a contiguous last dimension")
    if kv_indptr.dim() != 1 or kv_indptr.shape[0] < bs + 1 or num_kv_splits.dim() != 1 or num_kv_splits.shape[0] < bs:
        raise ValueError("kv_indptr must be [>= bs+1] and num_kv_splits [>= bs]")
    if max_kv_splits < 1:
        raise ValueError(f"max_kv_splits must be >= 1, got {max_kv_splits}")
    check_kernel_sinks(sinks, hq, q.device)
    interpret = triton_interpreting()
    if q.device.type == "cpu" and not interpret:
        raise ValueError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    if bs == 0:
        return o

    group = hq // hkv
    cfg = config or decode_config(dk, group, k_buffer.dtype, is_hip=torch.version.hip is not None,
                                   max_shared_mem=_max_shared_mem(q.device), device_name=_device_name(q.device),
                                   batch_size=0 if batch_invariant else bs, num_kv_heads=hkv,
                                   num_sms=device_num_sms(q.device))
    block_h = cfg.block_h
    if block_h > 1:
        block_h = max(16, block_h)
    head_blocks = _head_blocks(block_h, group)
    if block_h == 1 and group != 1:
        raise ValueError("block_h == 1 (per-head kernel) needs group size 1")
    head_programs = hkv * head_blocks
    g = grid_splits or decode_grid_splits(bs, head_programs, max_kv_splits, device_num_sms(q.device))
    g = max(1, min(int(g), max_kv_splits))
    gluon_cfg = None
    if k_buffer.dtype == torch.float8_e4m3fn and not interpret and sinks is None:
        gluon_cfg = _fp8_gluon_route(q, k_buffer, v_buffer, kv_indptr, kv_indices, num_kv_splits, logit_cap,
                                     batch_invariant)
    if gluon_cfg is not None:
        from attnserve.attention.triton_ops.decode_fp8_gluon import gluon_fp8_decode_stage1

        gluon_fp8_decode_stage1(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse,
                                num_kv_splits, max_kv_splits, sm_scale, g, k_scale=k_scale, v_scale=v_scale,
                                config=gluon_cfg)
        decode_stage2(attn_logits, attn_lse, o, kv_indptr, num_kv_splits, max_kv_splits,
                      split_align=gluon_cfg.split_align, merge_block=cfg.merge_block,
                      num_warps=cfg.stage2_warps, use_pdl=False, merge_heads=cfg.merge_heads)
        return o
    block_d, block_dpe = _k_dims(dk, cfg.whole_dk)
    block_dv = max(16, triton.next_power_of_2(dv))
    compute_fp32 = interpret
    dot_prec = "ieee" if (compute_fp32 or q.dtype == torch.float32) else None
    v_arg, stride_vt, stride_vh = v_buffer, v_buffer.stride(0), v_buffer.stride(1)
    v_pairs = cfg.v_pairs and not compute_fp32 and block_h > 1 and _v_pairs_ok(q, v_buffer, block_dv)
    if v_pairs:
        try:
            v_arg = v_buffer.view(torch.int16)
            stride_vt, stride_vh = v_arg.stride(0), v_arg.stride(1)
        except RuntimeError:  # a view torch cannot reinterpret: the byte path
            v_pairs, v_arg = False, v_buffer

    use_pdl = cfg.pdl and pdl_enabled(q.device)
    _decode_stage1_kernel[(bs, head_programs, g)](
        q, k_buffer, v_arg,
        kv_indptr, kv_indices, num_kv_splits,
        attn_logits, attn_lse, o, attn_lse if sinks is None else sinks,
        float(sm_scale) * k_scale, float(logit_cap), v_scale,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        stride_vt, stride_vh,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1),
        o.stride(0), o.stride(1),
        g,
        int(max_kv_splits),
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        DK=dk,
        DV=dv,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=block_dv,
        BLOCK_H=block_h,
        BLOCK_N=cfg.block_n,
        HAS_CAP=logit_cap > 0,
        V_SCALED=v_scale != 1.0,
        COMPUTE_FP32=compute_fp32,
        DOT_PREC=dot_prec,
        F16_DOT=k_buffer.dtype in FP8_DTYPES and q.dtype == torch.bfloat16 and not compute_fp32,
        V_PAIRS=v_pairs,
        E5M2=v_pairs and v_buffer.dtype == torch.float8_e5m2,
        USE_PDL=use_pdl,
        HAS_SINK=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not compute_fp32 else {}),
    )
    decode_stage2(attn_logits, attn_lse, o, kv_indptr, num_kv_splits, max_kv_splits, split_align=cfg.block_n,
                  merge_block=cfg.merge_block, num_warps=cfg.stage2_warps, use_pdl=use_pdl,
                  merge_heads=cfg.merge_heads, sinks=sinks)
    return o
