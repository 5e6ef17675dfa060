"""W8A16 GEMV variants for one activation row and an FP8 weight (issue 37, decode at batch 1).

`skinny_linear_fp8` used to run one row through the 16-bit skinny kernel's ``defer`` form
with the weight widened to float32 (the "skinny" kernel). The variants here
(`FP8_GEMV_VARIANTS`, kernels in `fp8_gemv_triton`, whose module doc gives the arithmetic
and the error bound) are selected by ``ATTNSERVE_FP8_GEMV`` (read at every call). Unset or
``default``: ``f16x2``, the fastest on an H100 (Llama-3-8B FP8 decode step at batch 1
3.77 -> 3.40 ms; qkv / o / gate_up / down 12.6 -> 10.7, 9.1 -> 7.5, 44.8 -> 40.6,
26.3 -> 21.2 µs, ``benchmarks/results/h100-80gb-hbm3-fp8-bench-*-gemv-*-2026-11-27.json``);
``skinny`` or ``0``: the skinny kernel:

* ``f32`` -- the default kernel's arithmetic (exact fp8 -> float32, float32 FMA) with the
  weight and x tiles in one register layout (the default moves its x tile through shared
  memory at every ``K`` step) and x converted once per step, not once per weight element;
* ``f16x2`` -- packed half-precision products (``cvt.rn.f16x2.e4m3x2`` + ``fma.rn.f16x2``,
  4-term f16 lane sums, float32 accumulation); bfloat16 ``x`` only;
* ``dot16`` -- ``tl.dot`` on a 16-row f16 tile (row 0 = x) with float32 accumulation,
  weight tiles pipelined through shared memory.

A call the chosen variant cannot take (more than one row, ``f16x2`` with float16 ``x``,
``K % 4 != 0`` or an unaligned operand) runs the skinny kernel. `fp8_gemv` is
CUDA-graph capturable (allocates only its output, reads nothing back) and runs on the CPU
under the Triton interpreter (each variant's plain-``tl`` form).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from attnserve.pdl import pdl_enabled, pdl_supported
from attnserve.models.layers.skinny_gemm import SKINNY_ACTIVATIONS, _shape_class, skinny_fp8_supported
from attnserve.triton_env import triton_interpreting

__all__ = ["DEFAULT_FP8_GEMV", "FP8_GEMV_VARIANTS", "FP8_GEMV_ENV", "Fp8GemvConfig", "fp8_gemv", "fp8_gemv_config",
           "fp8_gemv_supported", "fp8_gemv_variant", "fp8_gemv_candidates", "fp8_gemv_error_bound"]

#: variant name -> the kernel's ``MODE``
FP8_GEMV_VARIANTS = {"f32": 0, "f16x2": 1, "dot16": 2}
FP8_GEMV_ENV = "ATTNSERVE_FP8_GEMV"
#: the variant one row takes when ``ATTNSERVE_FP8_GEMV`` is unset (measured, see the module doc)
DEFAULT_FP8_GEMV = "f16x2"


@dataclass(frozen=True)
class Fp8GemvConfig:
    """Launch parameters of `fp8_gemv`.

    Attributes:
        variant: a key of `FP8_GEMV_VARIANTS`.
        block_n: weight rows (output columns; gated: gate rows, plus as many up rows) per
            program; power of two (``>= 16`` for ``dot16``).
        block_k: ``K`` values per loop step; power of two, ``>= 32`` (``>= 16`` for ``dot16``).
        num_warps: warps per program (power of two, 1..16).
        num_stages: software-pipelining depth (``dot16``; 1 for the others).
        carry: (f32 / f16x2) load each weight tile one ``K`` step ahead, and the first one
            before the wait of programmatic dependent launch.
    """

    variant: str
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    carry: bool = False

    def validate(self) -> None:
        """Raise ValueError when the kernel cannot be compiled with these parameters."""
        p2 = all(v >= 1 and v & (v - 1) == 0 for v in (self.block_n, self.block_k, self.num_warps))
        dot = self.variant == "dot16"
        if (self.variant not in FP8_GEMV_VARIANTS or not p2 or self.num_warps > 16 or self.num_stages < 1
                or self.block_k < (16 if dot else 32) or (dot and (self.block_n < 16 or self.carry))):
            raise ValueError(f"invalid {self}: need a variant of {sorted(FP8_GEMV_VARIANTS)}, powers of two, "
                             "block_k >= 32 (dot16: block_n, block_k >= 16, no carry), 1..16 warps, num_stages >= 1")

    def label(self) -> str:
        """``variant:block_n x block_k/warps[c][sstages]``, e.g. ``f16x2:8x2048/4w``, ``c``:
        carried tiles."""
        st = f"s{self.num_stages}" if self.variant == "dot16" else ""
        return f"{self.variant}:{self.block_n}x{self.block_k}/{self.num_warps}w{'c' if self.carry else ''}{st}"


#: (variant, shape class of `skinny_gemm._shape_class`) -> (block_n, block_k, num_warps,
#: num_stages, carry); f16x2 carries tiles where `skinny_gemm.FP8_SKINNY_M1` does (f32's
#: carried loop has ~2 more instructions per weight byte, 5.9 against 3.8: only its sweep
#: candidate carries).
#: f16x2's gated / k>=8192 / n<=4096 / n<=16384 tiles are the best of ``fp8_bench.py --parts
#: gemm --ms 1 --sweep`` on an H100 (2026-11-27; 2-7% over the starting points below). The
#: others are the unmeasured starting points (2026-11-27), chosen from each form's SASS (Triton 3.9,
#: compiled ahead of time for sm_90 on a CPU host): ``block_k`` at least a full layout row
#: (8 K values per thread and load: ``256 * num_warps``), so no lane holds a copy; more rows
#: per program share x's conversion, within ~120 registers. ``benchmarks/fp8_gemv_sass.py``
#: (loop instructions per weight byte, Llama-3-8B qkv / o / gate_up / down): default kernel
#: 5.6 / 7.5 / 4.6 / 6.0 (x through shared memory: 2-4 ``BAR.SYNC`` a step), f32 3.6 / 3.8 /
#: 3.8 / 3.8, f16x2 2.9 / 3.1 / 3.3 / 2.8, dot16 3.9 / 4.8 / 2.8 / 4.2. dot16: ``block_n >=
#: 8 * num_warps`` (an mma n-tile per warp; fewer rows duplicate warps' work), 256 programs
#: on Llama-3-8B's 4096-row o_proj.
_TILES = {
    "f32": {"gated": (2, 1024, 4, 1, False), "k>=8192": (4, 2048, 8, 1, False),
            "n<=4096": (4, 1024, 4, 1, False), "n<=16384": (4, 2048, 4, 1, False), "wide": (4, 2048, 8, 1, False)},
    "f16x2": {"gated": (4, 2048, 4, 1, False), "k>=8192": (8, 2048, 8, 1, True),
              "n<=4096": (8, 2048, 4, 1, True), "n<=16384": (4, 2048, 4, 1, False), "wide": (8, 2048, 8, 1, True)},
    "dot16": {"gated": (32, 256, 4, 4, False), "k>=8192": (16, 512, 2, 3, False),
              "n<=4096": (16, 256, 2, 4, False), "n<=16384": (32, 256, 4, 4, False), "wide": (32, 256, 4, 4, False)},
}


def fp8_gemv_variant() -> Optional[str]:
    """The variant ``ATTNSERVE_FP8_GEMV`` names: ``f16x2`` when unset, empty or ``default``;
    None (the skinny kernel) for ``skinny`` or ``0``. Read at every call.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    v = os.environ.get(FP8_GEMV_ENV, "").strip().lower()
    if v in ("", "default"):
        return DEFAULT_FP8_GEMV
    if v in ("0", "skinny"):
        return None
    if v not in FP8_GEMV_VARIANTS:
        raise ValueError(f"{FP8_GEMV_ENV}={v!r}: expected one of default, skinny, {', '.join(FP8_GEMV_VARIANTS)}")
    return v


