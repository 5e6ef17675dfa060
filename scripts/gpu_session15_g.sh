#!/usr/bin/env bash
# Session 15: does the fp8 prefix code slow the new-token stage when HAS_PREFIX is on
# (chunked prefill: every chunk after the first has a prefix)? bf16 vs e4m3 pools, default
# configs, on prefix-heavy and new-token-heavy shapes.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/fp8_extend_sweep.py --rounds 3 --only 0 --bf16 0 --e5m2 0 \
  --shapes 1,8192,64 1,8192,8192 1,24576,8192 1,512,8192 4,8192,512 --fp8-plain --out "$OUT" 2>&1 | grep -v round | tail -12
