"""Launch tuning of the extend kernel (`extend_attention._extend_fwd_kernel`): the one place it lives.

`extend_config` picks the tiles from the head size, dtype, device and batch; every number
here was measured, and the sources are cited next to each choice.

Plain causal prefills on sm_90 (H100 / H200 / H20 / GH200; `sm90_plain_prefill_config`).
Measured on one H100 80GB HBM3 (Triton 3.6, bf16, Hq 32 / Hkv 8 / D 128;
``benchmarks/extend_long_sweep.py``, ``benchmarks/results/h100-80gb-hbm3-extend-long-sweep-2026-11-27.json``;
µs / TFLOP/s / speed-up over the old default (128, 64, 8, 3), ``=`` the old default's bits)::

    config                1x8190               4x2048              16x512
    old (128x64x8x3)      1235 / 445 / 1.000=  394 / 349 / 1.000=  189 / 182 / 1.000=
    desc-k (LONG)         1160 / 474 / 1.064=  386 / 356 / 1.020=  188 / 183 / 1.005=
    128x128x8x3+desc      1142 / 481 / 1.082   391 / 351 / 1.007   202 / 170 / 0.935
    64x64x4x3             1206 / 455 / 1.023=  371 / 371 / 1.063=  165 / 208 / 1.142=
    64x32x4x3 (SHORT)     1384 / 397 / 0.892   359 / 382 / 1.097   150 / 229 / 1.261

The three cases hold the same number of tokens (8,190-8,192) and launch the same number of
128-row programs, so the longest request, not the token count, separates them: short
requests' programs are short, and 64-row programs of one warpgroup (two or three an SM)
overlap one program's softmax with another's MMAs; long ones re-read K/V from L2 twice as
often with 64-row programs and lose (``benchmarks/NOTES.md``). Hence the rule on the host's
``max_len_extend`` (the grid size the backend already passes; no device read):

* ``max_len_extend <= SM90_SHORT_MAX_LEN`` (2,048): `SM90_SHORT` = (64, 32, 4, 3); predicted
  1.26x at 16 x 512 and 1.10x at 4 x 2,048. Other bits than the old default (keys summed
  in tiles of 32, not 64): within bf16 rounding of it.
* longer: `SM90_LONG` = (128, 64, 8, 3) with K read through a TMA descriptor (``kv_desc``
  "k"); the old default's bits; predicted 1.06x at 1 x 8,190. 128x128x8x3+desc was 1.6%
  faster there (1142 vs 1160 µs) but changes the bits and loses 6.5% at 16 x 512; the
  default's own three rounds at 1 x 8,190 spread over 1140-1268 µs, so that 1.6% is within
  the noise of one run.
* The threshold: short wins at 2,048 (359 vs 386 µs), long at 8,190 (1160 vs 1384 µs);
  between them nothing was measured (log-linear interpolation of the two margins puts the
  crossover near 3,000 tokens), so 2,048, the longest measured win, is the threshold.
* Re-timed with the rule in place (same H100 day, ``...-extend-long-sweep-new-defaults-2026-11-27.json``),
  new default over old: 16 x 512 1.27x, 4 x 2,048 1.03x, 1 x 2,560 / 3,072 / 4,096 / 8,190
  0.99 / 0.98 / 0.96 / 1.01x, prefix stage 1.015x. desc-k's 1.06x at 8,190 did not repeat:
  it is neutral, kept for the old bits.

Not on this rule (the old default stays): the prefix stage (``has_prefix``: 1 x 4,096 new
over a 4,096-token prefix measured 975 µs with the old default, every candidate 0.60-1.00x),
custom masks, non-causal batches, head sizes other than 128 / 128, fp32, other GPUs, ROCm,
the interpreter, and ``batch_invariant`` launches (``--enable-deterministic-inference``:
a request's bits must not depend on the longest request of its batch; they get `SM90_LONG`,
the old default's bits). fp16 takes the rule as bf16 (the same MMA shapes and bytes; timed
in bf16 only).

Head sizes 129-256 take `HEAD256_TILE` (measurements at its definition).

Environment: ``ATTNSERVE_EXTEND_DEFAULTS=old`` restores the old defaults, including the head-256
tile (A/B timing; read at every call); ``ATTNSERVE_EXTEND_CONFIG`` replaces whatever was picked (`_env_override`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from attnserve.attention.triton_ops.decode_tuning import WHOLE_DK_ENV, WHOLE_DK_HEAD_SIZES
from attnserve.env_options import env_flag


@dataclass(frozen=True)
class ExtendConfig:
    """Launch parameters of the extend kernel (see `extend_config`). ``block_n_prefix``: the
    key tile of the cached-prefix stage (None: ``block_n``, the new-token stage's).

    ``kv_desc`` ("", "k", "v" or "kv"): the new-token stage's unmasked run reads those
    tiles through TMA tensor descriptors (`extend_runs._attn_run_desc`; the same bits). It
    applies only to plain prefills (``has_prefix=False``) without a custom mask or logit cap,
    with ``Dk``, ``Dv`` powers of two >= 16, each head's rows packed (``k_extend.stride(1) ==
    Dk``), 16-byte aligned rows and base, on sm 90+ or the interpreter; otherwise it is
    ignored. Triton 3.6's ptxas (12.8) crashed (SIGSEGV at -O2 / -O3) compiling "kv" with 3
    stages offline and on the H100; "k", "v", and "kv" with 2 or 4 stages compiled, and
    ptxas 13.0 compiled all (scripts/extend_variants_offline.py).

    ``whole_dk``: a ``Dk`` that is not a power of two is read as one tile of the next power
    of two, its tail masked (96 -> 128), instead of a main and a remainder tile with a dot
    each (96 -> 64 + 32; `decode_attention._split_dims`), as `DecodeConfig.whole_dk`.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_n_prefix: Optional[int] = None
    kv_desc: str = ""
    whole_dk: bool = False


