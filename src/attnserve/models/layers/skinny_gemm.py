"""Skinny GEMM: ``y = x @ W^T (+ b)`` for a few rows of ``x`` (decode), in one Triton launch.

At decode time a projection multiplies ``M`` = batch (1..16) activation rows by a weight
``W [N, K]`` that is far larger than the activations, so the work is a stream over the
weight. cuBLAS handles ``M = 1`` poorly on an H100: ~3.8 µs for SmolLM2's 0.7-3.5 MB
matrices (bandwidth alone needs < 1 µs), 1.6 TB/s of 3.0 TB/s copy bandwidth on Llama-3-8B's
``o_proj``, and split-K plus a separate ``splitKreduce`` kernel on ``qkv`` / ``down``. Here:

* `skinny_linear` -- ``F.linear`` for ``1 <= M <= MAX_SKINNY_M``: one program per
  ``block_n`` weight rows walks all of ``K`` (no split-K, no second kernel), float32
  accumulation, output in ``x``'s dtype;
* `skinny_linear_gated` -- the fused ``gate_up`` projection with its SwiGLU / GeGLU gate
  (Shazeer, arXiv:2002.05202): ``act(x W_g^T) * (x W_u^T)`` for ``W = [W_g | W_u]``
  ``[2I, K]``, replacing ``F.linear`` + the act-and-mul kernel; gate and up are not rounded
  to the storage dtype before the activation (one rounding, of the product);
* `skinny_gemm_config` -- the launch parameters (`SkinnyGemmConfig`); the one place the
  tuning lives.

Both launchers allocate only their output, never read device values on the host and are
CUDA-graph capturable. On Hopper they launch with programmatic dependent launch
(`attnserve.pdl`; ``ATTNSERVE_PDL=0`` turns it off): the weight stream of
one projection starts while the kernel before it finishes. `Linear` (``attnserve.models.layers.linear``) calls them for CUDA
tensors with ``M <= MAX_SKINNY_M`` while its ``use_fused`` is on (``--disable-fused-kernels`` turns it
off).

Triton is imported lazily (the kernels live in `skinny_gemm_triton`), so this module
imports on CPU-only installs without Triton. On CPU the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1``; the tests use it).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch

from attnserve.pdl import pdl_enabled, pdl_supported
from attnserve.triton_env import triton_interpreting

__all__ = [
    "MAX_SKINNY_M",
    "SKINNY_ACTIVATIONS",
    "SkinnyGemmConfig",
    "skinny_gemm_config",
    "skinny_gemm_supported",
    "skinny_linear",
    "skinny_linear_gated",
    "skinny_linear_fp8",
    "skinny_fp8_supported",
    "skinny_rule",
    "MAX_SKINNY_FP8_M",
    "fp8_skinny_config",
]

#: largest number of activation rows the skinny kernels take (the ``tl.dot`` tile height)
MAX_SKINNY_M = 16
#: largest number of rows `skinny_linear_fp8` takes (W8A16 with a ``next_pow2(M)``-row ``tl.dot`` tile)
MAX_SKINNY_FP8_M = 128

#: activation name -> the kernels' ``ACT`` code
SKINNY_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRETER_SMS = 4  # a pretend small GPU under the interpreter: few, large programs run fastest there


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """Launch parameters of the skinny GEMM kernels.

    Attributes:
        block_n: output columns (weight rows; for the gated kernel: gate rows, plus as many
            up rows) per program; power of two, ``>= 16`` with ``use_dot``.
        block_k: ``K`` elements per loop step; power of two, ``>= 16`` with ``use_dot``.
        num_warps: warps per program (power of two, 1..16).
        num_stages: software-pipelining depth of the ``K`` loop (``>= 1``).
        use_dot: inner product on ``tl.dot`` (activation tile padded to 16 rows) instead of
            a float32 broadcast-multiply + ``tl.sum`` (activation tile padded to
            ``next_pow2(M)`` rows).
        carry: load each weight tile one ``K`` step ahead, into registers, so a tile is in
            flight while the previous one is multiplied (see `skinny_gemm_triton`); the
            register budget then holds two weight tiles.
        defer: (broadcast form, one activation row only) accumulate the float32 products
            in a ``[block_n, block_k]`` tile and reduce over ``K`` once after the loop,
            instead of a cross-warp ``tl.sum`` at every step.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    use_dot: bool = False
    carry: bool = False
    defer: bool = False

    def block_m(self, m: int) -> int:
        """Rows of the activation tile for ``m`` rows (``tl.dot``: at least 16)."""
        return max(MAX_SKINNY_M, _next_pow2(m)) if self.use_dot else _next_pow2(m)

    def validate(self) -> None:
        """Raise ValueError when the kernels cannot be compiled with these parameters."""
        problems = []
        if not _is_pow2(self.block_n) or not _is_pow2(self.block_k):
            problems.append("block_n and block_k must be powers of two")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            problems.append("use_dot needs block_n >= 16 and block_k >= 16")
        if not _is_pow2(self.num_warps) or self.num_warps > 16:
            problems.append("num_warps must be a power of two in 1..16")
        if self.num_stages < 1:
            problems.append("num_stages must be >= 1")
        if self.defer and self.use_dot:
            problems.append("defer needs the broadcast form (use_dot=False)")
        if problems:
            raise ValueError(f"invalid {self}: " + "; ".join(problems))


