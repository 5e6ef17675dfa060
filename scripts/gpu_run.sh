#!/usr/bin/env bash
# One batched GPU session on the lent H100/H200 (see /work/.library/device):
#   scripts/gpu_run.sh tests|kernels|decode|offline|spec|fp8|all   — writes logs and JSON under $OUT.
# Run from the repository root with the device's own torch/triton (no install).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
what=${1:-all}
shift || true
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
if [[ $what == tests || $what == all ]]; then
  targets=${*:-tests/gpu tests/unit/test_triton_backend.py}
  # shellcheck disable=SC2086
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q --timeout 300 -p no:cacheprovider $targets 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [[ $what == kernels || $what == all ]]; then
  timeout 400 python3 benchmarks/kernels.py --out "$OUT" --mla 2>&1 | tee "$OUT/kernels.log" | tail -60
fi
if [[ $what == decode || $what == all ]]; then
  timeout 500 python3 benchmarks/decode.py --out "$OUT" 2>&1 | tee "$OUT/decode.log" | tail -40
fi
if [[ $what == offline || $what == all ]]; then
  timeout ${OFFLINE_TIMEOUT:-500} python3 -m attnserve.bench.offline --device cuda --load-format dummy --out "$OUT" ${OFFLINE_ARGS:-} 2>&1 | tee "$OUT/offline.log" | tail -40
fi
if [[ $what == spec || $what == all ]]; then
  timeout ${SPEC_TIMEOUT:-500} python3 benchmarks/speculative_gpu.py --out "$OUT" ${SPEC_ARGS:-} 2>&1 | tee "$OUT/spec.log" | tail -40
fi
if [[ $what == fp8 || $what == all ]]; then
  timeout ${FP8_TIMEOUT:-400} python3 benchmarks/fp8_kv.py --out "$OUT" ${FP8_ARGS:-} 2>&1 | tee "$OUT/fp8.log" | tail -20
fi
