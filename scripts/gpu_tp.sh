#!/usr/bin/env bash
# Tensor and data parallelism on a machine of 2 or 4 GPUs (nvidia-h100-x2 / -x4): the TP,
# custom all-reduce and DP GPU tests, the all-reduce latency table (sets the thresholds for
# this world size), the tp decode benchmark (Llama-3-8B at tp 1 / 2 [/ 4] with batch 1 and 64,
# shared-memory and gloo step broadcast; Llama-3-70B at tp 4), then bench.offline's random
# workload at dp 1 and dp = number of GPUs. Partial JSON survives a cut-off run.
#   bash scripts/gpu_tp.sh          env: TP_LIMIT (s, default 300), DP_PROMPTS (default 1024)
#   STAGES="tests pushtests twoshottests allreduce tp big push bigpush overlap carveout dp" (default all) runs a subset: one
#   device call is 10 minutes at most, so on 4 GPUs run "tests" (~5 min on four H100s), "pushtests",
#   "twoshottests", "tp" (~5 min), "allreduce big", "push", "bigpush" and "dp" as separate calls.
#   pushtests: the push-mode fused all-reduce GPU tests (2 and 4 ranks, tp 2 engine tokens), which
#   "tests" leaves out (-k "not push"). twoshottests: the two-shot fused all-reduce GPU tests
#   (tests/gpu/test_fused_all_reduce_two_shot_gpu.py, 2 and 4 ranks, tp 2 engine tokens).
#   allreduce: also the fused all-reduce + add + RMSNorm, pull vs push vs two-shot kernel, us per call
#   (benchmarks/fused_allreduce_bench.py); push: Llama-3-8B at tp = all GPUs, batch 1 and 64, fused
#   with the pull and the push kernel (ATTNSERVE_ALLREDUCE_FUSION_MODE) in one run; bigpush: the
#   Llama-3-70B shape at tp 4, pull and push. PUSH_TP (tp sizes, default all GPUs), PUSH_MODES /
#   BIGPUSH_MODES (default "pull push"; "pull twoshot" for the two-shot kernel, which takes the fused
#   messages of at least ATTNSERVE_TWO_SHOT_FUSED_MIN_KB, default 256, from 3 GPUs) and PUSH_ARGS
#   (e.g. --profile) narrow or widen those two.
#   overlap: the tp prefill all-reduce overlap on / off / off with a 64 MiB two-shot ceiling (medians of 3),
#   then its float32 GPU token test (~4 min on four GPUs). carveout: the overlap with CARVEOUT_SMS (32) SMs
#   left to NCCL against no overlap, CARVEOUT_ROUNDS (3) alternating rounds (~5 min on four GPUs).
#   tp: Llama-3-8B tp 1 / 2 / 4, batch 1 and 64, all-reduce fusion on and off, rank 0's kernel
#   profile (TP_REPEATS timed runs per row, default 1); big: the Llama-3-70B shape at tp 4.
# Every tp engine measures its two-shot all-reduce ceiling at start-up (all_reduce_calibration; the
# tp rows record the times and the ceiling; ATTNSERVE_ALLREDUCE_CALIBRATE=0 keeps the table's default).
# The dp test and replicas import the server (fastapi): run with carry [".whl/serving"].
set -u
STAGES=${STAGES:-tests pushtests twoshottests allreduce tp big push bigpush overlap carveout dp}
stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-serving .whl/serving/*.whl \
  > "$OUT/pip.log" 2>&1 || echo "no .whl/serving: the dp test will fail to import fastapi"
export PYTHONPATH=/tmp/site-serving:src:tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi -L > "$OUT/gpus.txt" 2>&1
if stage tests; then
timeout "${TESTS_LIMIT:-360}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py tests/gpu/test_custom_all_reduce_gpu.py \
  tests/gpu/test_data_parallel_gpu.py -k "not push" > "$OUT/tests_parallel.log" 2>&1
tail -3 "$OUT/tests_parallel.log"
fi
if stage pushtests; then
timeout "${PUSHTESTS_LIMIT:-540}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_custom_all_reduce_gpu.py \
  -k push > "$OUT/tests_push.log" 2>&1
echo "push tests rc=$?"
grep -E "^PUSH|passed|failed|error" "$OUT/tests_push.log" | tail -14
fi
if stage twoshottests; then
timeout "${TWOSHOTTESTS_LIMIT:-540}" python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_fused_all_reduce_two_shot_gpu.py -k twoshot > "$OUT/tests_twoshot.log" 2>&1
echo "twoshot tests rc=$?"
grep -E "^TWOSHOT|passed|failed|error" "$OUT/tests_twoshot.log" | tail -14
fi
if stage allreduce; then
timeout 120 python3 benchmarks/allreduce_bench.py --world-size "$ngpu" --out "$OUT" > "$OUT/allreduce.log" 2>&1
tail -14 "$OUT/allreduce.log"
timeout "${FUSED_LIMIT:-300}" python3 benchmarks/fused_allreduce_bench.py --world-size "$ngpu" --out "$OUT" \
  > "$OUT/fused_allreduce.log" 2>&1
echo "fused_allreduce rc=$?"
tail -14 "$OUT/fused_allreduce.log"
fi
tps="1 2"; big=""
if [ "$ngpu" -ge 4 ]; then tps="1 2 4"; big="--big-tp 4"; fi
if stage tp; then
# shellcheck disable=SC2086
timeout "${TP_LIMIT:-300}" python3 benchmarks/tp_decode.py --tp $tps --requests 1 64 --step-broadcast shm \
  --allreduce-fusion on off --profile --repeats "${TP_REPEATS:-1}" --skip-identity --out "$OUT" > "$OUT/tp_decode.log" 2>&1
echo "tp_decode rc=$?"
grep -E "ms/step|profile:" "$OUT/tp_decode.log" | tail -30
fi
if stage big && [ -n "$big" ]; then
# the Llama-3-70B shape at tp 4 (one engine in its own process; ~2 minutes on four H100s)
timeout "${BIG_LIMIT:-240}" python3 benchmarks/tp_decode.py --tp 4 --requests 1 $big --skip-identity \
  --step-broadcast shm --out "$OUT/big" > "$OUT/tp_big.log" 2>&1
echo "tp big rc=$?"
grep -E "ms/step" "$OUT/tp_big.log" | tail -4
fi
if stage push; then
# Llama-3-8B at tp = all GPUs: fused with the pull kernel, then with the push kernel
# shellcheck disable=SC2086
timeout "${PUSH_LIMIT:-360}" python3 benchmarks/tp_decode.py --tp ${PUSH_TP:-$ngpu} --requests 1 64 --step-broadcast shm \
  --allreduce-fusion on --allreduce-fusion-mode ${PUSH_MODES:-pull push} ${PUSH_ARGS:-} --skip-identity --out "$OUT/push" \
  > "$OUT/tp_push.log" 2>&1
echo "tp push rc=$?"
grep -E "ms/step" "$OUT/tp_push.log" | tail -4
fi
if stage bigpush && [ -n "$big" ]; then
# the Llama-3-70B shape at tp 4, pull then push kernel (two engines, ~2 minutes each)
# shellcheck disable=SC2086
timeout "${BIGPUSH_LIMIT:-540}" python3 benchmarks/tp_decode.py --tp --requests 1 $big --skip-identity \
  --step-broadcast shm --allreduce-fusion on --allreduce-fusion-mode ${BIGPUSH_MODES:-pull push} --out "$OUT/bigpush" \
  > "$OUT/tp_bigpush.log" 2>&1
echo "tp bigpush rc=$?"
grep -E "ms/step" "$OUT/tp_bigpush.log" | tail -4
fi
if stage overlap; then
# the prefill all-reduces of Llama-3-8B at tp = all GPUs, 64 x 512: overlapped token halves (opt-in,
# ATTNSERVE_TP_PREFILL_OVERLAP=1), one NCCL all-reduce per message (the default), and the symmetric-memory two-shot up to 64 MiB instead
# of NCCL (8,192-token chunks on 80 GB cards); then the float32 token check of the overlap
for cfg in "on:1:" "off:0:" "twoshot64:0:64"; do
  IFS=: read -r tag ov ts <<< "$cfg"
  ATTNSERVE_TP_PREFILL_OVERLAP=$ov ATTNSERVE_TWO_SHOT_MAX_MB=$ts timeout "${OVERLAP_LIMIT:-150}" python3 \
    benchmarks/tp_decode.py --tp "$ngpu" --requests 64 --repeats 3 --step-broadcast shm --skip-identity \
    --out "$OUT/overlap-$tag" > "$OUT/tp_overlap_$tag.log" 2>&1
  echo "overlap $tag rc=$? $(grep -E "ms/step" "$OUT/tp_overlap_$tag.log" | tail -1)"
  python3 -c "import glob, json; r = json.load(open(glob.glob('$OUT/overlap-$tag/*.json')[0]))['decode'][0]; \
print('  prefill_s', round(r['prefill_s'], 4), r['prefill_runs_s'])" 2>/dev/null
done
timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_gpu.py -k prefill_overlap \
  > "$OUT/tests_overlap.log" 2>&1
echo "overlap test rc=$?"; grep -E "^OVERLAP|passed|failed" "$OUT/tests_overlap.log" | tail -3
fi
if stage carveout; then
# the tp prefill overlap with 32 SMs left to NCCL (cuBLASLt) against no overlap, Llama-3-8B at tp = all GPUs,
# 64 x 512: three rounds of A B in fresh processes (~5 minutes on four GPUs), medians per variant
timeout "${CARVEOUT_LIMIT:-540}" python3 benchmarks/tp_decode.py --tp "$ngpu" --requests 64 --repeats 2 \
  --step-broadcast shm --skip-identity --variant-rounds "${CARVEOUT_ROUNDS:-3}" \
  --env-variants ATTNSERVE_TP_PREFILL_OVERLAP=0 \
  "ATTNSERVE_TP_PREFILL_OVERLAP=1,ATTNSERVE_TP_OVERLAP_SM_CARVEOUT=${CARVEOUT_SMS:-32}" \
  --out "$OUT/carveout" > "$OUT/tp_carveout.log" 2>&1
echo "carveout rc=$?"; grep -E "^summary" "$OUT/tp_carveout.log"
fi
if stage dp; then
timeout 540 python3 -m attnserve.bench.offline --dataset random --load-format dummy --device cuda \
  --models llama-3-8b --num-prompts "${DP_PROMPTS:-1024}" --random-input-len 1024 --random-output-len 1024 \
  --random-range-ratio 0.098 --dp-size 1 "$ngpu" --tag dp --out "$OUT" > "$OUT/offline_dp.log" 2>&1
echo "offline dp rc=$?"
grep -v INFO "$OUT/offline_dp.log" | tail -6
fi
