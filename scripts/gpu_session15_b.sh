#!/usr/bin/env bash
# Session 15, second batch (it also ran a memory-release diagnostic, since turned into
# tests/gpu/test_engine_loop_gpu.py::test_dropped_engine_gives_its_gpu_memory_back);
# the short end-to-end workload (both pools hold every request); the extend kernel timings
# with the has_prefix hint (benchmarks/kernels.py --skip-decode, fp8_kv.py's prefix case).
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
for dt in auto fp8_e4m3; do
  mkdir -p "$OUT/short-$dt"
  timeout 200 python3 -m attnserve.bench.offline --device cuda --load-format dummy --models llama-3-8b \
    --requests 64 --input-len 2048 --output-len 512 --kv-cache-dtypes $dt --overlap on --warmup-output-len 8 \
    --out "$OUT/short-$dt" 2>&1 | grep -v -i "warn\|KV pool exhausted" | tail -4
done
mkdir -p "$OUT/kernels"
timeout 150 python3 benchmarks/kernels.py --skip-decode --out "$OUT/kernels" 2>&1 | tail -15
timeout 100 python3 benchmarks/fp8_kv.py --skip-step --only gqa_extend_bs4_prefix8k_new512 --formats bf16 fp8_e4m3 \
  --out "$OUT/kernels" 2>&1 | tail -4
