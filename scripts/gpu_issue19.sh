#!/usr/bin/env bash
# Issue 19 GPU session: kernel timings of the tree before (.old/src, carried) and after,
# GPU tests of the changed code, optionally the offline engine loop. Logs and JSON in $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
if [[ -d .old/src ]]; then
  PYTHONPATH=.old/src timeout 120 python3 benchmarks/kernel_timings.py --label before --out "$OUT" 2>&1 | tail -8
fi
PYTHONPATH=src timeout 120 python3 benchmarks/kernel_timings.py --label after --out "$OUT" 2>&1 | tail -8
if [[ -d .old/src ]]; then
  PYTHONPATH=.old/src timeout 120 python3 benchmarks/kernel_timings.py --label before2 --out "$OUT" 2>&1 | tail -8
fi
PYTHONPATH=src:tests timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q --timeout 200 -p no:cacheprovider ${TESTS:-tests/gpu/test_deepseek_gpu.py tests/gpu/test_mla_decode_gpu.py tests/gpu/test_gemma3_gpu.py tests/unit/test_triton_backend.py tests/unit/test_mla_backends.py tests/unit/test_backend_contract.py} 2>&1 | tee "$OUT/tests.log" | tail -25
if [[ -n "${OFFLINE:-}" ]]; then
  PYTHONPATH=src timeout 200 python3 -m attnserve.bench.offline --device cuda --load-format dummy --out "$OUT" ${OFFLINE_ARGS:-} 2>&1 | tee "$OUT/offline.log" | tail -20
fi