def fp8_gemv_config(variant: str, n: int, k: int, *, gated: bool = False) -> Fp8GemvConfig:
    """Default tile of ``variant`` for a weight of ``n`` output columns (gated: ``n`` gate
    columns, the weight has ``2n`` rows) and ``K = k`` (`_TILES` by shape class; ``block_k``
    capped at ``next_pow2(k)``, floors 32 / 16)."""
    if variant not in FP8_GEMV_VARIANTS:
        raise ValueError(f"fp8_gemv: unknown variant {variant!r}; expected one of {', '.join(FP8_GEMV_VARIANTS)}")
    bn, bk, warps, stages, carry = _TILES[variant][_shape_class(n, k, gated)]
    floor = 16 if variant == "dot16" else 32
    bk = max(floor, min(bk, 1 << max(k - 1, 0).bit_length()))
    return Fp8GemvConfig(variant, bn, bk, warps, stages, carry)


def fp8_gemv_candidates(variant: str, n: int, k: int, *, gated: bool = False) -> list:
    """The default tile of ``variant`` and up to four neighbours, for
    ``benchmarks/fp8_bench.py --sweep``: f32 / f16x2: carried, ``block_k`` x2, ``block_n`` x2
    and /2 (kept while the float32 accumulator, one value per K value for f32 and per 4 for
    f16x2, stays within 64 a thread); dot16: ``block_n`` x2 (warps x2 up to 8), ``block_k`` x2 at
    one stage fewer, half the warps (at least 1)."""
    import dataclasses

    base = fp8_gemv_config(variant, n, k, gated=gated)
    rep = dataclasses.replace
    if variant == "dot16":
        more = [rep(base, block_n=base.block_n * 2, num_warps=min(8, base.num_warps * 2)),
                rep(base, block_k=base.block_k * 2, num_stages=max(2, base.num_stages - 1)),
                rep(base, num_warps=max(1, base.num_warps // 2))]
    else:
        per_value = 4 if variant == "f16x2" else 1
        more = [c for c in (rep(base, carry=not base.carry), rep(base, block_k=base.block_k * 2),
                            rep(base, block_n=base.block_n * 2),
                            rep(base, block_n=max(1, base.block_n // 2)))
                if c.block_n * c.block_k * (2 if gated else 1) // per_value <= 64 * 32 * c.num_warps]
    out = [base]
    for c in more:
        if c not in out:
            out.append(c)
    return out


def fp8_gemv_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                       variant: str) -> bool:
    """Whether `fp8_gemv` takes these operands with ``variant``: what `skinny_fp8_supported`
    accepts, with one row; for ``f16x2`` on the GPU also bfloat16 ``x``, ``K % 4 == 0``, an
    8-byte aligned ``x`` and a 4-byte aligned weight (int64 / int32 word loads)."""
    if variant not in FP8_GEMV_VARIANTS or not skinny_fp8_supported(x, weight, scale, bias) or x.shape[0] != 1:
        return False
    if variant == "f16x2":
        if x.dtype != torch.bfloat16:
            return False
        if x.is_cuda and (x.shape[1] % 4 or x.data_ptr() % 8 or weight.data_ptr() % 4):
            return False
    return True


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    *,
    variant: str,
    config: Optional[Fp8GemvConfig] = None,
    pdl: Optional[bool] = None,
) -> torch.Tensor:
    """``x @ (W_q * s)^T (+ b)`` for one row, on a W8A16 variant (see the module doc).

    Args:
        x: ``[1, K]`` float16 / bfloat16 (``f16x2``: bfloat16), contiguous last dim.
        weight: contiguous ``float8_e4m3fn`` ``[N, K]`` (gated: ``[2I, K]`` = gate rows, up rows).
        scale: contiguous float32 ``[N]``, one per weight row.
        bias: optional unit-stride ``[N]`` of ``x``'s dtype.
        activation: None, or ``"silu"`` / ``"gelu_tanh"``: ``act(gate) * up`` ``[1, I]``.
        variant: a key of `FP8_GEMV_VARIANTS`.
        config: launch parameters (its ``variant`` must be ``variant``); default
            `fp8_gemv_config`.
        pdl: programmatic dependent launch as `skinny_linear` (never for ``dot16``).

    Returns:
        new ``[1, N]`` (gated ``[1, I]``) tensor in ``x``'s dtype, float32 accumulation
        (``f16x2``: f16 products, error bound in `fp8_gemv_triton`).

    Raises:
        ValueError: operands `fp8_gemv_supported` rejects, an unknown activation, an odd
            number of rows when gated, or an invalid / mismatched ``config``.
    """
    if not fp8_gemv_supported(x, weight, scale, bias, variant):
        raise ValueError(
            f"fp8_gemv[{variant}]: unsupported x {tuple(x.shape)} {x.dtype} {x.device}, weight "
            f"{tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} {scale.dtype}: need one 16-bit row "
            "(f16x2: bfloat16, K % 4 == 0, 8-byte aligned x), contiguous float8_e4m3fn weight, float32 [N] scale")
    gated = activation is not None
    if gated and (activation not in SKINNY_ACTIVATIONS or weight.shape[0] % 2):
        raise ValueError(f"fp8_gemv: activation must be one of {', '.join(map(repr, SKINNY_ACTIVATIONS))} with an even number "
                         f"of weight rows; got {activation!r}, weight {tuple(weight.shape)}")
    k = x.shape[1]
    cols = weight.shape[0] // 2 if gated else weight.shape[0]
    if config is None:
        config = fp8_gemv_config(variant, cols, k, gated=gated)
    config.validate()
    if config.variant != variant:
        raise ValueError(f"fp8_gemv: config {config} is for variant {config.variant!r}, not {variant!r}")
    use_pdl = variant != "dot16" and (pdl_enabled(x.device) if pdl is None else bool(pdl) and pdl_supported(x.device))
    out = torch.empty((1, cols), dtype=x.dtype, device=x.device)
    from attnserve.models.layers import fp8_gemv_triton as kt

    extra = {"launch_pdl": True} if use_pdl else {}
    grid = (-(-cols // config.block_n),)
    kt._fp8_gemv_kernel[grid](
        x, weight, bias if bias is not None else scale, scale, out, cols, k,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, MODE=FP8_GEMV_VARIANTS[variant],
        INTERP=x.device.type == "cpu" or triton_interpreting(), HAS_BIAS=bias is not None, GATED=gated,
        ACT=SKINNY_ACTIVATIONS[activation] if gated else 0, USE_PDL=use_pdl, CARRY=bool(config.carry), num_warps=config.num_warps,
        num_stages=config.num_stages, **extra)
    return out


def fp8_gemv_error_bound(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, variant: str,
                         activation: Optional[str] = None, out_rel: float = 2.0 ** -8) -> torch.Tensor:
    """Elementwise float64 bound on ``|fp8_gemv(...) - ref|``, ``ref`` the float64 product of
    ``x`` and the dequantised weight (gated: ``silu(g) * u`` of it), for the tests.

    Per pre-activation output ``n``: ``s_n (c sum_k |w_q[n, k] x_k| + a)`` with, for
    ``f16x2``, ``c = 5 * 2**-11`` and ``a = K 2**-12`` (f16 products and lane sums, see
    `fp8_gemv_triton`), else ``c = 2**-12``, ``a = 0``: exact products (fp8 and f16 values
    are exact in float32) summed in float32, ``<= K / 16`` additions in a row for the defer
    and dot forms (``< 2**-14`` relative up to ``K = 2**14``; 4x left for the tensor cores'
    accumulator). Through SiLU-and-mul (``|silu'| <= 1.1``): ``1.1 e_g (|u| + e_u) +
    (|silu(g)| + 1.1 e_g) e_u``. Plus ``out_rel * |ref|``, the rounding of the 16-bit output
    (``2**-8`` covers round-to-nearest's ``2**-9``; the interpreter truncates: pass ``2**-7``).

    Args:
        x: ``[1, K]``; weight: float8_e4m3fn ``[N, K]``; scale: float32 ``[N]``.
        variant: a key of `FP8_GEMV_VARIANTS`.
        activation: None or ``"silu"``.
        out_rel: relative rounding of the output dtype.

    Returns:
        float64 ``[1, N]`` (gated ``[1, N / 2]``) on ``x``'s device.

    Raises:
        ValueError: another activation.
    """
    xd = x.double()
    wq = weight.double()
    s = scale.double()
    c, a = (5 * 2.0 ** -11, x.shape[1] * 2.0 ** -12) if variant == "f16x2" else (2.0 ** -12, 0.0)
    full = xd @ (wq * s[:, None]).t()
    err = s[None, :] * (c * (xd.abs() @ wq.abs().t()) + a)
    if activation is None:
        return out_rel * full.abs() + err
    if activation != "silu":
        raise ValueError(f"fp8_gemv_error_bound: activation {activation!r}: only 'silu' has a bound here")
    i = full.shape[1] // 2
    g, u, eg, eu = full[:, :i], full[:, i:], err[:, :i], err[:, i:]
    silu = torch.nn.functional.silu(g)
    return out_rel * (silu * u).abs() + 1.1 * eg * (u.abs() + eu) + (silu.abs() + 1.1 * eg) * eu
