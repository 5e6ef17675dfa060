"""Engine variants of ``benchmarks/fp8_bench.py`` (``--variants``): the environment each runs
under, and which rows each skips. A variant sets switches that the engine reads at every
call (`attnserve.env_options.env_flag` and friends), so one process times them all.
"""

from __future__ import annotations

#: engine variant -> environment it runs under (see the module doc)
ENGINE_VARIANTS = {
    "bf16": {},
    # bf16 with the projection weights stored K-major (`weight_layout`; the Triton decode GEMMs decline them)
    "bf16-kn": {"ATTNSERVE_WEIGHT_LAYOUT": "kn"},
    "fp8": {},
    "fp8-16bit-tiles": {"ATTNSERVE_FP8_SKINNY_TABLE": "0", "ATTNSERVE_FP8_GEMV": "skinny"},
    "fp8-w8a16-64": {"ATTNSERVE_FP8_W8A16_MAX_M": "64"},
    "fp8-unfused-producers": {"ATTNSERVE_FP8_FUSED_PRODUCERS": "0"},
    "fp8-next": {"ATTNSERVE_FP8_W8A16_MAX_M": "64", "ATTNSERVE_FP8_FUSED_PRODUCERS": "1"},
    # the one-row W8A16 variants (`fp8_gemv`; f16x2 is the default); decode rows only
    "fp8-gemv-skinny": {"ATTNSERVE_FP8_GEMV": "skinny"},
    "fp8-gemv-f32": {"ATTNSERVE_FP8_GEMV": "f32"},
    "fp8-gemv-f16x2": {"ATTNSERVE_FP8_GEMV": "f16x2"},
    "fp8-gemv-dot16": {"ATTNSERVE_FP8_GEMV": "dot16"},
    # the opt-in FP8-weight mid-size GEMM (`fp8_mid_gemm`) for 17..256 rows; no prefill row
    "fp8-mid-w8a16": {"ATTNSERVE_FP8_MID_GEMM": "w8a16"},
    "fp8-mid-w8a8": {"ATTNSERVE_FP8_MID_GEMM": "w8a8"},
    # the mid GEMM's default route (33..64 rows, measured shapes) off: `_scaled_mm` as before
    "fp8-mid-off": {"ATTNSERVE_FP8_MID_GEMM": "off"},
    # a marked gate_up on the row-wise `_scaled_mm` again (the default folds its scales into
    # the SiLU-and-mul after a tensor-wise GEMM, `Fp8LinearMethod._folded_gate_up`)
    "fp8-rowwise-gate-up": {"ATTNSERVE_FP8_FOLDED_GATE_SCALES": "0"},
    # a marked down_proj on the row-wise `_scaled_mm` again (the default: `Fp8LinearMethod._folded_down`)
    "fp8-rowwise-down": {"ATTNSERVE_FP8_FOLDED_DOWN_SCALES": "0"},
    # o_proj on the row-wise `_scaled_mm` again (the default quantises its input, then folds)
    "fp8-rowwise-o": {"ATTNSERVE_FP8_FOLDED_O_SCALES": "0"},
    # every `_scaled_mm` without Hopper's fast FP8 accumulation (the default uses it, as vLLM's CUTLASS)
    "fp8-exact-accum": {"ATTNSERVE_FP8_FAST_ACCUM": "0"},
    # the folded o_proj / down_proj scaling their outputs themselves (`fused_inputs`, "Lazy scales",
    # the default: the reading add-RMSNorm applies the scales); decode batches only
    "fp8-lazy-off": {"ATTNSERVE_FP8_LAZY_SCALES": "0"},
    # `_scaled_mm` without its row padding (`fp8_linear.scaled_mm_padded_rows`); decode rows only
    "fp8-nopad": {"ATTNSERVE_FP8_SCALED_MM_PAD": "0"},
    # plain causal prefills on the Triton extend kernel instead of the Gluon one (`prefill_gluon`)
    "bf16-triton-prefill": {"ATTNSERVE_EXTEND_GLUON": "0"},
    "fp8-triton-prefill": {"ATTNSERVE_EXTEND_GLUON": "0"},
    # the LM head FP8 too (`--enable-fp8-lm-head`, an engine flag: `ENGINE_KWARGS`)
    "fp8-lm-head": {},
}
#: engine flags of a variant beside its environment
ENGINE_KWARGS = {"fp8-lm-head": {"enable_fp8_lm_head": True}}
#: engine variants timed at decode only (no prefill, no throughput run)
DECODE_ONLY = ("fp8-16bit-tiles", "fp8-gemv-skinny", "fp8-gemv-f32", "fp8-gemv-f16x2", "fp8-gemv-dot16", "fp8-nopad",
               "fp8-rowwise-down")
#: engine variants without the 8192-token prefill row (their change is decode-only)
NO_PREFILL = ("fp8-w8a16-64", "fp8-mid-w8a16", "fp8-mid-w8a8", "fp8-mid-off", "fp8-rowwise-o", "fp8-lazy-off")