#: longest extend (tokens) of a plain causal prefill that takes `SM90_SHORT` on sm_90
SM90_SHORT_MAX_LEN = 2048
#: plain causal prefills on sm_90 whose longest request is at most `SM90_SHORT_MAX_LEN`
#: (offline sm_90a: 160 registers, 64 KB shared memory, three programs an SM)
SM90_SHORT = ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=3)
#: longer plain causal prefills on sm_90: the old default's tiles, K through a TMA descriptor
SM90_LONG = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, kv_desc="k")

#: head sizes 129-256 (Gemma 2 / Gemma 3: 256): 128 query rows against 32-key tiles, 8 warps, 2
#: stages. One H200 (Triton 3.6, bf16, ``benchmarks/extend_long_sweep.py --shape gemma-2-9b`` /
#: ``gemma3-270m``: the models' heads, logit cap and sliding window;
#: ``results/h200-extend-long-sweep-{gemma-2-9b,gemma3-270m}-2026-11-28.json``), µs against
#: `HEAD256_OLD`: Gemma-2-9B 1 x 8,190 2758 -> 1573 (1.75x), 4 x 2,048 1034 -> 611, 16 x 512
#: 375 -> 244, 4,096 new over 4,096 cached 2482 -> 1498; Gemma 3 270M 1.31-1.39x on the same
#: cases. Offline (sm_90a, ``scripts/family_kernels_offline.py``) the old tile spilled 72-204
#: bytes with the cap and window, this one 0-4. Other bits than the old tile (keys summed in tiles
#: of 32): relative L2 difference ~1e-3, bf16 rounding. Custom masks (not timed) keep the old
#: tile; ``ATTNSERVE_EXTEND_DEFAULTS=old`` restores it everywhere. The H100 has the same SMs and
#: shared memory; it was not timed there.
HEAD256_TILE = ExtendConfig(block_m=128, block_n=32, num_warps=8, num_stages=2)
#: the head-256 tile before 2026-11-28 (255 registers, 160 KB of shared memory)
HEAD256_OLD = ExtendConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)

