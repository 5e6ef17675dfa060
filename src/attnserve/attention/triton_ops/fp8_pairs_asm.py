"""PTX text of the in-register fp8 -> fp16 conversions of int16 pairs of fp8 values, shared by
the Triton decode kernel (`decode_attention._fp8_pairs_to_f16`) and the Gluon one
(`decode_fp8_gluon_kernel._pairs_to_f16`). Plain strings, no imports (cheap for both); each
kernel module wraps the one it uses in a ``constexpr`` global, so a change here reaches the
JIT cache key.

Both take the two consecutive register elements of a thread (``inline_asm_elementwise`` with
``pack=2``, constraints ``"=r,=r,r"``): one 32-bit register of bytes (a0, a1, b0, b1), i.e.
two int16 pairs, and give two f16x2 registers, ``$0`` = (a0, b0) and ``$1`` = (a1, b1) as
fp16 (PTX ISA: ``prmt``; ``cvt.rn.f16x2.e4m3x2``, sm_89+).
"""

from __future__ import annotations

__all__ = ["E4M3X2_TO_F16X2", "E5M2X2_TO_F16X2"]

#: one ``prmt`` regroups the bytes into (a0, b0) / (a1, b1), one ``cvt.rn.f16x2.e4m3x2`` each converts
E4M3X2_TO_F16X2 = (
    "{\n\t.reg .b32 t;\n\t.reg .b16 lo, hi;\n\tprmt.b32 t, $2, 0, 0x3120;\n\tmov.b32 {lo, hi}, t;"
    "\n\tcvt.rn.f16x2.e4m3x2 $0, lo;\n\tcvt.rn.f16x2.e4m3x2 $1, hi;\n\t}"
)
#: e5m2 is fp16's upper byte: a ``prmt`` with zero low bytes is the exact conversion
E5M2X2_TO_F16X2 = "prmt.b32 $0, $2, 0, 0x2404;\n\tprmt.b32 $1, $2, 0, 0x3414;"
