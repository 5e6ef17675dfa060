#!/usr/bin/env bash
# Kernel benchmarks on the lent GPU (logs and JSON under $OUT), each a mode:
#   kernels  benchmarks/kernels.py --mla (decode/extend/MLA against PyTorch peers and the ceilings)
#   decode   benchmarks/decode.py
#   ragged   benchmarks/decode_ragged.py (ragged batches against SGLang's Triton decode; needs the
#            sglang wheel carried in .whl/sglang)
#   batch    benchmarks/decode_batch_sweep.py (stage-1 tiles / residency / split waves at 64-256
#            requests of ~800 keys, against the copy rate; BATCH_ARGS e.g. --quick)
#   fp8      benchmarks/fp8_bench.py (FP8 linears against bf16: GEMMs, producers, engine rows; FP8_ARGS)
#   routes   benchmarks/fp8_routes.py (each FP8 projection route timed behind its producer, PDL forms
#            of the FP8 mid GEMM; ROUTES_ARGS e.g. --ms 64)
#   tiles    benchmarks/decode_fp8_variants.py (the opt-in double-buffered stage-1 tiles, fp8 and bf16
#            caches, against their defaults; TILES_ARGS e.g. --quick) and their GPU test
#   gather   benchmarks/kv_gather_granularity.py (gathered 128 B vs 256 B KV rows against the copy rate:
#            is the fp8-KV decode gap a DRAM granularity limit?)
#   layout   benchmarks/gemm_weight_layout.py (decode-size bf16 GEMMs with the weight [N, K] as today,
#            stored [K, N], or as the GEMM's M operand: does cuBLAS pick a faster kernel?)
#   heads    head sizes other than 128: decode stage-1 tiles at Phi-3-mini's 96 over an e4m3 cache
#            (decode_batch_sweep.py --head-shapes --kv-dtype fp8_e4m3) and extend tiles at 256 with Gemma's
#            cap and window (extend_long_sweep.py --shape gemma-2-9b / gemma3-270m)
#   bash scripts/gpu_kernel_bench.sh kernels [decode ragged batch fp8 routes tiles gather layout heads]
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
    batch) timeout "${BATCH_TIMEOUT:-400}" python3 benchmarks/decode_batch_sweep.py --out "$OUT" ${BATCH_ARGS:-} 2>&1 \
      | tee "$OUT/batch.log" | grep -v "^wrote" | tail -20 ;;
    fp8) timeout "${FP8_TIMEOUT:-500}" python3 benchmarks/fp8_bench.py --out "$OUT/fp8-bench.json" ${FP8_ARGS:-} 2>&1 \
      | tee "$OUT/fp8.log" | tail -60 ;;
    routes) timeout "${ROUTES_TIMEOUT:-300}" python3 benchmarks/fp8_routes.py --out "$OUT/fp8-routes.json" \
      ${ROUTES_ARGS:-} 2>&1 | tee "$OUT/routes.log" | tail -80 ;;
    tiles) timeout "${TILES_TIMEOUT:-200}" python3 benchmarks/decode_fp8_variants.py --out "$OUT" ${TILES_ARGS:-} 2>&1 \
      | tee "$OUT/tiles.log" | tail -40
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_fp8_tiles_gpu.py 2>&1 | tail -3 ;;
    heads) timeout "${HEADS_TIMEOUT:-200}" python3 benchmarks/decode_batch_sweep.py --head-shapes \
      --kv-dtype fp8_e4m3 --out "$OUT" 2>&1 | tee "$OUT/heads-decode-fp8.log" | grep phi-3
      for shape in gemma-2-9b gemma3-270m; do
        timeout "${HEADS_TIMEOUT:-200}" python3 benchmarks/extend_long_sweep.py --shape "$shape" --out "$OUT" 2>&1 \
          | tee "$OUT/heads-extend-$shape.log" | tail -12
      done ;;
    gather) timeout 200 python3 benchmarks/kv_gather_granularity.py --out "$OUT" 2>&1 | tee "$OUT/gather.log" | tail -8 ;;
    layout) timeout 200 python3 benchmarks/gemm_weight_layout.py --out "$OUT/gemm-weight-layout.json" 2>&1 \
      | tee "$OUT/layout.log" | tail -45 ;;
    *) echo "unknown mode $what (kernels decode ragged batch fp8 routes tiles gather layout)"; exit 2 ;;
  esac
done
