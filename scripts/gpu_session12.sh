#!/usr/bin/env bash
# Session 12's batched GPU run (H100): issue 21's fp8-vs-bf16 benchmark in one run (GQA and
# MLA kernels, the Llama-3-8B decode step at --step-bs, 32 x 8K fits an H100 in bf16), the
# fp8 kernel tests the session touched, then the GQA V-pairs A/B on this device.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
timeout ${FP8_TIMEOUT:-300} python3 benchmarks/fp8_kv.py --out "$OUT" --step-bs ${STEP_BS:-32} 2>&1 \
  | tail -40 | tee "$OUT/fp8.log"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --timeout 150 \
  tests/kernels/test_mla_fp8.py tests/gpu/test_fp8_kv_gpu.py 2>&1 | tail -15 | tee "$OUT/tests.log"
timeout ${PAIRS_TIMEOUT:-90} python3 benchmarks/fp8_decode_sweep.py --pairs-ab --out "$OUT" 2>&1 \
  | tail -30 | tee "$OUT/pairs.log"
