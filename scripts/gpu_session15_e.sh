#!/usr/bin/env bash
# Session 15, fifth batch: the extend kernel's prefix stage compiled out under
# has_prefix=False (HAS_PREFIX). The fourth batch showed PREFIX_F16 was not the cause:
# still 0.745x. Extend tests (fp8 kernels, GPU kernels, speculative verify), the plain and
# prefix-hit timings, then the long end-to-end workload with the fp8 pool.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/long-fp8_e4m3"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -q -p no:cacheprovider --timeout 150 tests/kernels/test_fp8_kv_kernels.py \
  tests/gpu/test_triton_kernels_gpu.py tests/gpu/test_speculative_gpu.py -k "extend or prefix or verify or draft or spec" 2>&1 > "$OUT/t1.log"
tail -2 "$OUT/t1.log"
timeout 120 python3 benchmarks/fp8_extend_sweep.py --rounds 3 --only 0 --bf16 0 --e5m2 0 \
  --shapes 1,0,8192 8,0,1024 4,8192,512 --fp8-plain --out "$OUT" 2>&1 | grep -v round | tail -8
PYTHONPATH=src timeout 200 python3 -m attnserve.bench.offline --device cuda --load-format dummy --models llama-3-8b \
  --requests 64 --input-len 8192 --output-len 1024 --kv-cache-dtypes fp8_e4m3 --overlap on --warmup-output-len 8 \
  --out "$OUT/long-fp8_e4m3" 2>&1 | grep -v -i "warn\|KV pool exhausted" | tail -3
