#!/usr/bin/env bash
# Session 14: 128-key prefix tiles in the extend kernel (ExtendConfig.block_n_prefix): GPU
# extend tests (bf16, fp8, window / cap / mask, engine paths), then the sweep new vs old
# default over prefix-cache-hit and plain-prefill shapes.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --timeout 250 \
  tests/gpu/test_triton_kernels_gpu.py -k extend tests/kernels/test_extend_attention.py \
  tests/kernels/test_fp8_kv_kernels.py -k extend tests/gpu/test_speculative_gpu.py 2>&1 > "$OUT/tests_extend.log"
tail -3 "$OUT/tests_extend.log"
timeout 300 python3 benchmarks/fp8_extend_sweep.py --rounds 3 --only 3 --bf16 3 --e5m2 2 \
  --shapes 4,8192,512 1,0,8192 8,0,1024 16,2048,128 1,32768,2048 64,4096,16 8,512,512 --out "$OUT" 2>&1 \
  | grep -v round | tail -60
