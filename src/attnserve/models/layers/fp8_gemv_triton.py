"""Triton kernels behind `attnserve.models.layers.fp8_gemv` (import that module, not this one).

One activation row ``x [1, K]`` (16-bit) times an FP8 e4m3 weight ``W [N, K]`` with one
float32 scale per row: ``y = (x @ W_q^T) * s (+ b)`` (or, GATED, ``act(gate) * up`` of a
fused ``[gate | up]`` weight, as `skinny_gemm_triton`). One program per ``BLOCK_N`` rows
walks all of ``K`` (no split-K); per-element products are accumulated in a tile and
reduced over ``K`` after the loop (the ``defer`` form of `skinny_gemm_triton`). Three
inner products (constexpr ``MODE``):

* ``MODE 0`` ("f32"): the default kernel's arithmetic (fp8 -> f32 exactly, float32 FMA),
  with the layouts fixed. The default kernel loads the weight tile 16 bytes per thread
  (16 fp8 values) and the x tile 16 bytes per thread (8 bf16 values); the two layouts
  differ, so every ``K`` step moves the x tile through shared memory (a ``convert_layout``
  with 4 ``BAR.SYNC``, seen in its sm_90 SASS) and converts x once per weight element.
  Here the weight offsets have a contiguity of 8 (8-byte loads, 8 fp8 per thread, the x
  tile's layout) and x is a ``[1, BLOCK_K]`` row converted once and broadcast over the
  rows in registers. (Memory-bound Hopper code usually wants 16-byte accesses per
  thread and several loads in flight before the first use; 8-byte weight loads are the
  price of one layout for both operands, and each thread still issues all of a step's
  loads before its first product.)
* ``MODE 1`` ("f16x2"): the weight read as int32 words (4 fp8 values; 8-byte loads of two
  words, the layout of x read as int64 words of 4 bf16), converted with
  ``cvt.rn.f16x2.e4m3x2`` (PTX ISA 9.x, sm_89+, exact: every e4m3 value is an f16 value),
  multiplied in packed half precision (``mul.rn.f16x2`` / ``fma.rn.f16x2``) against x
  converted once per step to f16x2 pairs, each f16 lane summing 4 products before it is
  widened and added to a float32 accumulator (2 words, 8 weight values, per asm
  instance: 4 conversions, 4 packed scalings by 2**-11, 4 packed multiply-adds, 2
  widenings, 2 float32 adds = 2 instructions per weight byte; x's conversion, shared by
  the ``BLOCK_N`` rows, adds ~28 per thread and step: 2.8-3.3 per byte in all, against
  4.6-7.5 for the default kernel's loop, `benchmarks/fp8_gemv_sass.py`.)
* ``MODE 2`` ("dot16"): ``tl.dot`` on a 16-row activation tile (row 0 = x, rows 1..15
  masked to zero) in float16 (x saturated to f16; fp8 -> f16 is one paired instruction)
  with float32 accumulation; ``num_stages`` software-pipelines the weight tiles through
  shared memory (cp.async), so bytes in flight do not cost registers.

**Error of MODE 1** (the only mode that rounds products; `fp8_gemv.fp8_gemv_error_bound`
computes the bound below). The products must fit binary16 (finite up to 65504, normal down
to 2**-14, ``u = 2**-11``). The weight is multiplied by ``2**-11`` after its exact
conversion, exactly: ``|w'| <= 448 * 2**-11 = 0.219``, and e4m3's values ``m 2**e`` (3
mantissa bits, ``e >= -9``) become ``m 2**(e - 11)``, multiples of f16's smallest step
2**-24. x is saturated to +-65504 (bf16 beyond it -- none in practice -- is clamped) and
otherwise converts exactly for ``|x| >= 2**-14`` (bf16's 8 significant bits fit f16's 11).
So every product is ``<= 14329`` and every 4-term lane sum ``<= 57316 < 65504``: no f16
overflow. (Scaling x instead would push the small entries of a decode activation into f16
subnormals: x times 2**-11 loses bits below ``|x| = 2**-3``.) Per lane the value differs
from the exact sum of its 4 products ``p_i = w'_i x_i`` by at most the ``mul``'s and 3
``fma``'s roundings, each ``<= u`` of a partial sum (``<= sum|p_i|``) or ``2**-25`` absolute
in the subnormal range (``2**-14`` in units of ``w_q x`` after the ``2**11`` rescale), plus
``|w_q| 2**-25`` for an x below 2**-14. With the float32 accumulation (``< 2**-19`` relative
at ``K <= 2**15``) the output error is ``<= s (4.01 u sum_k |w_q,k x_k| + K 2**-12)`` (the
tests allow ``5 u``: the interpreter's double rounding). The roundings are unbiased and
independent, so the typical error is ``~ u sqrt(sum_k p_k**2)``, a few ``1e-4`` of the
output's standard deviation: below the bf16 output rounding (``2**-9``). A float16 emulation
of these lane sums in PyTorch on the Llama-3-8B decode shapes (W ~ N(0, 0.05) quantised per
row, x ~ N(0, 1) and N(0, 0.01)): rms error 3.3e-4 of the rms output, the largest 1.4% of
the bound; the bf16 output rounding alone is ~1e-3 rms. The interpreter form computes the
same lane sums with plain ``tl`` ops (an ``fma`` as a float32 multiply-add rounded to f16:
it can round twice, within the same bound).

Ideas (not code) from the FP8 weight-only GEMV kernels discussed around SGLang / vLLM and
the decode attention kernel's fp8 pairs (`decode_attention._fp8_pairs_to_f16`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnserve.pdl_triton import gdc_launch_dependents, gdc_wait
from attnserve.models.layers.skinny_gemm_triton import _gate_act

@triton.jit
def _x_to_f16x2(xw):
    """int64 words of 4 bf16 (``k .. k+3``) -> two int32 f16x2 words (``k, k+1`` and
    ``k+2, k+3``; lower half = lower ``k``), each saturated to f16's
    finite range (``cvt.rn.satfinite.f16x2.f32``: round to nearest even, clamp to +-65504)."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .b32 lo, hi, a, b, c, d;\n\tmov.b64 {lo, hi}, $2;"
        "\n\tshl.b32 a, lo, 16;\n\tand.b32 b, lo, 0xffff0000;\n\tshl.b32 c, hi, 16;\n\tand.b32 d, hi, 0xffff0000;"
        "\n\tcvt.rn.satfinite.f16x2.f32 $0, b, a;\n\tcvt.rn.satfinite.f16x2.f32 $1, d, c;\n\t}",
        "=r,=r,l", [xw], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _fp8x8_dot_f16x2(w, xa, xb):
    """Two int32 words of 4 e4m3 each (``w``; asm operands $2, $3) against their x pairs
    (``xa``: ``k, k+1``; ``xb``: ``k+2, k+3``; f16x2) -> two float32 lane sums (lower /
    upper half), each the f16 sum of 4 products: ``mul`` then 3 ``fma`` in f16x2, of the
    weight times ``2**-11`` (f16 ``0x1000``; exact, see the module doc) and x."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .b16 l0, h0, l1, h1, s0, s1;\n\t.reg .b32 a0, b0, a1, b1, p, sc;"
        "\n\tmov.b32 {l0, h0}, $2;\n\tmov.b32 {l1, h1}, $3;\n\tmov.b32 sc, 0x10001000;"
        "\n\tcvt.rn.f16x2.e4m3x2 a0, l0;\n\tcvt.rn.f16x2.e4m3x2 b0, h0;"
        "\n\tcvt.rn.f16x2.e4m3x2 a1, l1;\n\tcvt.rn.f16x2.e4m3x2 b1, h1;"
        "\n\tmul.rn.f16x2 a0, a0, sc;\n\tmul.rn.f16x2 b0, b0, sc;"
        "\n\tmul.rn.f16x2 a1, a1, sc;\n\tmul.rn.f16x2 b1, b1, sc;"
        "\n\tmul.rn.f16x2 p, a0, $4;\n\tfma.rn.f16x2 p, b0, $6, p;"
        "\n\tfma.rn.f16x2 p, a1, $5, p;\n\tfma.rn.f16x2 p, b1, $7, p;"
        "\n\tmov.b32 {s0, s1}, p;\n\tcvt.f32.f16 $0, s0;\n\tcvt.f32.f16 $1, s1;\n\t}",
        "=f,=f,r,r,r,r,r,r", [w, xa, xb], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _x_f16(x, SHIFT: tl.constexpr):
    """x (any float) -> f16, times ``1 / SHIFT`` (a power of two), clamped to +-65504."""
    xs = x.to(tl.float32) * (1.0 / SHIFT)
    return tl.minimum(tl.maximum(xs, -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _lanes_f16_interp(x_ptr, w_rows, mask_n, kbase, k0, K):
    """MODE 1 without inline asm (interpreter): for each lane ``c`` (group ``c // 2`` of 8
    ``K`` values, lane ``c % 2``), the f16 sum over ``i = 0..3`` of ``w[k] * x'[k]`` at ``k =
    k0 + 8 (c // 2) + 2 i + c % 2`` -- the asm's products in its order -- as float32."""
    p = tl.zeros((w_rows.shape[0], kbase.shape[0]), dtype=tl.float16)
    for i in tl.static_range(4):
        kk = k0 + kbase + 2 * i
        km = kk < K
        xi = _x_f16(tl.load(x_ptr + kk[None, :], mask=km[None, :], other=0.0), 1.0)
        wi = tl.load(w_rows[:, None] + kk[None, :], mask=mask_n[:, None] & km[None, :], other=0.0)
        wi = (wi.to(tl.float32) * 0.00048828125).to(tl.float16)  # w * 2**-11, exact
        p = (wi.to(tl.float32) * xi.to(tl.float32) + p.to(tl.float32)).to(tl.float16)
    return p.to(tl.float32)


@triton.jit
def _w_tiles(w_ptrs, off, up_off, wm, OTHER: tl.constexpr, GATED: tl.constexpr):
    """The weight tile at element offset ``off`` (and, GATED, the up tile ``up_off`` further);
    masked lanes read ``OTHER`` (zero of the element type) and move no bytes."""
    w_t = tl.load(w_ptrs + off, mask=wm, other=OTHER)
    u_t = w_t
    if GATED:
        u_t = tl.load(w_ptrs + up_off + off, mask=wm, other=OTHER)
    return w_t, u_t


@triton.jit
def _step(acc, acc_u, w_t, u_t, xa, xb, F16X2: tl.constexpr, GATED: tl.constexpr):
    """One ``K`` step into the deferred accumulators: F16X2, `_fp8x8_dot_f16x2` of int32
    words against x's f16x2 pairs; else float32 products of the fp8 tile and x (``xa``)."""
    if F16X2:
        acc += _fp8x8_dot_f16x2(w_t, xa, xb)
        if GATED:
            acc_u += _fp8x8_dot_f16x2(u_t, xa, xb)
    else:
        acc += w_t.to(tl.float32) * xa
        if GATED:
            acc_u += u_t.to(tl.float32) * xa
    return acc, acc_u


@triton.jit
def _x_step(x_ptrs, k0, km, F16X2: tl.constexpr):
    """x of one step: F16X2, the f16x2 pairs of the int64 words; else the row in float32."""
    if F16X2:
        xa, xb = _x_to_f16x2(tl.load(x_ptrs + k0, mask=km[None, :], other=0))
    else:
        xa = tl.load(x_ptrs + k0, mask=km[None, :], other=0.0).to(tl.float32)
        xb = xa
    return xa, xb


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr, INTERP: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, USE_PDL: tl.constexpr,
    CARRY: tl.constexpr = False,
):
    """Grid ``(cdiv(N, BLOCK_N),)``; ``y`` ``[1, N]``, ``x`` ``[1, K]`` contiguous, ``w``
    contiguous e4m3 ``[N, K]`` (GATED: ``[2N, K]``, gate rows then up rows), ``s`` float32
    ``[N]`` (``[2N]``), ``b`` (HAS_BIAS) ``[N]`` (``[2N]``). MODE 1 on the GPU needs ``K % 4
    == 0`` and an 8-byte aligned ``x``; MODE 2 ``BLOCK_N, BLOCK_K >= 16`` (host checks).
    INTERP: the plain-``tl`` forms (no inline asm; float32 ``tl.dot`` operands). CARRY
    (MODE 0 and 1): step ``i + 1``'s weight tile is loaded before step ``i``'s products, and
    with USE_PDL the first tile before the wait for the previous kernel (as
    `skinny_gemm_triton`'s carried loop)."""
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    if MODE == 2 or (MODE == 1 and INTERP):
        if USE_PDL:
            gdc_wait()
    if MODE == 2:
        offs_m = tl.arange(0, 16)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]
        for k0 in range(0, K, BLOCK_K):
            km = (offs_k + k0) < K
            # the x row saturated once, then placed in row 0 of a zero tile
            xr = _x_f16(tl.load(x_ptr + k0 + offs_k, mask=km, other=0.0), 1.0)
            xt = tl.where((offs_m == 0)[:, None], xr[None, :], 0.0).to(tl.float16)
            wm = mask_n[:, None] & km[None, :]
            wt = tl.load(w_ptrs + k0, mask=wm, other=0.0)
            if INTERP:
                acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(wt.to(tl.float16)), out_dtype=tl.float32)
            if GATED:
                ut = tl.load(w_ptrs + N * K + k0, mask=wm, other=0.0)
                if INTERP:
                    acc_u += tl.dot(xt.to(tl.float32), tl.trans(ut.to(tl.float32)), input_precision="ieee")
                else:
                    acc_u += tl.dot(xt, tl.trans(ut.to(tl.float16)), out_dtype=tl.float32)
        out = tl.sum(acc, axis=0)  # rows 1..15 are zero
        out_u = tl.sum(acc_u, axis=0)
    elif MODE == 1 and INTERP:
        c = tl.arange(0, BLOCK_K // 4)
        kbase = 8 * (c // 2) + c % 2
        acc = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc += _lanes_f16_interp(x_ptr, w_ptr + rows * K, mask_n, kbase, k0, K)
            if GATED:
                acc_u += _lanes_f16_interp(x_ptr, w_ptr + (rows + N) * K, mask_n, kbase, k0, K)
        out = tl.sum(acc, axis=1) * 2048.0  # undo w's 2**-11 (exact)
        out_u = tl.sum(acc_u, axis=1) * 2048.0  # undo w's 2**-11 (exact)
    else:
        # MODE 0 (bytes, 8 per thread and load, as x's bf16 row) or MODE 1 (int32 words,
        # 2 per thread and load, as x's int64 words): weight offsets of contiguity 8 / 2
        F16X2: tl.constexpr = MODE == 1
        PER: tl.constexpr = 4 if F16X2 else 1  # K values per loaded element
        STEP: tl.constexpr = BLOCK_K // PER
        VEC: tl.constexpr = 2 if F16X2 else 8
        OTHER: tl.constexpr = 0 if F16X2 else 0.0
        kk = K // PER
        wp = w_ptr.to(tl.pointer_type(tl.int32 if F16X2 else w_ptr.dtype.element_ty))
        xp = x_ptr.to(tl.pointer_type(tl.int64 if F16X2 else x_ptr.dtype.element_ty))
        j = tl.arange(0, STEP)
        w_ptrs = wp + rows[:, None] * kk + ((j // VEC) * VEC + j % VEC)[None, :]
        x_ptrs = xp + j[None, :]
        up = N * kk
        acc = tl.zeros((BLOCK_N, STEP), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, STEP), dtype=tl.float32)
        if CARRY:
            w_t, u_t = _w_tiles(w_ptrs, 0, up, mask_n[:, None] & (j < kk)[None, :], OTHER, GATED)
            if USE_PDL:
                gdc_wait()
            for k0 in range(0, kk, STEP):
                km = (j + k0) < kk
                xa, xb = _x_step(x_ptrs, k0, km, F16X2)
                # the next step's tiles (all lanes masked past K: no bytes) before these products
                nm = mask_n[:, None] & ((j + k0 + STEP) < kk)[None, :]
                w_n, u_n = _w_tiles(w_ptrs, k0 + STEP, up, nm, OTHER, GATED)
                acc, acc_u = _step(acc, acc_u, w_t, u_t, xa, xb, F16X2, GATED)
                w_t = w_n
                u_t = u_n
        else:
            if USE_PDL:
                gdc_wait()
            for k0 in range(0, kk, STEP):
                km = (j + k0) < kk
                xa, xb = _x_step(x_ptrs, k0, km, F16X2)
                w_t, u_t = _w_tiles(w_ptrs, k0, up, mask_n[:, None] & km[None, :], OTHER, GATED)
                acc, acc_u = _step(acc, acc_u, w_t, u_t, xa, xb, F16X2, GATED)
        out = tl.sum(acc, axis=1)
        out_u = tl.sum(acc_u, axis=1)
        if F16X2:
            out *= 2048.0  # undo w's 2**-11 (exact)
            out_u *= 2048.0
    out *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if GATED:
        out_u *= tl.load(s_ptr + N + offs_n, mask=mask_n, other=0.0)
        if HAS_BIAS:
            out_u += tl.load(b_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        out = _gate_act(out, ACT) * out_u
    tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)
