#!/usr/bin/env bash
# Fused MoE (issue 34) on the lent GPU, each a mode (logs and JSON under $OUT):
#   precompile  compile every tuning candidate in 12 processes (into Triton's disk cache)
#   test        tests/gpu/test_fused_moe_gpu.py
#   pretest     precompile in the background while test runs (the default's first step)
#   tune        benchmarks/moe_tune.py -> $OUT/moe_tune.json (tables also in $MOE_CONFIG_DIR)
#   bench       benchmarks/moe_layer.py with those tables -> $OUT/moe_layer.json
#   repeat      the same with other weights and routings (--seed 2) -> $OUT/moe_layer_repeat.json
#   bash scripts/gpu_moe.sh [modes...]      (default: pretest tune bench repeat, at most ~280 s)
# Unpack the tuned tables here afterwards with
#   python benchmarks/moe_tune.py --unpack moe_tune.json --config-dir src/attnserve/models/layers/moe/configs
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests:benchmarks PYTHONUNBUFFERED=1
export MOE_CONFIG_DIR=${MOE_CONFIG_DIR:-/tmp/moe_configs}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
start=$(date +%s)
precompile() {
  timeout 60 python3 benchmarks/moe_tune.py --precompile-only --precompile-workers 12 > "$OUT/moe_precompile.log" 2>&1
  tail -3 "$OUT/moe_precompile.log"
}
run_tests() {
  timeout 70 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_moe_gpu.py 2>&1 \
    | tee "$OUT/moe_tests.log" | tail -25
}
for what in "${@:-pretest tune bench repeat}"; do
  for mode in $what; do
    echo "=== $mode at $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
    case $mode in
      precompile) precompile ;;
      test) run_tests ;;
      pretest) precompile & pid=$!; run_tests; wait $pid ;;
      tune) timeout 115 python3 benchmarks/moe_tune.py --output "$OUT/moe_tune.json" --config-dir "$MOE_CONFIG_DIR" \
              --budget-s 100 2>&1 | tee "$OUT/moe_tune.log" | grep -v "^  " | tail -5 ;;
      bench) ATTNSERVE_MOE_CONFIG_DIR=$MOE_CONFIG_DIR timeout 45 python3 benchmarks/moe_layer.py \
               --output "$OUT/moe_layer.json" --budget-s 35 2>&1 | tee "$OUT/moe_layer.log" | tail -45 ;;
      repeat) ATTNSERVE_MOE_CONFIG_DIR=$MOE_CONFIG_DIR timeout 45 python3 benchmarks/moe_layer.py --seed 2 \
               --output "$OUT/moe_layer_repeat.json" --budget-s 35 2>&1 | tee -a "$OUT/moe_layer.log" | tail -6 ;;
      *) echo "unknown mode $mode (precompile test pretest tune bench repeat)"; exit 2 ;;
    esac
  done
done
echo "=== done at $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
