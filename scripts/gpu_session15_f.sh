#!/usr/bin/env bash
# Session 15, last batch: the GPU tests the fifth batch's time limit cut (the speculative
# verify / draft-extend tests, which run the extend kernel through the engine), and the
# engine-loop tests (prefix cache with graphs and overlap) on the HAS_PREFIX kernel.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
timeout 280 python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/gpu/test_speculative_gpu.py \
  tests/gpu/test_engine_loop_gpu.py -k "spec or verify or draft or prefix or retraction" 2>&1 > "$OUT/t1.log"
tail -2 "$OUT/t1.log"