def skinny_gemm_config(
    M: int, N: int, K: int, dtype: torch.dtype, num_sms: int, *, gated: bool = False, weight_itemsize: int = 0
) -> SkinnyGemmConfig:
    """Default launch parameters for ``x [M, K] @ W[N, K]^T`` (the one place tuning lives).

    Args:
        M: activation rows (1..MAX_SKINNY_M).
        N: weight rows (for ``gated``: ``2I``, gate and up rows together).
        K: reduction length.
        dtype: storage dtype of ``x`` / ``W``.
        num_sms: streaming multiprocessors of the device (132 on an H100 SXM).
        gated: parameters for `skinny_linear_gated` (a program reads ``2 * block_n`` rows).
        weight_itemsize: bytes per weight element when it differs from ``dtype``'s (1: an
            FP8 weight of `skinny_linear_fp8`, whose tiles come from `fp8_skinny_config`
            unless `fp8_skinny_table_on` is False; ``M > 16`` always does).

    Rule v1, tuned on an H100 (``benchmarks/gemv.py``, 2026-11-21: 40-config sweep
    of every projection of SmolLM2-135M, Gemma-3-270M and Llama-3-8B at M = 1, 4, 16):

    * ``M == 1``: the broadcast form (``use_dot=False``; a ``tl.dot`` would compute 15 zero
      rows). ``block_k`` covers all of ``K`` up to 1024 (one step per program; masked lanes
      cost no bandwidth) with 8 warps -- the best for the 0.7-4 MB matrices of small models,
      e.g. SmolLM2 qkv 2.5 µs vs cuBLAS 3.7 µs -- else 512 with 4 warps; ``block_n`` 4 (8
      for the gated form with ``K > 1024``); 3 stages. Llama-3-8B shapes then stream at
      2.6-3.1 TB/s (cuBLAS: 2.0-2.8).
    * ``M >= 2``: ``tl.dot`` on a 16-row tile (the broadcast form was 2x slower than cuBLAS
      at M = 4 on the 8B shapes), ``block_k`` 128 (``K <= 1024``) or 256, ``block_n`` 16 for
      matrices with few rows and 32 (64 for gated Llama-size MLPs) otherwise, 4 stages.
    * float32 always uses the broadcast form (no tensor-core rate for exact float32), with
      ``block_m * block_n * block_k`` (x2 when gated) kept within 64 float32 values per
      thread: ``block_n`` shrinks first, then ``block_k``.

    Rule v2 (the default; ``ATTNSERVE_SKINNY_RULE=v1`` selects v1) differs only for one
    16-bit row with ``K > 1024`` (the Llama-3-8B decode GEMVs at batch 1): the deferred
    reduction (``defer``; no cross-warp ``tl.sum`` inside the ``K`` loop), 16 weight values
    per thread per tile, and per class the fastest of the 2026-11-26 H100 candidates
    (``benchmarks/gemv.py --candidates``, with PDL; v1 in brackets, µs):

    * gated: ``block_n`` 2, ``block_k`` 512, 4 warps (gate_up 28672 x 4096: 77.6 [82.8]);
    * ``K >= 8192``: 2 x 2048, 8 warps (down 4096 x 14336: 41.7 [43.2]);
    * ``N <= 4096``: 4 x 512, 4 warps, carried tiles (o 4096 x 4096: 12.9 [14.1]);
    * ``N <= 16384``: 2 x 1024, 4 warps (qkv 6144 x 4096: 19.1 [22.1]);
    * larger ``N`` (vocabulary projections): 4 x 1024, 8 warps, carried (lm_head
      128256 x 4096: 331.5 [338.1]).

    Together -270 µs of the Llama-3-8B batch-1 decode step (6.19 -> 5.93 ms with PDL,
    benchmarks/NOTES.md, "Issue 33: the batch-1 decode step").

    One rank's shards under tensor parallelism (``benchmarks/gemv.py --candidates --models
    llama-3-8b-tp4 llama-3-70b-tp4 llama-3-8b-tp2``, H100, 2026-11-27, µs, before -> after)
    moved two shapes: few rows with ``K >= 4096`` (``N <= 2048``: Llama-3-8B qkv at tp 4,
    1536 x 4096) take the ``K >= 8192`` tile, 7.26 -> 5.98; ``K == 1024`` with ``2048 < N <=
    4096`` (its o_proj at tp 4, 4096 x 1024, before on rule v1) the ``N <= 4096`` tile,
    4.51 -> 4.09. The other shards were within 5% of the best candidate.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    _ = num_sms  # neither rule needed it on the H100; kept for other GPUs' tuning
    if weight_itemsize == 1 and itemsize == 2 and skinny_rule() == "v2" and fp8_skinny_table_on():
        return fp8_skinny_config(M, N, K, gated=gated)
    if weight_itemsize == 1 and M > MAX_SKINNY_M:
        return fp8_skinny_config(M, N, K, gated=gated)
    if skinny_rule() == "v1":
        return _rule_v1(M, N, K, itemsize, gated)
    square_k1024 = K == 1024 and not gated and 2048 < N <= 4096  # e.g. Llama-3-8B o_proj at tp 4
    if M == 1 and itemsize <= 2 and (K > 1024 or square_k1024):
        if gated:
            bn, bk, warps, carry = 2, 512, 4, False
        elif K >= 8192 or (N <= 2048 and K >= 4096):
            bn, bk, warps, carry = 2, 2048, 8, False
        elif N <= 4096:
            bn, bk, warps, carry = 4, 512, 4, True
        elif N <= 16384:
            bn, bk, warps, carry = 2, 1024, 4, False
        else:
            bn, bk, warps, carry = 4, 1024, 8, True
        return SkinnyGemmConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=1, use_dot=False,
                                carry=carry, defer=True)
    return _rule_v1(M, N, K, itemsize, gated)


def _shape_class(n: int, k: int, gated: bool) -> str:
    """The rule-v2 class of a weight ``[N, K]`` (see `skinny_gemm_config`)."""
    if gated:
        return "gated"
    if k >= 8192:
        return "k>=8192"
    if n <= 4096:
        return "n<=4096"
    return "n<=16384" if n <= 16384 else "wide"


#: FP8 (1-byte) weights, one activation row (``defer`` form, ``K > 1024``): class ->
#: (block_n, block_k, num_warps, carry). Started as rule v2's 16-bit tiles with ``block_k``
#: doubled (the same bytes per step); ``benchmarks/fp8_bench.py --sweep`` on an H100
#: (2026-11-27, CUDA-graph timing over rotating weights, Llama-3-8B shapes, µs) halved two
#: of them: ``n<=4096`` (o_proj 4096 x 4096) 4 x 1024 10.23 -> 4 x 512 9.15, ``k>=8192``
#: (down_proj 4096 x 14336) 2 x 4096 29.13 -> 2 x 2048 26.13; gated (2 x 1024 45.16 vs
#: 2 x 512 45.05) and qkv (2 x 2048 12.58, the best of three) kept.
FP8_SKINNY_M1 = {
    "gated": (2, 1024, 4, False),
    "k>=8192": (2, 2048, 8, False),
    "n<=4096": (4, 512, 4, True),
    "n<=16384": (2, 2048, 4, False),
    "wide": (4, 2048, 8, True),
}
#: FP8 weights, more than 16 rows (``tl.dot`` on ``next_pow2(M)`` rows; W8A16 past the
#: decode batch sizes of the 16-bit kernel): tile rows -> (block_n, block_k, num_warps,
#: num_stages); gated: ``block_n`` halved (a program reads gate and up rows). Unmeasured
#: starting points, as `FP8_SKINNY_M1`.
FP8_SKINNY_WIDE = {
    32: (64, 256, 4, 4),
    64: (64, 256, 8, 3),
    128: (64, 128, 8, 3),
}


def fp8_skinny_config(M: int, N: int, K: int, *, gated: bool = False) -> SkinnyGemmConfig:
    """Launch parameters of `skinny_linear_fp8` for ``x [M, K]`` (16-bit) and an FP8
    ``W [N, K]`` (``gated``: ``N = 2I``; 1 <= M <= MAX_SKINNY_FP8_M):

    * ``M == 1``, ``K > 1024``: `FP8_SKINNY_M1` by shape class;
    * ``2 <= M <= 16``: the 16-bit rule v1 with ``block_k`` doubled when ``K > 1024``
      (same bytes per tile);
    * ``M > 16``: `FP8_SKINNY_WIDE` by ``next_pow2(M)``;
    * otherwise (``K <= 1024``, one step covers ``K``) the 16-bit rule.
    """
    if M <= MAX_SKINNY_M:
        cfg = _rule_v1(M, N, K, 2, gated)
        if K <= 1024:
            return cfg
        if M == 1:
            bn, bk, warps, carry = FP8_SKINNY_M1[_shape_class(N // 2 if gated else N, K, gated)]
            return SkinnyGemmConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=1, use_dot=False,
                                    carry=carry, defer=True)
        if not cfg.use_dot:
            return cfg
        # twice the K per stage doubles the x tile too: one buffer fewer keeps the gated
        # 16-row tile (3 x 80 KB at 4 stages) inside an H100/H200's 227 KB of shared memory
        return dataclasses.replace(cfg, block_k=cfg.block_k * 2, num_stages=min(cfg.num_stages, 3))
    bn, bk, warps, stages = FP8_SKINNY_WIDE[min(_next_pow2(M), max(FP8_SKINNY_WIDE))]
    if gated:
        bn = max(16, bn // 2)
    bk = max(16, min(bk, _next_pow2(K)))
    return SkinnyGemmConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, use_dot=True)


def fp8_skinny_table_on() -> bool:
    """False when ``ATTNSERVE_FP8_SKINNY_TABLE=0``: FP8 weights at ``M <= 16`` then take the
    16-bit tiles (the choice before the tables; kept for A/B). Read at every call."""
    return os.environ.get("ATTNSERVE_FP8_SKINNY_TABLE", "1").strip() != "0"


def skinny_rule() -> str:
    """``"v2"`` (default) or ``"v1"`` (``ATTNSERVE_SKINNY_RULE=v1``): the 2026-11-21 decode
    GEMM choices, i.e. rule v1 in `skinny_gemm_config` and the LM head on cuBLAS
    (`CausalLM.compute_logits`, models/base.py); kept for A/B measurements. Read at every call."""
    return "v1" if os.environ.get("ATTNSERVE_SKINNY_RULE", "v2").strip().lower() == "v1" else "v2"


def _rule_v1(m: int, n: int, k: int, itemsize: int, gated: bool) -> SkinnyGemmConfig:
    """The 2026-11-21 rule (``ATTNSERVE_SKINNY_RULE=v1``; see `skinny_gemm_config`)."""
    cols = max(1, n // 2 if gated else n)
    tiles = 2 if gated else 1
    use_dot = m >= 2 and itemsize <= 2
    if use_dot:
        block_k = max(16, min(_next_pow2(k), 128 if k <= 1024 else 256))
        if gated:
            block_n = 32 if cols <= 4096 else 64
        else:
            block_n = 16 if (cols <= 1024 or (k > 1024 and cols <= 4096)) else 32
        return SkinnyGemmConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=4, use_dot=True)
    small_k = k <= 1024
    block_k = _next_pow2(k) if small_k else 512
    block_n = 8 if (gated and not small_k) else 4
    num_warps = 8 if (small_k and not gated and m == 1) else 4
    block_m = _next_pow2(m)
    budget = 64 * 32 * num_warps  # float32 product values in registers, per program
    while tiles * block_m * block_n * block_k > budget and block_n > 1:
        block_n //= 2
    while tiles * block_m * block_n * block_k > budget and block_k > 16:
        block_k //= 2
    return SkinnyGemmConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=3, use_dot=False)


def _device_ok(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and triton_interpreting())


def gemm_operands_supported(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], max_m: int,
                            dtypes: tuple) -> bool:
    """The operand rules the Triton linears share (`skinny_gemm_supported`,
    `mid_gemm.mid_gemm_supported`): ``x`` on CUDA (or on CPU under the Triton interpreter),
    2-D with ``1 <= M <= max_m`` rows and a contiguous last dim; ``weight`` a contiguous
    ``[N, K]`` on the same device with ``N, K >= 1`` and ``K`` = ``x``'s columns; ``x`` and
    ``weight`` of one dtype among ``dtypes``; ``bias`` (if any) a unit-stride ``[N]`` of that
    dtype on that device."""
    if x.dim() != 2 or weight.dim() != 2 or not _device_ok(x) or weight.device != x.device:
        return False
    m, k = x.shape
    n = weight.shape[0]
    if not (1 <= m <= max_m) or k < 1 or n < 1 or weight.shape[1] != k:
        return False
    if x.dtype not in dtypes or weight.dtype != x.dtype or not weight.is_contiguous():
        return False
    if x.stride(1) != 1 and k > 1:
        return False
    if bias is not None and (
        bias.dim() != 1 or bias.shape[0] != n or bias.dtype != x.dtype or bias.device != x.device
        or (bias.stride(0) != 1 and n > 1)
    ):
        return False
    return True


def skinny_gemm_supported(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether `skinny_linear` accepts ``(x, weight, bias)`` (and, for an even number of
    weight rows, `skinny_linear_gated` too): `gemm_operands_supported` with
    ``1 <= M <= MAX_SKINNY_M`` rows of float16 / bfloat16 / float32.
    """
    return gemm_operands_supported(x, weight, bias, MAX_SKINNY_M, _DTYPES)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """Raise a ValueError naming the first reason `skinny_gemm_supported` says no."""
    if skinny_gemm_supported(x, weight, bias):
        return
    if not _device_ok(x):
        why = f"x is on {x.device}; needs CUDA (or CPU under TRITON_INTERPRET=1)"
    elif x.dim() != 2 or weight.dim() != 2:
        why = f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must both be 2-D"
    elif weight.device != x.device:
        why = f"weight is on {weight.device}, x on {x.device}"
    elif not 1 <= x.shape[0] <= MAX_SKINNY_M:
        why = f"x has {x.shape[0]} rows; needs 1..{MAX_SKINNY_M}"
    elif x.shape[1] < 1 or weight.shape[0] < 1 or weight.shape[1] != x.shape[1]:
        why = f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: need weight [N, K] with K = x.shape[1] >= 1, N >= 1"
    elif x.dtype not in _DTYPES or weight.dtype != x.dtype:
        why = f"dtypes x {x.dtype}, weight {weight.dtype}: need one of float16/bfloat16/float32 for both"
    elif not weight.is_contiguous():
        why = f"weight must be contiguous (strides {weight.stride()})"
    elif x.stride(1) != 1:
        why = f"x must have a contiguous last dim (strides {x.stride()})"
    else:
        why = (
            f"bias {tuple(bias.shape)} {bias.dtype} on {bias.device} strides {bias.stride()}: "
            f"need a unit-stride [{weight.shape[0]}] tensor of {x.dtype} on {x.device}"
        )
    raise ValueError(f"{name}: {why}")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    act: Optional[int],
    config: Optional[SkinnyGemmConfig],
    pdl: Optional[bool],
    scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    gated = act is not None
    cols = n // 2 if gated else n
    if config is None:
        config = skinny_gemm_config(m, n, k, x.dtype, _num_sms(x.device), gated=gated,
                                    weight_itemsize=weight.element_size())
    else:
        config.validate()
    if config.defer and m != 1:
        raise ValueError(f"skinny GEMM: config.defer needs one activation row, x has {m}")
    # not the tl.dot form (M >= 2): with PDL, back-to-back launches of it ran slower on the
    # H100 (M = 4, o_proj 14.6 -> 19.6 µs, down 43.4 -> 60.6; benchmarks/NOTES.md, issue 33)
    use_pdl = not config.use_dot and (pdl_enabled(x.device) if pdl is None else bool(pdl) and pdl_supported(x.device))
    out = torch.empty((m, cols), dtype=x.dtype, device=x.device)
    from attnserve.models.layers import skinny_gemm_triton as kt

    interpret = x.device.type == "cpu"
    common = dict(
        BLOCK_M=config.block_m(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        USE_DOT=bool(config.use_dot),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpret and x.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None,
        CARRY=bool(config.carry),
        DEFER=bool(config.defer),
        USE_PDL=use_pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if use_pdl:
        common["launch_pdl"] = True
        from attnserve.models.layers.l2_prefetch import L2_LINE_BYTES, l2_prefetch_lines

        itemsize = weight.element_size()
        common["PREFETCH_LINES"] = l2_prefetch_lines(n, k, itemsize, config.block_k)
        common["LINE_ELEMS"] = L2_LINE_BYTES // itemsize
    b = bias if bias is not None else weight  # never read when HAS_BIAS is False
    grid = (_cdiv(cols, config.block_n),)
    s = scale if scale is not None else weight  # never read when HAS_SCALE is False
    kt._skinny_gemm_kernel[grid](x, weight, b, s, out, m, cols, k, x.stride(0), out.stride(0), GATED=gated,
                                 ACT=act if gated else 0, HAS_SCALE=scale is not None, **common)
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    config: Optional[SkinnyGemmConfig] = None,
    pdl: Optional[bool] = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows, in one launch.

    Args:
        x: ``[M, K]``, ``1 <= M <= MAX_SKINNY_M``, float16/bfloat16/float32, contiguous last
            dim (any row stride, e.g. a slice of a larger buffer).
        weight: contiguous ``[N, K]`` (``nn.Linear`` layout) of ``x``'s dtype and device.
        bias: optional unit-stride ``[N]`` of ``x``'s dtype.
        config: launch parameters; default `skinny_gemm_config` for this shape and device.
        pdl: launch with programmatic dependent launch (`attnserve.pdl`);
            None: `pdl_enabled` decides (on for Hopper unless ``ATTNSERVE_PDL=0``). Ignored
            (plain launch) for the ``tl.dot`` form and where `pdl_supported` is False (CPU,
            interpreter, pre-Hopper).

    Returns:
        new contiguous ``[M, N]`` tensor in ``x``'s dtype: ``sum_k x[m, k] w[n, k] (+ b[n])``
        accumulated in float32, rounded once.

    Raises:
        ValueError: anything `skinny_gemm_supported` rejects (the message names it), or an
            invalid ``config`` (or ``config.defer`` with more than one row).
    """
    _check("skinny_linear", x, weight, bias)
    return _launch(x, weight, bias, None, config, pdl)


def skinny_linear_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str,
    *,
    bias: Optional[torch.Tensor] = None,
    config: Optional[SkinnyGemmConfig] = None,
    pdl: Optional[bool] = None,
) -> torch.Tensor:
    """Fused gate-up projection with its gate: ``act(x W_g^T + b_g) * (x W_u^T + b_u)``.

    Args:
        x: ``[M, K]`` as in `skinny_linear`.
        weight: contiguous ``[2I, K]`` = ``[gate rows | up rows]`` (a fused ``gate_up_proj``).
        activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU with GELU's tanh
            approximation ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``).
        bias: optional unit-stride ``[2I]`` = ``[b_g | b_u]`` of ``x``'s dtype.
        config: launch parameters (``block_n`` counts gate columns); default
            ``skinny_gemm_config(..., gated=True)``.
        pdl: as in `skinny_linear`.

    Returns:
        new contiguous ``[M, I]`` tensor in ``x``'s dtype. Gate and up are kept in float32
        through the activation and rounded once (the un-fused path rounds them to the
        storage dtype first, so results differ from it by about one storage ulp).

    Raises:
        ValueError: unknown ``activation``, an odd number of weight rows, anything
            `skinny_gemm_supported` rejects, or an invalid ``config``.
    """
    if activation not in SKINNY_ACTIVATIONS:
        raise ValueError(
            f"skinny_linear_gated: activation must be one of {', '.join(map(repr, SKINNY_ACTIVATIONS))}, "
            f"got {activation!r}"
        )
    _check("skinny_linear_gated", x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(
            f"skinny_linear_gated: weight {tuple(weight.shape)} must have an even number of rows ([gate | up])"
        )
    return _launch(x, weight, bias, SKINNY_ACTIVATIONS[activation], config, pdl)


def skinny_fp8_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> bool:
    """Whether `skinny_linear_fp8` accepts its arguments: as `skinny_gemm_supported` for
    ``x`` (float16/bfloat16) and a contiguous ``float8_e4m3fn`` ``weight [N, K]``, plus a
    contiguous float32 ``scale [N]`` on the same device, and ``1 <= M <= MAX_SKINNY_FP8_M``."""
    if weight.dtype != torch.float8_e4m3fn or x.dtype not in (torch.float16, torch.bfloat16):
        return False
    if scale.dtype != torch.float32 or scale.dim() != 1 or scale.shape[0] != weight.shape[0]:
        return False
    if not scale.is_contiguous() or scale.device != weight.device or bias is not None and bias.dtype != x.dtype:
        return False
    if x.dim() != 2 or weight.dim() != 2 or not _device_ok(x) or weight.device != x.device:
        return False
    m, k = x.shape
    if not (1 <= m <= MAX_SKINNY_FP8_M) or k < 1 or weight.shape[1] != k or not weight.is_contiguous():
        return False
    if (x.stride(1) != 1 and k > 1) or (bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1)):
        return False
    return True


def skinny_linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    *,
    config: Optional[SkinnyGemmConfig] = None,
    pdl: Optional[bool] = None,
) -> torch.Tensor:
    """``x @ (W_q * s)^T (+ b)`` for a few rows and an FP8 weight with one scale per row
    (W8A16: the weight is widened in the kernel, the activations stay 16-bit).

    Args:
        x: ``[M, K]``, ``1 <= M <= MAX_SKINNY_FP8_M``, float16/bfloat16 (as `skinny_linear`;
            ``M > 16`` runs the ``tl.dot`` form on ``next_pow2(M)`` rows).
        weight: contiguous ``float8_e4m3fn`` ``[N, K]``.
        scale: contiguous float32 ``[N]`` (per output row; a per-tensor scale repeated).
        bias: optional unit-stride ``[N]`` of ``x``'s dtype.
        activation: None, or ``"silu"`` / ``"gelu_tanh"`` for a fused ``[gate | up]``
            weight (as `skinny_linear_gated`; the output then has ``N / 2`` columns).
        config, pdl: as `skinny_linear` (default: `fp8_skinny_config`; rule v1 selected by
            ``ATTNSERVE_SKINNY_RULE=v1``: the 16-bit tiles; one row without ``config``
            takes the `fp8_gemv` variant ``ATTNSERVE_FP8_GEMV`` names, when set).

    Returns:
        new ``[M, N]`` (``[M, N / 2]`` gated) tensor in ``x``'s dtype.

    Raises:
        ValueError: arguments `skinny_fp8_supported` rejects, an unknown activation, or an
            odd number of rows for a gated call.
    """
    if not skinny_fp8_supported(x, weight, scale, bias):
        raise ValueError(
            f"skinny_linear_fp8: unsupported x {tuple(x.shape)} {x.dtype} {x.device}, weight {tuple(weight.shape)} "
            f"{weight.dtype}, scale {tuple(scale.shape)} {scale.dtype}: need M <= {MAX_SKINNY_FP8_M}, 16-bit x, "
            "contiguous float8_e4m3fn weight and float32 [N] scale on x's device")
    act = None
    if activation is not None:
        if activation not in SKINNY_ACTIVATIONS:
            raise ValueError(f"skinny_linear_fp8: activation must be one of {', '.join(map(repr, SKINNY_ACTIVATIONS))}"
                             f", got {activation!r}")
        if weight.shape[0] % 2:
            raise ValueError(f"skinny_linear_fp8: weight {tuple(weight.shape)} must have an even number of rows")
        act = SKINNY_ACTIVATIONS[activation]
    if config is None and x.shape[0] == 1:  # W8A16 one-row variants (ATTNSERVE_FP8_GEMV, `fp8_gemv`)
        from attnserve.models.layers import fp8_gemv as fg

        variant = fg.fp8_gemv_variant()
        if variant is not None and fg.fp8_gemv_supported(x, weight, scale, bias, variant):
            return fg.fp8_gemv(x, weight, scale, bias, activation, variant=variant, pdl=pdl)
    return _launch(x, weight, bias, act, config, pdl, scale=scale)