EXTEND_CONFIG_ENV = "ATTNSERVE_EXTEND_CONFIG"
EXTEND_DEFAULTS_ENV = "ATTNSERVE_EXTEND_DEFAULTS"


def extend_defaults() -> str:
    """``"new"`` (unset, empty or ``new``) or ``"old"`` from ``ATTNSERVE_EXTEND_DEFAULTS``
    (any case; read at every call, so one process can time both). ``old``: no sm_90
    plain-prefill rule (the defaults before 2026-11-27). Raises ValueError on another value."""
    raw = os.environ.get(EXTEND_DEFAULTS_ENV, "").strip().lower() or "new"
    if raw not in ("new", "old"):
        raise ValueError(f"{EXTEND_DEFAULTS_ENV}={raw!r}: expected 'new' or 'old'")
    return raw


def sm90_plain_prefill_config(max_len_extend: Optional[int], batch_invariant: bool = False) -> ExtendConfig:
    """The sm_90 tiles of a plain causal prefill (no cached prefix, D 128, 16-bit) whose
    longest request has ``max_len_extend`` new tokens (host int; None: unknown): `SM90_SHORT`
    up to `SM90_SHORT_MAX_LEN` tokens, else `SM90_LONG`; always `SM90_LONG` (the old
    default's bits at any length) when ``batch_invariant``. Measurements: module docstring."""
    if batch_invariant or max_len_extend is None or max_len_extend > SM90_SHORT_MAX_LEN:
        return SM90_LONG
    return SM90_SHORT


def extend_config(
    head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
    is_hip: bool = False,
    interpret: bool = False,
    has_custom_mask: bool = False,
    has_prefix: bool = True,
    *,
    is_causal: bool = True,
    max_len_extend: Optional[int] = None,
    capability: Optional[Tuple[int, int]] = None,
    batch_invariant: bool = False,
) -> ExtendConfig:
    """The extend kernel's tiles for one launch (a pure function of its arguments and of the
    two environment variables below).

    Register/shared-memory figures below are from an offline sm90 compile (ptxas -v).

    Args:
        head_dim / v_head_dim: ``Dk`` / ``Dv``.
        dtype: q/K/V dtype (fp32 uses non-tensor-core IEEE dots: small tiles).
        is_hip: AMD GPUs.
        interpret: the CPU interpreter (small tiles keep tests fast and multi-tile).
        has_custom_mask: tree-verification batches (few queries per request; the mask
            tile costs registers).
        has_prefix: False when no request has a cached prefix: no separate prefix tile.
        is_causal: causal masking over the new tokens.
        max_len_extend: the launch's longest new-token run (host int; None: unknown).
        capability: the CUDA device's compute capability (``torch.cuda.get_device_capability``;
            None: unknown). ``(9, 0)`` with a plain causal 16-bit prefill of D 128 takes
            `sm90_plain_prefill_config` unless ``ATTNSERVE_EXTEND_DEFAULTS=old``.
        batch_invariant: the tiles must not depend on the rest of the batch (deterministic
            inference).

    On a GPU, D <= 128 without a custom mask: ``ATTNSERVE_EXTEND_CONFIG`` overrides the
    choice (`_env_override`; for trying ``benchmarks/extend_long_sweep.py``'s candidates in
    an engine). Raises ValueError on a malformed value of either variable.
    """
    if interpret:  # prefix tiles of another size than the new tokens' (as on a GPU)
        return ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, block_n_prefix=32)
    d = max(head_dim, v_head_dim)
    if is_hip:
        return ExtendConfig(64, 64, 4, 1) if d <= 128 else ExtendConfig(64, 32, 4, 1)
    if dtype == torch.float32:
        return ExtendConfig(32, 32, 4, 1)
    if d <= 128:
        if has_custom_mask:
            return ExtendConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)  # 242 regs, 96 KB
        # wgmma; one tile 239 regs / 128 KB, two tiles 255 regs / 161 KB, no spills (triton
        # 3.6 JIT, scripts/extend_regs.py). Prefix tiles of 128 keys: extends over a cached prefix
        # 1.08-1.30x faster in bf16, 1.19-1.31x over fp8 prefixes, while 64-key tiles stay
        # best for the causal new tokens; the kernel with both tiles runs a plain prefill
        # 3-7% slower, hence ``has_prefix`` (H100, session 14, benchmarks/fp8_extend_sweep.py)
        cfg = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3,
                           block_n_prefix=128 if has_prefix else None)
        plain_sm90 = (tuple(capability or ()) == (9, 0) and not has_prefix and is_causal
                      and head_dim == v_head_dim == 128 and dtype in (torch.bfloat16, torch.float16))
        if plain_sm90 and extend_defaults() == "new":
            cfg = sm90_plain_prefill_config(max_len_extend, batch_invariant)
        if has_prefix and _whole_dk(head_dim, v_head_dim):
            cfg = dataclasses.replace(cfg, whole_dk=True)
        return _env_override(cfg)
    if d <= 256:
        if has_custom_mask or extend_defaults() == "old":
            return HEAD256_OLD
        return HEAD256_TILE
    return ExtendConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)  # MLA 576/512


