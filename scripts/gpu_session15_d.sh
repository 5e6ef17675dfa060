#!/usr/bin/env bash
# Session 15, fourth batch: PREFIX_F16 only under has_prefix (a plain prefill over an fp8
# pool ran 0.72x of a bf16 pool's in the third batch). Extend tests (fp8 + GPU), the plain
# and prefix-hit timings again, then the long end-to-end workload with the fp8 pool only
# (its prefill was 15.2 s against bf16's 14.3 s).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/long-fp8_e4m3"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 150 tests/kernels/test_fp8_kv_kernels.py -k extend \
  tests/gpu/test_triton_kernels_gpu.py 2>&1 > "$OUT/t1.log"; tail -2 "$OUT/t1.log"
timeout 120 python3 benchmarks/fp8_extend_sweep.py --rounds 3 --only 0 --bf16 0 --e5m2 0 \
  --shapes 1,0,8192 8,0,1024 4,8192,512 --fp8-plain --out "$OUT" 2>&1 | grep -v round | tail -8
PYTHONPATH=src timeout 240 python3 -m attnserve.bench.offline --device cuda --load-format dummy --models llama-3-8b \
  --requests 64 --input-len 8192 --output-len 1024 --kv-cache-dtypes fp8_e4m3 --overlap on --warmup-output-len 8 \
  --out "$OUT/long-fp8_e4m3" 2>&1 | grep -v -i "warn\|KV pool exhausted" | tail -3
