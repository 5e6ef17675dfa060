#!/usr/bin/env bash
# Session 15: the engine-loop GPU tests after the admission fix (retraction under CUDA graphs
# and overlap, the prefix cache with graphs) and the new memory-release test.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
timeout 400 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/gpu/test_engine_loop_gpu.py \
  tests/gpu/test_fp8_kv_gpu.py 2>&1 > "$OUT/t1.log"; tail -3 "$OUT/t1.log"
