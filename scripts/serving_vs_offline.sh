#!/bin/bash
# Server path vs the offline engine on one workload (issue 33 item 5).
#
#   scripts/serving_vs_offline.sh OUT_DIR SHAPE [MODE ...] [-- extra server flags]
#
# SHAPE is a dummy model shape (qwen3-0.6b, llama-3-8b); MODE is an --engine-process value
# (default: on off). The first mode's run also runs the offline baseline (LLM.generate with the
# same flags, in a process of its own); each run writes OUT_DIR/<shape>-<mode>.json
# (bench.serving's record: offline and server output tok/s, their ratio, failures, host CPU).
# Workload: 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0), token-id
# prompts sent all at once, half of them streamed; 64 warm-up requests from the same length
# range (16 output tokens each) first, for the offline engine and the server alike.
set -euo pipefail
out=$1; shape=$2; shift 2
modes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do modes+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#modes[@]} -eq 0 ] && modes=(on off)
mkdir -p "$out"
first=1
for mode in "${modes[@]}"; do
  extra=()
  [ $first -eq 1 ] && extra=(--offline-baseline)
  first=0
  python3 -m attnserve.bench.serving --launch "${extra[@]}" --num-prompts 256 --input-len 100 1024 \
    --output-len 100 1024 --token-range 1000 30000 --stream-fraction 0.5 --seed 0 --warmup 64 \
    --warmup-like-workload --warmup-output-len 16 --output-file "$out/$shape-$mode.json" \
    --model "$shape" --load-format dummy --device cuda --max-running-requests 256 --cuda-graph-max-bs 256 \
    --engine-process "$mode" "$@" || echo "run $shape $mode failed: $?"
done
