#!/usr/bin/env bash
# Session 14's batched GPU run: the MLA latent pool's fused (store_kv) write, the fp8 seesaw
# global-load converter A/B (benchmarks/mla_fp8_seesaw_variants.py), and the GPU-only tests
# and scripts session 12's review pass changed without a GPU rerun.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --timeout 180 \
  tests/gpu/test_fp8_kv_gpu.py 2>&1 > "$OUT/tests_pool.log"; tail -4 "$OUT/tests_pool.log"
timeout ${VAR_TIMEOUT:-300} python3 benchmarks/mla_fp8_seesaw_variants.py --rounds ${ROUNDS:-2} --out "$OUT" \
  --shapes ${SHAPES:-mla128_decode_bs32_16k} --variants ${VARIANTS:-default glob_a2 glob_a2_r64 glob_a3_r64 glob_a2_pf2} \
  --label global 2>&1 | tee "$OUT/variants.log" | grep -v "round" | tail -30
if [ "${REVIEW:-0}" = 1 ]; then
  timeout ${REVIEW_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --timeout 180 \
    tests/kernels/test_mla_fp8.py -k "device_splits" 2>&1 > "$OUT/tests_review.log"; tail -3 "$OUT/tests_review.log"
  timeout 120 python3 benchmarks/mla_fp8_transposed.py --rounds 1 --out "$OUT" 2>&1 | tail -4
fi
