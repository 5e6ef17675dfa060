#!/usr/bin/env bash
# Constrained decoding (issue 35, item 1) on the lent GPU; logs and JSON under $OUT.
# The device has no xgrammar / pydantic / jsonschema: their Python 3.12 wheels, and SmolLM2's
# tokenizer saved as tokenizer.json, travel in the ignored folder .whl/grammar: run with
# carry [".whl/grammar"] (copy it from a worktree with: cp -r <worktree>/.whl/grammar .whl/).
#   bash scripts/gpu_grammar.sh [test] [bench]     (default: both, ~4-6 min on an H100)
#   env: BENCH_TIMEOUT (s, default 330), GRAMMAR_MODELS (default "llama-3-8b qwen3-0.6b")
#   test   tests/gpu/test_constrained_gpu.py (+ the CPU grammar tests on the device's stack)
#   bench  benchmarks/grammar_decode.py -> $OUT/<device>-grammar-<date>.json
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/grammar/*.whl > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:src:tests:benchmarks PYTHONUNBUFFERED=1
python3 -c 'import torch, triton, xgrammar, jsonschema; print("torch", torch.__version__, "triton", triton.__version__,
"cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
start=$(date +%s)
for mode in "${@:-test bench}"; do
  for m in $mode; do
    echo "=== $m at $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
    case $m in
      test) timeout 220 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_constrained_gpu.py \
              tests/unit/test_constrained.py 2>&1 | tee "$OUT/grammar_tests.log" | tail -25 ;;
      # shellcheck disable=SC2086
      bench) timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/grammar_decode.py --out "$OUT" \
               --models ${GRAMMAR_MODELS:-llama-3-8b qwen3-0.6b} 2>&1 | tee "$OUT/grammar_bench.log" \
               | grep -v "^Loading" | tail -12 ;;
      *) echo "unknown mode $m (test bench)"; exit 2 ;;
    esac
  done
done
echo "=== done at $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
