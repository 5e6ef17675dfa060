#!/usr/bin/env bash
# Session 12: MLA fp8 at <= 16 heads with two programs' worth of splits per SM (the split
# policy's kv_dtype), then the MLA GPU tests it touches. Full pytest logs under $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
timeout ${FP8_TIMEOUT:-150} python3 benchmarks/fp8_kv.py --out "$OUT" --skip-step --formats bf16 fp8_e4m3 fp8_e5m2 \
  --only mla16_decode_bs128_4k mla16_decode_bs32_16k mla128_decode_bs32_16k mla16_decode_bs128_4k_page32 2>&1 \
  | tail -8 | tee "$OUT/fp8.log"
run_tests() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m pytest -v -p no:cacheprovider --timeout 200 "$@" > "$OUT/$name.log" 2>&1
  echo "$name: $(grep -c PASSED "$OUT/$name.log") passed, $(grep -cE 'FAILED|ERROR' "$OUT/$name.log") failed/errors"
  tail -2 "$OUT/$name.log"
}
run_tests deepseek_fp8 150 tests/gpu/test_deepseek_gpu.py -k "fp8_latent or v3_attention_shape"
run_tests mla_splits 60 tests/kernels/test_mla_decode.py -k "split or workspace"
run_tests mla_fp8 ${MLA_FP8_TIMEOUT:-200} tests/kernels/test_mla_fp8.py
