#!/usr/bin/env bash
# Session 14: fp16 prefix dots for bf16 queries over an fp8 prefix in the extend kernel
# (PREFIX_F16): GPU tests, then the extend case bf16 / e4m3 / e5m2, new vs old (the same tree
# with PREFIX_F16 forced off, under /tmp/src_old) in one call; then session 12's review-pass
# GPU tests and scripts.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --timeout 180 \
  tests/kernels/test_fp8_kv_kernels.py -k extend 2>&1 > "$OUT/tests_extend.log"; tail -3 "$OUT/tests_extend.log"
rm -rf /tmp/src_old && cp -r src /tmp/src_old
sed -i 's/PREFIX_F16=k_buffer.dtype in FP8_DTYPES and/PREFIX_F16=False and/' \
  /tmp/src_old/attnserve/attention/triton_ops/extend_attention.py
grep -c "PREFIX_F16=False and" /tmp/src_old/attnserve/attention/triton_ops/extend_attention.py
for r in 1 2; do
  mkdir -p "$OUT/new$r" "$OUT/old$r"
  timeout 150 python3 benchmarks/fp8_kv.py --skip-step --only gqa_extend_bs4_prefix8k_new512 --out "$OUT/new$r" \
    2>&1 | grep gqa_extend
  PYTHONPATH=/tmp/src_old:tests timeout 150 python3 benchmarks/fp8_kv.py --skip-step \
    --only gqa_extend_bs4_prefix8k_new512 --out "$OUT/old$r" 2>&1 | grep gqa_extend
done
if [ "${REVIEW:-1}" = 1 ]; then
  timeout ${REVIEW_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --timeout 180 \
    tests/kernels/test_mla_fp8.py -k "device_splits" 2>&1 > "$OUT/tests_review.log"; tail -3 "$OUT/tests_review.log"
  timeout 150 python3 benchmarks/mla_fp8_transposed.py --rounds 1 --out "$OUT" 2>&1 | tail -4
fi
