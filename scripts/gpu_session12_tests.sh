#!/usr/bin/env bash
# Session 12: the fp8 kernel and engine tests on the GPU (decode V pairs now the H100 default too).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
for f in tests/kernels/test_fp8_kv_kernels.py tests/gpu/test_fp8_kv_gpu.py tests/kernels/test_mla_fp8.py; do
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --timeout 120 --durations 5 "$f" 2>&1 \
    | tail -12 | tee "$OUT/$(basename $f .py).log"
done
