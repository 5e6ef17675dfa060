#!/usr/bin/env bash
# Session 13's batched GPU run: the fused RoPE + quantising fp8 KV store (tests, then the
# Llama-3-8B-shape decode step bf16 / fp8 fused / fp8 un-fused store in one run), plus the
# GPU-only tests and scripts that session 12's review pass changed without a GPU rerun.
# STEP_BS=32 fits a bf16 8K cache on an H100; 64 needs an H200.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -v -p no:cacheprovider --timeout 200 \
  tests/gpu/test_fused_kernels_gpu.py -k "fp8 or kv_store or llama" tests/gpu/test_fp8_kv_gpu.py 2>&1 \
  > "$OUT/tests_fused.log"; tail -5 "$OUT/tests_fused.log"
grep -E "device kernels|logits" "$OUT/tests_fused.log" | head -10
timeout ${STEP_TIMEOUT:-260} python3 benchmarks/fp8_kv.py --skip-kernels --step-unfused-ab --out "$OUT" \
  --step-bs ${STEP_BS:-32} 2>&1 | tail -8 | tee "$OUT/step.log"
if [ "${REVIEW:-1}" = 1 ]; then
  timeout ${REVIEW_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --timeout 180 \
    tests/kernels/test_mla_fp8.py -k "device_splits" 2>&1 > "$OUT/tests_review.log"; tail -3 "$OUT/tests_review.log"
  timeout 120 python3 benchmarks/mla_fp8_transposed.py --rounds 1 --out "$OUT" 2>&1 | tail -4
  timeout 120 python3 benchmarks/mla_fp8_seesaw_variants.py --rounds 1 --out "$OUT" 2>&1 | tail -4
fi
