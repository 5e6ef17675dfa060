#!/usr/bin/env bash
# Data parallelism on a 2-GPU machine (nvidia-h100-x2): the dp 2 test (replica i on GPU i,
# a killed replica leaves the other serving and no process behind), then bench.offline's
# random workload (Llama-3-8B shape, dummy weights) at dp 1 and dp 2 in one run (rows per
# dp size, speedup_vs_dp1 on the dp 2 row). DP_PROMPTS / DP_LIMIT shrink or stretch it.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_data_parallel_gpu.py > "$OUT/test_dp_gpu.log" 2>&1
tail -3 "$OUT/test_dp_gpu.log"
timeout "${DP_LIMIT:-540}" python3 -m attnserve.bench.offline --dataset random --load-format dummy --device cuda \
  --models llama-3-8b --num-prompts "${DP_PROMPTS:-1024}" --random-input-len 1024 --random-output-len 1024 \
  --random-range-ratio 0.098 --dp-size 1 2 --tag dp --out "$OUT" > "$OUT/offline_dp.log" 2>&1
echo "offline dp rc=$?"
grep -v INFO "$OUT/offline_dp.log" | tail -12
