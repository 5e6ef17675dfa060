#!/usr/bin/env bash
# Session 14, last call: the extend GPU tests (kernels, speculative verify, fp8 engine) on the
# final extend defaults (block_n_prefix 128 with the has_prefix hint), then the sweep of the
# new default against the old one (plain prefills must not change).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
T=${TEST_TIMEOUT:-420}
timeout $T python3 -m pytest -q -p no:cacheprovider --timeout 250 -x \
  tests/gpu/test_triton_kernels_gpu.py -k "extend" 2>&1 > "$OUT/t1.log"; tail -1 "$OUT/t1.log"
timeout $T python3 -m pytest -q -p no:cacheprovider --timeout 250 -x tests/kernels/test_extend_attention.py \
  tests/gpu/test_speculative_gpu.py tests/gpu/test_fp8_kv_gpu.py 2>&1 > "$OUT/t2.log"; tail -1 "$OUT/t2.log"
timeout $T python3 -m pytest -q -p no:cacheprovider --timeout 250 -x tests/kernels/test_fp8_kv_kernels.py \
  -k "extend" 2>&1 > "$OUT/t3.log"; tail -1 "$OUT/t3.log"
timeout 200 python3 benchmarks/fp8_extend_sweep.py --rounds 3 --only 2 --bf16 2 --e5m2 0 \
  --shapes 4,8192,512 1,0,8192 8,0,1024 16,2048,128 --out "$OUT" 2>&1 | grep -v round | tail -20
