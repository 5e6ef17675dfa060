#!/usr/bin/env bash
# GPU test runner (the lent H100/H200, see /work/.library/device): `pytest -m cuda`-style run
# of tests/gpu plus the Triton backend unit tests on the device's own torch/triton.
#   bash scripts/gpu_tests.sh [pytest targets...]     (logs under $OUT)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
targets=${*:-tests/gpu tests/unit/test_triton_backend.py}
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q --timeout 300 -p no:cacheprovider $targets 2>&1 \
  | tee "$OUT/tests.log" | tail -40
