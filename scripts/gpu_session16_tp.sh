#!/usr/bin/env bash
# Session 16: the first multi-GPU run of tensor parallelism (nvidia-h100-x2, issue 22's
# GPU checks): Llama-3-8B-shape greedy identity tp 2 vs tp 1 (float32), decode step at
# 1 and 64 requests with CUDA graphs at tp 1 and 2. Partial JSON survives a cut-off run.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
timeout "${TP_LIMIT:-200}" python3 benchmarks/tp_decode.py --tp 1 2 --requests 1 64 --out "$OUT" \
  > "$OUT/tp_decode.log" 2>&1
echo "rc=$?"
tail -40 "$OUT/tp_decode.log"
