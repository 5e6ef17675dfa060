#!/usr/bin/env bash
# Session 15 (issue 21, end to end): fp8 vs bf16 KV cache in the engine loop
# (`attnserve.bench.offline --load-format dummy`), Llama-3-8B shape, one process per KV dtype.
# $1 = long | short:
#   long:  64 requests x (8192 in + 1024 out): the bf16 pool (374,835 tokens at the default
#          --mem-fraction-static on an 80 GB card) cannot hold them all, the fp8 one can;
#   short: 64 requests x (2048 in + 512 out): both pools hold everything (the step's gain alone);
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader

if [ "$1" = long ]; then
  args="--input-len 8192 --output-len 1024"
else
  args="--input-len 2048 --output-len 512"
fi
for dt in auto fp8_e4m3; do
  mkdir -p "$OUT/$1-$dt"
  timeout 300 python3 -m attnserve.bench.offline --device cuda --load-format dummy --models llama-3-8b \
    --requests 64 $args --kv-cache-dtypes $dt --overlap on --warmup-output-len 8 \
    --out "$OUT/$1-$dt" 2>&1 | grep -v -i "warn\|KV pool exhausted" | tail -8
done
