#!/usr/bin/env bash
# Kernel benchmarks on the lent GPU (logs and JSON under $OUT), each a mode:
#   kernels  benchmarks/kernels.py --mla (decode/extend/MLA against PyTorch peers and the ceilings)
#   decode   benchmarks/decode.py
#   ragged   benchmarks/decode_ragged.py (ragged batches against SGLang's Triton decode; needs the
#            sglang wheel carried in .whl/sglang)
#   bash scripts/gpu_kernel_bench.sh kernels [decode ragged]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
for what in "${@:-kernels}"; do
  case $what in
    kernels) timeout 400 python3 benchmarks/kernels.py --out "$OUT" --mla 2>&1 | tee "$OUT/kernels.log" | tail -60 ;;
    decode) timeout 500 python3 benchmarks/decode.py --out "$OUT" 2>&1 | tee "$OUT/decode.log" | tail -40 ;;
    ragged) timeout 400 python3 benchmarks/decode_ragged.py --out "$OUT" 2>&1 | tee "$OUT/ragged.log" | tail -40 ;;
    *) echo "unknown mode $what (kernels decode ragged)"; exit 2 ;;
  esac
done
