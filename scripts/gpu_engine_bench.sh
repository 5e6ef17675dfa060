#!/usr/bin/env bash
# Engine benchmarks on the lent GPU, each a mode (several may be given; logs and JSON under $OUT):
#   roofline  bench.offline --dataset random: the mixed 256-request workload ([100, 1024] in and out)
#             and the fixed 64 x 512 -> 256 and 1 x 512 -> 256 rows, Llama-3-8B and Qwen3-0.6B shapes,
#             default flags, bf16 and fp8 KV: output tok/s against the roofline measured in the same run
#   loop      bench.offline --load-format dummy (the engine-loop rows: graph step, host ms per step)
#   spec      benchmarks/speculative_gpu.py
#   fp8       benchmarks/fp8_kv.py
#   profile   benchmarks/profile_host.py (cProfile of the host at 256 running requests, Qwen3-0.6B shape)
#   step      benchmarks/profile_step.py: kernels of one decode step at a mixed workload's mean batch
#             (STEP_MODELS, STEP_BATCH 144, STEP_CONTEXT 800, STEP_ARGS e.g. --kv-cache-dtype fp8_e4m3)
#   prefill   benchmarks/profile_prefill.py: kernels of a prefill pass (PREFILL_ARGS, e.g. --model
#             llama-3-8b --num-prompts 8 --quantization fp8)
#   longprompt bench.offline --dataset random, 256 prompts [1024, 4096] in, [64, 256] out (LONG_MODELS,
#             LONG_KV, LONG_ARGS): the prefill-heavy second shape of issue 33
#   moe       bench.offline --dataset random, the mixed 256-request workload on the MoE shapes
#             (deepseek-v2-lite, qwen3-30b-a3b; MOE_MODELS, MOE_ARGS e.g. --tp-size 2 for mixtral-8x7b)
#   serving   scripts/serving_vs_offline.sh: the server path against the offline engine, both shapes
#             (needs the server wheels carried in .whl/serving: bash scripts/serving_wheels.sh)
#   gaps      benchmarks/profile_engine_gaps.py: GPU busy / idle and kernel classes over a window of
#             the engine loop on the mixed 256-request workload (GAPS_MODELS, GAPS_ARGS e.g.
#             --kv-cache-dtype fp8_e4m3), and its GPU test
#   mla       DeepSeek-V2-Lite (MLA + MoE): the mixed 256-request workload once per MLA_TILES entry
#             ("default" or block_h,block_n,num_warps,num_stages for ATTNSERVE_MLA_DECODE_TILE), then
#             the engine-window profile of its decode steps (profile_engine_gaps.py)
#   fp8accum  FP8 weights with and without Hopper's fast accumulation (issue 37; on by default,
#             ATTNSERVE_FP8_FAST_ACCUM=0 off): the FP8 GPU tests (linears, mid route, mid GEMM, fused MoE),
#             then fp8_bench.py's engine rows bf16 / fp8 / fp8-exact-accum in one process (FP8ACCUM_VARIANTS)
#   sampling  benchmarks/sampling_extras_gpu.py: decode step with logprobs (top 5) / penalties / logit
#             bias + min_tokens on all 64 requests vs none, Llama-3-8B shape (issue 35; SAMPLING_ARGS)
#   bash scripts/gpu_engine_bench.sh roofline [loop spec fp8]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
offline="python3 -m attnserve.bench.offline --dataset random --load-format dummy --out $OUT"
for what in "${@:-roofline}"; do
  case $what in
    roofline)
      timeout "${ROOFLINE_TIMEOUT:-420}" $offline --tag mixed --models ${ROOFLINE_MODELS:-llama-3-8b qwen3-0.6b} \
        --kv-cache-dtypes ${ROOFLINE_KV:-auto fp8_e4m3} --num-prompts 256 --random-input-len 1024 \
        --random-output-len 1024 --random-range-ratio 0.098 ${ROOFLINE_ARGS:-} 2>&1 | grep -v INFO | tee "$OUT/roofline_mixed.log"
      timeout 200 $offline --tag fixed64 --models llama-3-8b --num-prompts 64 --random-input-len 512 \
        --random-output-len 256 --random-range-ratio 1 2>&1 | grep -v INFO | tee "$OUT/roofline_fixed64.log"
      timeout 200 $offline --tag fixed1 --models llama-3-8b --num-prompts 1 --random-input-len 512 \
        --random-output-len 256 --random-range-ratio 1 2>&1 | grep -v INFO | tee "$OUT/roofline_fixed1.log" ;;
    longprompt)
      # issue 33's "second shape": 256 prompts of [1024, 4096] tokens -> [64, 256] (prefill-heavy)
      timeout "${LONG_TIMEOUT:-300}" $offline --tag longprompt --models ${LONG_MODELS:-llama-3-8b} \
        --kv-cache-dtypes ${LONG_KV:-auto} --num-prompts 256 --random-input-len 4096 --random-output-len 256 \
        --random-range-ratio 0.25 ${LONG_ARGS:-} 2>&1 | grep -v INFO | tee "$OUT/roofline_longprompt.log" ;;
    moe)
      timeout "${MOE_TIMEOUT:-420}" $offline --tag moe-mixed --models ${MOE_MODELS:-deepseek-v2-lite qwen3-30b-a3b} \
        --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.098 \
        ${MOE_ARGS:-} 2>&1 | grep -v INFO | tee "$OUT/roofline_moe.log" ;;
    loop)
      timeout "${LOOP_TIMEOUT:-500}" python3 -m attnserve.bench.offline --device cuda --load-format dummy --out "$OUT" \
        ${LOOP_ARGS:-} 2>&1 | tee "$OUT/offline.log" | tail -40 ;;
    spec)
      timeout "${SPEC_TIMEOUT:-500}" python3 benchmarks/speculative_gpu.py --out "$OUT" ${SPEC_ARGS:-} 2>&1 \
        | tee "$OUT/spec.log" | tail -40 ;;
    fp8)
      timeout "${FP8_TIMEOUT:-400}" python3 benchmarks/fp8_kv.py --out "$OUT" ${FP8_ARGS:-} 2>&1 \
        | tee "$OUT/fp8.log" | tail -20 ;;
    profile)
      timeout "${PROFILE_TIMEOUT:-300}" python3 benchmarks/profile_host.py --out "$OUT" ${PROFILE_ARGS:-} 2>&1 \
        | grep -v INFO | tail -20 ;;
    step)
      timeout "${STEP_TIMEOUT:-240}" python3 benchmarks/profile_step.py --out "$OUT" --models ${STEP_MODELS:-llama-3-8b qwen3-0.6b} \
        --batch ${STEP_BATCH:-144} --context ${STEP_CONTEXT:-800} ${STEP_ARGS:-} 2>&1 | grep -v INFO | tee -a "$OUT/step.log" | tail -60 ;;
    prefill)
      timeout "${PREFILL_TIMEOUT:-240}" python3 benchmarks/profile_prefill.py --out "$OUT" ${PREFILL_ARGS:-} 2>&1 \
        | grep -v INFO | tee -a "$OUT/prefill.log" | tail -45 ;;
    serving)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serving .whl/serving/*.whl \
        > "$OUT/pip.log" 2>&1 || echo "no .whl/serving (carry it): the server cannot import fastapi"
      export PYTHONPATH=/tmp/site-serving:src:tests
      # what `pip install attnserve[server,bench]` gives a user: without uvloop / httptools the HTTP
      # process runs ~2x the CPU a request (NOTES, 2026-11-27) and the ratio measures the wheels
      python3 -c "import uvloop, httptools, aiohttp, prometheus_client" 2>>"$OUT/pip.log" \
        || { echo "serving: uvloop / httptools / aiohttp / prometheus_client missing from .whl/serving; see pip.log"; exit 3; }
      for shape in ${SERVING_SHAPES:-qwen3-0.6b llama-3-8b}; do
        timeout "${SERVING_TIMEOUT:-280}" bash scripts/serving_vs_offline.sh "$OUT" "$shape" ${SERVING_MODES:-on}
      done ;;
    fp8accum)
      timeout "${FP8ACCUM_TEST_TIMEOUT:-420}" python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_fp8_linear_gpu.py \
        tests/gpu/test_fp8_mid_route_gpu.py tests/gpu/test_fp8_mid_gemm_gpu.py tests/gpu/test_fused_moe_fp8_gpu.py 2>&1 | tee "$OUT/fp8accum_tests.log" | tail -8
      timeout "${FP8ACCUM_TIMEOUT:-300}" python3 benchmarks/fp8_bench.py --parts engine \
        --variants ${FP8ACCUM_VARIANTS:-bf16,fp8,fp8-exact-accum} --out "$OUT/fp8_bench_engine_fast_accum.json" 2>&1 \
        | grep -v INFO | tail -2 ;;
    sampling)
      timeout "${SAMPLING_TIMEOUT:-500}" python3 benchmarks/sampling_extras_gpu.py --out "$OUT" ${SAMPLING_ARGS:-} 2>&1 \
        | grep -v INFO | tee "$OUT/sampling.log" | tail -20 ;;
    gaps)
      timeout "${GAPS_TIMEOUT:-300}" python3 benchmarks/profile_engine_gaps.py --models ${GAPS_MODELS:-llama-3-8b} \
        --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.098 \
        --decode-window 400 40 --prefill-window 0 10 --no-baseline --out "$OUT" ${GAPS_ARGS:-} 2>&1 \
        | grep -v INFO | tee -a "$OUT/gaps.log" | tail -45
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gaps_gpu.py 2>&1 | tail -3 ;;
    mla)
      for tile in ${MLA_TILES:-default 16,32,4,5}; do
        t=$tile; [ "$tile" = default ] && t=""
        ATTNSERVE_MLA_DECODE_TILE=$t timeout "${MLA_TIMEOUT:-150}" $offline --tag "mixed-mla-tile-${tile//,/-}" \
          --models deepseek-v2-lite --num-prompts 256 --random-input-len 1024 --random-output-len 1024 \
          --random-range-ratio 0.098 2>&1 | grep -v INFO | grep share | sed "s/^/[$tile] /"
      done
      timeout "${GAPS_TIMEOUT:-300}" python3 benchmarks/profile_engine_gaps.py --models deepseek-v2-lite \
        --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.098 \
        --decode-window 400 40 --prefill-window 0 5 --no-baseline --out "$OUT" 2>&1 | grep -v INFO | tail -40 ;;
    *) echo "unknown mode $what (roofline longprompt step prefill moe mla fp8accum loop spec fp8 profile serving sampling gaps)"; exit 2 ;;
  esac
done
