#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine (nvidia-h100-x2): the clean-shutdown test (graphs
# released before the NCCL groups), then the tp 1 / 2 benchmark (identity + decode step,
# now with the rank-0 step-broadcast time per step). Partial JSON survives a cut-off run.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py > "$OUT/test_tp_gpu.log" 2>&1
tail -3 "$OUT/test_tp_gpu.log"
timeout "${TP_LIMIT:-300}" python3 benchmarks/tp_decode.py --tp 1 2 --requests 1 64 --out "$OUT" \
  > "$OUT/tp_decode.log" 2>&1
echo "tp_decode rc=$?"
grep -v INFO "$OUT/tp_decode.log" | tail -30
