#!/usr/bin/env bash
# Session 11's batched GPU run: tests touched by this session's changes, then FP8 KV on the
# GQA decode kernel and the Llama-3-8B decode step (with a per-kernel breakdown).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --timeout 200 \
  tests/gpu/test_engine_gpu.py tests/gpu/test_fused_kernels_gpu.py tests/models/test_layers.py \
  tests/models/test_cpu_gemm.py 2>&1 | tail -15 | tee "$OUT/tests.log"
timeout ${FP8_TIMEOUT:-300} python3 benchmarks/fp8_kv.py --out "$OUT" --only gqa_decode_bs64_8k gqa_decode_bs8_32k \
  --formats bf16 fp8_e4m3 ${FP8_ARGS:-} 2>&1 | tail -12 | tee "$OUT/fp8.log"
