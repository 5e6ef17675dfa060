"""Stream-K ("persistent, flattened") stage 1 of paged decode attention (opt-in).

The split-K stage 1 of `decode_attention` runs one program per (request, head program,
split). At 64-256 requests of ~600-1000 keys that is ~4 waves of programs of 5-7 tiles on an
H100 (one resident program per SM: 3-stage 128-key tiles fill its shared memory), each
paying its own pipeline fill and epilogue with nothing else on the SM, and the last wave is
partial (issue 33: bf16 64 x 640 at 0.82 of the copy rate, fp8 e4m3 144 x 800 at 0.75).

Here, as in the stream-K GEMM decomposition (Osama, Merrill, Cecka, Garland, Owens,
"Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication on
the GPU", PPoPP 2023), every KV tile of the batch is one *unit* of a flattened sequence
``u = hp * T + tile_off[b] + t`` (head program ``hp``, request ``b``, its tile ``t``; ``T``
tiles per head program), and a fixed grid of ``G`` programs (`streamk_num_programs`: two
per SM) takes equal contiguous ranges of ``P`` units. The software pipeline then runs on
across request boundaries and every SM streams the same number of tiles.

* `plan_streamk_decode` (one small kernel per step, shared by all layers of the step, like
  the split counts; CUDA-graph capturable: its grid and buffers follow from ``bs`` and the
  capacity of ``kv_indices``) writes the tile table (request, first key, end key, tile index
  of every tile: four int32 rows, so the loop's loads are plain loads indexed by the unit,
  which the Triton pipeliner can stage), ``tile_off`` and ``(T, P)``. ``P = max(cdiv(HP * T,
  G), (n_max - 2) // (S - 1) + 1)`` (``n_max`` the longest request's tiles, ``S =
  max_kv_splits``): the second term bounds a (request, head program) to ``S`` segments.
* Stage 1 (`_streamk_stage1_kernel`): the online softmax (FlashAttention-2, Dao,
  arXiv:2307.08691) restarts on a tile that begins a segment (a request's first tile or the
  program's first unit); a tile that ends one (the request's last tile or the program's
  last unit) writes the segment's normalised partial output and natural-log LSE to
  ``attn_logits`` / ``attn_lse`` at slot ``pid - u0 // P`` (``u0`` the first unit of its
  (request, head program)), or ``o`` itself when one program holds the whole request.
* Stage 2 (`_streamk_stage2_kernel`): `decode_merge`'s log-sum-exp merge, with the
  segment count of (request, query head) computed from the plan, ``(u0 + n - 1) // P -
  u0 // P + 1`` (``n`` the request's tiles), instead of from ``num_kv_splits``.

Supported: fp16 / bf16 queries with a cache of their dtype or fp8 (e4m3fn / e5m2; V pairs
and fp16 dots as in stage 1 of `decode_attention`), GQA head blocks (``block_h >= 16``),
``logit_cap``, per-tensor scales, PDL, and the interpreter's float32 path. Everything else
(MLA head sizes that split into a rope block, fp32 queries on the GPU, the per-head
``block_h == 1`` path, ``max_kv_splits < 2``, batch-invariant mode, whose results must not
depend on the batch) runs the split-K kernel: `streamk_supported`.

Selection: ``ATTNSERVE_DECODE_STREAMK=1`` (`streamk_enabled`, default off until measured)
routes `decode_attention.decode_attention_fwd` here for batches of at least one head
program per SM (``bs * HP >= num_sms``; smaller batches stay on split-K, whose splits
already spread them), planning per call unless a plan is passed; the sweep calls
`decode_attention_streamk_fwd` directly.

Prediction before the H100 measurement (per layer, CUDA graphs, plan excluded; us, split-K
as measured in issue 33 -> stream-K): bf16 64 x 640 67.9 -> ~60 (0.93 of copy); 144 x 800
~187 -> ~180; 256 x [200, 1800] ~370 -> ~360; fp8 e4m3 144 x 800 ~105 -> ~90; fp8 64 x 640
~48 -> ~40; 8 x 4096 falls back (64 head programs < 132 SMs), unchanged. The plan kernel
costs ~3-4 us once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from attnserve.attention.triton_ops.decode_attention import _fp8_pairs_to_f16, _saturate_to_f16, _split_dims
from attnserve.attention.triton_ops.decode_tuning import DecodeConfig
from attnserve.env_options import env_flag
from attnserve.mem_cache.kv_quant import FP8_DTYPES
from attnserve.pdl_triton import gdc_launch_dependents, gdc_wait
from attnserve.triton_jit import tanh

#: environment switch of the stream-K stage 1 (`streamk_enabled`)
STREAMK_ENV = "ATTNSERVE_DECODE_STREAMK"
#: (block_n, num_stages, num_warps) of the stream-K stage 1, 16-bit cache (one resident program per SM)
STREAMK_TILE = (128, 3, 4)
#: stage-1 programs per SM (`streamk_num_programs`): Triton 3.6 for sm_90a gives the bf16 tile
#: 255 registers x 128 threads and ~78 KB of shared memory, the fp8 one 196 and ~41 KB
#: (`scripts/decode_streamk_offline.py`), so two programs fit on an SM and hide each other's latency
STREAMK_PROGRAMS_PER_SM = 2
#: the same for an fp8 cache (V pairs on CUDA): 128-key tiles waste less on short requests' last tiles
STREAMK_FP8_TILE = (128, 4, 4)


@dataclass
class StreamKPlan:
    """Per-step work decomposition of the stream-K stage 1 (`plan_streamk_decode`).

    tiles: int32 ``[4, cap]`` rows (request, first key, end key (both absolute positions in
    ``kv_indices``), tile index in its request) per tile of one head program; tile_off:
    int32 ``[bs]`` first tile of each request; meta: int32 ``[2]`` (``T`` tiles per head
    program, ``P`` units per program); block_n / head_programs / num_programs /
    max_kv_splits: the host ints the plan was made for (the launch must match them).
    """

    tiles: torch.Tensor
    tile_off: torch.Tensor
    meta: torch.Tensor
    block_n: int
    head_programs: int
    num_programs: int
    max_kv_splits: int


def streamk_enabled() -> bool:
    """Whether ``ATTNSERVE_DECODE_STREAMK`` asks for the stream-K stage 1 (default off; read
    at every call so one process can time both)."""
    return env_flag(STREAMK_ENV, default=False)


def streamk_config(kv_dtype: torch.dtype, base: DecodeConfig) -> DecodeConfig:
    """Stage-1 tile of the stream-K kernel: `STREAMK_TILE` / `STREAMK_FP8_TILE` with the head
    block, V-pairs flag and merge settings of ``base`` (`decode_tuning.decode_config`)."""
    block_n, stages, warps = STREAMK_FP8_TILE if kv_dtype in FP8_DTYPES else STREAMK_TILE
    return replace(base, block_n=block_n, num_stages=stages, num_warps=warps)


def streamk_supported(q: torch.Tensor, k_buffer: torch.Tensor, block_h: int, max_kv_splits: int,
                      batch_invariant: bool, interpret: bool) -> bool:
    """Whether the stream-K kernel handles this launch (see the module docstring); host-only."""
    dk = q.shape[2]
    block_d, block_dpe = _split_dims(dk)
    return (
        block_h > 1 and block_dpe == 0 and block_d == dk and max_kv_splits >= 2 and not batch_invariant
        and (q.dtype in (torch.float16, torch.bfloat16) or interpret)
        and k_buffer.dtype in (q.dtype,) + FP8_DTYPES
    )


def streamk_num_programs(num_sms: int, programs_per_sm: int = STREAMK_PROGRAMS_PER_SM) -> int:
    """Grid of the stream-K stage 1: ``num_sms * programs_per_sm`` (host ints)."""
    return max(1, int(num_sms) * max(1, int(programs_per_sm)))


def streamk_tile_capacity(kv_indices: torch.Tensor, bs: int, block_n: int) -> int:
    """Host-known bound on the tiles of one head program: ``cdiv(len(kv_indices), block_n) +
    bs`` (each request's partial last tile adds at most one)."""
    return triton.cdiv(kv_indices.numel(), block_n) + bs + 1


@triton.jit
def _streamk_plan_kernel(
    kv_indptr_ptr, tiles_ptr, tile_off_ptr, meta_ptr,
    bs, cap, units_per_tile_row, num_programs, max_kv_splits,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per request: its tile offset is the sum of the earlier requests' tiles
    # (each program reads all bs lengths, ~bs^2 int loads in all, nothing serial).
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    before = tl.zeros([BLOCK], dtype=tl.int32)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    longest = tl.zeros([BLOCK], dtype=tl.int32)
    for base in range(0, bs, BLOCK):
        i = base + offs
        m = i < bs
        n = tl.load(kv_indptr_ptr + i + 1, mask=m, other=0) - tl.load(kv_indptr_ptr + i, mask=m, other=0)
        nt = tl.cdiv(n.to(tl.int32), BLOCK_N)
        total += nt
        before += tl.where(i < b, nt, 0)
        longest = tl.maximum(longest, nt)
    off_b = tl.sum(before, 0)
    kv_lo = tl.load(kv_indptr_ptr + b).to(tl.int32)
    kv_hi = tl.load(kv_indptr_ptr + b + 1).to(tl.int32)
    n_b = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
    tl.store(tile_off_ptr + b, off_b)
    for t0 in range(0, n_b, BLOCK):
        t = t0 + offs
        r = off_b + t
        m = (t < n_b) & (r < cap)
        tl.store(tiles_ptr + r, tl.zeros([BLOCK], dtype=tl.int32) + b, mask=m)
        tl.store(tiles_ptr + cap + r, kv_lo + t * BLOCK_N, mask=m)
        tl.store(tiles_ptr + 2 * cap + r, tl.zeros([BLOCK], dtype=tl.int32) + kv_hi, mask=m)
        tl.store(tiles_ptr + 3 * cap + r, t, mask=m)
    if b == 0:
        t_all = tl.sum(total, 0)
        n_max = tl.max(longest, 0)
        per = tl.cdiv(t_all * units_per_tile_row, num_programs)
        per = tl.maximum(per, tl.maximum(n_max - 2, 0) // (max_kv_splits - 1) + 1)
        tl.store(meta_ptr, t_all)
        tl.store(meta_ptr + 1, tl.maximum(per, 1))


def plan_streamk_decode(kv_indptr: torch.Tensor, bs: int, cap: int, block_n: int, head_programs: int,
                        num_programs: int, max_kv_splits: int, out: Optional[StreamKPlan] = None) -> StreamKPlan:
    """Build (or refill ``out``, for CUDA graphs) the stream-K plan of a decode step.

    Args:
        kv_indptr: int32/int64 ``[>= bs + 1]`` on the device (the step's CSR offsets).
        bs: requests; cap: tile-table capacity (`streamk_tile_capacity`).
        block_n: stage-1 keys per tile; head_programs: ``Hkv * head blocks``;
        num_programs: stage-1 grid (`streamk_num_programs`); max_kv_splits: >= 2, the
            scratch's split capacity.

    Returns:
        The plan (launches one kernel of ``bs`` programs; no host synchronisation).

    Raises:
        ValueError: ``max_kv_splits < 2``, ``bs < 1`` or a mismatching ``out``.
    """
    if max_kv_splits < 2 or bs < 1 or num_programs < 1 or head_programs < 1:
        raise ValueError(f"stream-K needs bs, num_programs, head_programs >= 1 and max_kv_splits >= 2, got "
                         f"{bs}, {num_programs}, {head_programs}, {max_kv_splits}")
    dev = kv_indptr.device
    if out is None:
        out = StreamKPlan(torch.zeros(4, cap, dtype=torch.int32, device=dev),
                          torch.zeros(bs, dtype=torch.int32, device=dev),
                          torch.zeros(2, dtype=torch.int32, device=dev), 0, 0, 0, 0)
    elif out.tiles.shape[1] < cap or out.tile_off.shape[0] < bs:
        raise ValueError(f"plan buffers too small: tiles {tuple(out.tiles.shape)}, "
                         f"tile_off {tuple(out.tile_off.shape)}")
    out.block_n, out.head_programs = block_n, head_programs
    out.num_programs, out.max_kv_splits = num_programs, max_kv_splits
    _streamk_plan_kernel[(bs,)](
        kv_indptr, out.tiles, out.tile_off, out.meta,
        bs, out.tiles.shape[1], head_programs, num_programs, max_kv_splits,
        BLOCK_N=block_n, BLOCK=min(1024, max(16, triton.next_power_of_2(bs))),
    )
    return out


@triton.jit
def _store_segment(dst, acc_e, acc_o, acc, inv, mask_h, offs_c, offs_dv, mask_dv, V_PAIRS: tl.constexpr):
    """Store a segment's normalised output ``acc * inv`` (rows ``[BLOCK_H, 1]`` pointers
    ``dst``; V pairs: even columns from ``acc_e``, odd ones from ``acc_o``) in ``dst``'s dtype."""
    if V_PAIRS:
        tl.store(dst + 2 * offs_c[None, :], (acc_e * inv[:, None]).to(dst.dtype.element_ty), mask=mask_h[:, None])
        tl.store(dst + 2 * offs_c[None, :] + 1, (acc_o * inv[:, None]).to(dst.dtype.element_ty), mask=mask_h[:, None])
    else:
        tl.store(dst + offs_dv[None, :], (acc * inv[:, None]).to(dst.dtype.element_ty),
                 mask=mask_h[:, None] & mask_dv[None, :])


@triton.jit
def _streamk_stage1_kernel(
    q_ptr, k_ptr, v_ptr, kv_indices_ptr,
    tiles_ptr, tile_off_ptr, meta_ptr,
    logits_ptr, lse_ptr, o_ptr,
    sm_scale, logit_cap, v_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_lb, stride_lh, stride_ls, stride_eb, stride_eh, stride_ob, stride_oh,
    cap,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_PROGRAMS: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_CAP: tl.constexpr, V_SCALED: tl.constexpr, COMPUTE_FP32: tl.constexpr, DOT_PREC: tl.constexpr,
    F16_DOT: tl.constexpr, V_PAIRS: tl.constexpr = False, E5M2: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    # Arguments as in `decode_attention._decode_stage1_kernel` (V_PAIRS: ``v_ptr`` / strides
    # address the V buffer as int16 pairs); the loop visits units ``pid * P ..`` (see the
    # module docstring). PDL: nothing is read before the wait (the plan comes from a kernel
    # further back, q and K/V from the kernels just before).
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    t_row = tl.load(meta_ptr)
    per = tl.load(meta_ptr + 1)
    u_begin = pid * per
    u_end = tl.minimum(u_begin + per, t_row * HEAD_PROGRAMS)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DV // 2)
    mask_d = offs_d < DK
    mask_dv = offs_dv < DV
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if V_PAIRS:
        acc_e = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
        acc = 0.0  # unused
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        acc_e = 0.0  # unused
        acc_o = 0.0
    for u in range(u_begin, u_end):
        hp = u // t_row
        r = u - hp * t_row
        b = tl.load(tiles_ptr + r)
        lo = tl.load(tiles_ptr + cap + r)
        hi = tl.load(tiles_ptr + 2 * cap + r)
        t = tl.load(tiles_ptr + 3 * cap + r)
        kv_head = hp // HEAD_BLOCKS
        h_in_group = (hp % HEAD_BLOCKS) * BLOCK_H + offs_h
        mask_h = h_in_group < GROUP
        q_head = kv_head * GROUP + h_in_group
        first = (t == 0) | (u == u_begin)
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        if V_PAIRS:
            acc_e = tl.where(first, 0.0, acc_e)
            acc_o = tl.where(first, 0.0, acc_o)
        else:
            acc = tl.where(first, 0.0, acc)
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if COMPUTE_FP32:
            q = q.to(tl.float32)
        elif F16_DOT:
            q = _saturate_to_f16(q)
        offs_n = lo + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(kv_indices_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(k_ptr + kv_head.to(tl.int64) * stride_kh + slots[:, None] * stride_kt + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
        if HAS_CAP:
            qk = logit_cap * tanh(qk * (sm_scale / logit_cap)) * 1.4426950408889634
        else:
            qk = qk * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_base = v_ptr + kv_head.to(tl.int64) * stride_vh + slots[:, None] * stride_vt
        if V_PAIRS:
            vp = tl.load(v_base + offs_c[None, :], mask=mask_n[:, None], other=0)
            v_e, v_o = _fp8_pairs_to_f16(vp, E5M2)
            p16 = p.to(tl.float16)
            acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_e)
            acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_o)
        else:
            v = tl.load(v_base + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
        if (lo + BLOCK_N >= hi) | (u == u_end - 1):
            # the segment ends: its first unit's program and its request's are known from t
            u0 = u - t
            n_b = t + tl.cdiv(hi - lo, BLOCK_N)
            first_prog = u0 // per
            lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
            inv = 1.0 / l_i  # every segment holds >= 1 key, so l_i > 0
            if V_SCALED:
                inv = inv * v_scale
            if first_prog == (u0 + n_b - 1) // per:  # one segment: the output itself
                _store_segment(o_ptr + b.to(tl.int64) * stride_ob + q_head[:, None] * stride_oh, acc_e, acc_o,
                               acc, inv, mask_h, offs_c, offs_dv, mask_dv, V_PAIRS)
            else:
                slot = pid - first_prog
                _store_segment(logits_ptr + b.to(tl.int64) * stride_lb + q_head[:, None] * stride_lh
                               + slot * stride_ls, acc_e, acc_o, acc, inv, mask_h, offs_c, offs_dv, mask_dv, V_PAIRS)
                tl.store(lse_ptr + b.to(tl.int64) * stride_eb + q_head * stride_eh + slot, lse, mask=mask_h)


@triton.jit
def _streamk_stage2_kernel(
    logits_ptr, lse_ptr, o_ptr, kv_indptr_ptr, tile_off_ptr, meta_ptr,
    stride_lb, stride_lh, stride_ls, stride_eb, stride_eh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT_BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # `decode_merge._decode_stage2_kernel` with the segment count of the plan (PDL: the plan
    # and kv_indptr are read before the wait; stage 1 writes neither).
    b = tl.program_id(0)
    h = tl.program_id(1)
    hp = (h // GROUP) * HEAD_BLOCKS + (h % GROUP) // BLOCK_H
    n_b = tl.cdiv((tl.load(kv_indptr_ptr + b + 1) - tl.load(kv_indptr_ptr + b)).to(tl.int32), BLOCK_N)
    per = tl.load(meta_ptr + 1)
    u0 = hp * tl.load(meta_ptr) + tl.load(tile_off_ptr + b)
    n_splits = tl.where(n_b > 0, (u0 + n_b - 1) // per - u0 // per + 1, 0)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if n_splits == 1:  # stage 1 wrote this request's output
        return
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV
    offs_s = tl.arange(0, SPLIT_BLOCK)
    part_ptr = logits_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + offs_dv[None, :]
    lse_row = lse_ptr + b.to(tl.int64) * stride_eb + h * stride_eh
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, n_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        mask_s = s < n_splits
        lse_s = tl.load(lse_row + s, mask=mask_s, other=float("-inf"))
        part = tl.load(part_ptr + s[:, None] * stride_ls, mask=mask_s[:, None] & mask_dv[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse_s - m_new)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    out = tl.where(l > 0, acc / tl.maximum(l, 1e-30), 0.0)  # a request without keys: zeros
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_dv, out.to(o_ptr.dtype.element_ty), mask=mask_dv)


def streamk_selected(streamk: Optional[bool], bs: int, head_programs: int, num_sms: int) -> bool:
    """Selection rule: ``streamk`` True / False forces it on / off; None follows
    `streamk_enabled` for batches of at least one head program per SM (``bs *
    head_programs >= num_sms``)."""
    if streamk is not None:
        return bool(streamk)
    return streamk_enabled() and bs * head_programs >= num_sms


def launch_streamk(q, k_buffer, v_arg, o, kv_indptr, kv_indices, attn_logits, attn_lse, max_kv_splits: int,
                   sm_scale: float, logit_cap: float, v_scale: float, *, cfg: DecodeConfig, group: int,
                   head_blocks: int, block_h: int, block_dv: int, stride_vt: int, stride_vh: int, v_pairs: bool,
                   e5m2: bool, f16_dot: bool, compute_fp32: bool, dot_prec, use_pdl: bool, num_sms: int,
                   plan: Optional[StreamKPlan] = None, num_programs: Optional[int] = None,
                   merge_split_block: int = 32, stage2_warps: int = 2) -> torch.Tensor:
    """Both stream-K stages for `decode_attention.decode_attention_fwd`, which has checked the
    arguments and prepared the launch values (``sm_scale`` already includes K's scale,
    ``v_arg`` / strides are the V buffer, as int16 pairs when ``v_pairs``). ``plan``: this
    step's `plan_streamk_decode` for the same ``block_n``, head programs, grid and
    ``max_kv_splits`` (else one is made here, one more kernel); ``num_programs``: the grid
    (default `streamk_num_programs`). Returns ``o``.

    Raises:
        ValueError: a ``plan`` made for another launch.
    """
    bs, hq, dv = o.shape
    dk = q.shape[2]
    head_programs = (hq // group) * head_blocks
    g = num_programs or streamk_num_programs(num_sms)
    if plan is None:
        plan = plan_streamk_decode(kv_indptr, bs, streamk_tile_capacity(kv_indices, bs, cfg.block_n), cfg.block_n,
                                   head_programs, g, max_kv_splits)
    elif (plan.block_n, plan.head_programs, plan.max_kv_splits) != (cfg.block_n, head_programs, max_kv_splits) \
            or (num_programs is not None and plan.num_programs != num_programs):
        raise ValueError(f"stream-K plan made for block_n {plan.block_n}, {plan.head_programs} head programs, "
                         f"max_kv_splits {plan.max_kv_splits}, grid {plan.num_programs}; launch has {cfg.block_n}, "
                         f"{head_programs}, {max_kv_splits}, {g}")
    g = plan.num_programs
    extra = {"launch_pdl": True} if use_pdl else {}
    _streamk_stage1_kernel[(g,)](
        q, k_buffer, v_arg, kv_indices, plan.tiles, plan.tile_off, plan.meta,
        attn_logits, attn_lse, o,
        float(sm_scale), float(logit_cap), float(v_scale),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), stride_vt, stride_vh,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), o.stride(0), o.stride(1),
        plan.tiles.shape[1],
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_PROGRAMS=head_programs, DK=dk, DV=dv, BLOCK_D=dk,
        BLOCK_DV=block_dv, BLOCK_H=block_h, BLOCK_N=cfg.block_n, HAS_CAP=logit_cap > 0, V_SCALED=v_scale != 1.0,
        COMPUTE_FP32=compute_fp32, DOT_PREC=dot_prec, F16_DOT=f16_dot, V_PAIRS=v_pairs, E5M2=e5m2,
        USE_PDL=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )
    _streamk_stage2_kernel[(bs, hq)](
        attn_logits, attn_lse, o, kv_indptr, plan.tile_off, plan.meta,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), o.stride(0), o.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, BLOCK_H=block_h, BLOCK_N=cfg.block_n, DV=dv, BLOCK_DV=block_dv,
        SPLIT_BLOCK=merge_split_block, USE_PDL=use_pdl,
        num_warps=max(stage2_warps, 4) if merge_split_block * block_dv > 4096 else stage2_warps, **extra,
    )
    return o