def _whole_dk(head_dim: int, v_head_dim: int) -> bool:
    """Whether a launch with a cached-prefix stage reads K's head whole (`ExtendConfig.whole_dk`):
    a head size of `decode_tuning.WHOLE_DK_HEAD_SIZES` for K and V, unless ``ATTNSERVE_WHOLE_DK=0``.

    Why: with K as 64 + 32, Triton 3.6's ptxas (12.8) crashes (SIGSEGV) compiling the kernel
    with the cached-prefix stage for head size 96 without a sliding window (offline sm_90a,
    ``scripts/family_kernels_offline.py``, and on an H200: the engine test of
    ``tests/gpu/test_decode_head_sizes_gpu.py`` with ``ATTNSERVE_WHOLE_DK=0``), so such a model
    failed its first prefill over a cached prefix; the whole tile compiles. Phi-3-mini's and
    Phi-3.5-mini's HF configs set ``sliding_window`` (2047 / 262144), and their windowed launch
    compiled with the split too (offline); they now read K whole as well (255 registers, 56 bytes
    of spills offline, against none split; not timed on a GPU). Plain prefills keep the split,
    which was faster there (H200, Phi-3-mini heads without a window, ``extend_long_sweep.py
    --shape phi-3-mini``, ``results/h200-extend-long-sweep-phi-3-mini-2026-11-28.json``, µs split
    / whole: 16 x 512 190 / 201, 4 x 2048 365 / 391, 1 x 8190 1091 / 1203; 4,096 new tokens over
    4,096 cached, whole: 1039).
    """
    return head_dim == v_head_dim and head_dim in WHOLE_DK_HEAD_SIZES and env_flag(WHOLE_DK_ENV)


def _env_override(cfg: ExtendConfig) -> ExtendConfig:
    """``ATTNSERVE_EXTEND_CONFIG="BM,BN,WARPS,STAGES[,desc|desck|descv]"`` replaces the GPU
    default for D <= 128 without a custom mask (the prefix tile stays), so an engine run can
    try a candidate of ``benchmarks/extend_long_sweep.py`` unchanged. Raises ValueError on a
    malformed value."""
    raw = os.environ.get(EXTEND_CONFIG_ENV, "").strip()
    if not raw:
        return cfg
    parts = [x.strip().lower() for x in raw.split(",")]
    desc = {"desc": "kv", "desck": "k", "descv": "v"}
    flags = set(parts[4:])
    try:
        bm, bn, w, st = map(int, parts[:4])
    except ValueError:
        bm = 0
    if bm <= 0 or len(parts) < 4 or not flags <= set(desc) or len(flags) > 1:
        raise ValueError(f"{EXTEND_CONFIG_ENV}={raw!r}: expected BM,BN,WARPS,STAGES[,desc|desck|descv]")
    return dataclasses.replace(cfg, block_m=bm, block_n=bn, num_warps=w, num_stages=st,
                               kv_desc="".join(desc[f] for f in flags))
