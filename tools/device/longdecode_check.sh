#!/usr/bin/env bash
# Decode attention at long contexts (issue 17's fourth target: >= 55 % of the floor at 32K) in one
# device-machine call: build, the attention kernel GPU tests (the multi-chunk layout against one chunk
# per block and the multi-row kernel bit for bit; every other attention test, now with the multi-chunk
# default), the CUDA-backend tests that cover attention (chunks_per_block 1/2/4/8 tokens and logits,
# repeats, page sizes and chunkings, batch invariance), compute-sanitizer racecheck and memcheck on the
# long-context test, `kernels_bench attn` (decode at 1K/8K/32K with max_position 33023 per
# chunks_per_block, beside the KV-read floor), then bench TPOT at 1K and 32K with chunks_per_block 1
# (the previous layout) and the default, and with --sweep the 32K TPOT for chunks_per_block 2,3,5,6,8.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/longdecode_check.sh [--skip-tests] [--skip-sanitizer] [--sweep]
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
LOGS=/tmp/longdecode_check; rm -rf "$LOGS"; mkdir -p "$LOGS" "$RESULTS"
source tools/device/env.sh
TESTS=1; SAN=1; SWEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) TESTS=0 ;;
    --skip-sanitizer) SAN=0 ;;
    --sweep) SWEEP=1 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
targets="decodelab kernels_bench"
[ "$TESTS" = 1 ] && targets="$targets kernels_gpu_test cuda_runner_test"
dl_build "$LOGS" $targets || exit 1
summary() {  # name log rc
  echo "$1 rc=$3: $(grep -E '^\[  (PASSED|FAILED) ' "$2" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]" "$2" | head -20
  grep -B1 -A6 "Failure" "$2" | head -40
}
if [ "$TESTS" = 1 ]; then
  timeout 400 ./build/tests/gpu/kernels_gpu_test --gtest_filter='AttentionGpu.*' > "$LOGS/attn.log" 2>&1
  summary "kernels_gpu_test AttentionGpu.*" "$LOGS/attn.log" $?
  timeout 400 ./build/tests/gpu/cuda_runner_test --gtest_filter='CudaRunnerTest.AttentionChunksPerBlockKeepsTheBits:CudaRunnerTest.BitIdenticalOverRepeats:CudaRunnerTest.TokensIdenticalAcrossPageSizesChunksAndGraphs:CudaRunnerTest.BatchInvariantUnderRandomSchedules:CudaRunnerTest.TeacherForced*' \
    > "$LOGS/runner.log" 2>&1
  summary "cuda_runner_test (attention-covering)" "$LOGS/runner.log" $?
  stamp "tests"
  if [ "$SAN" = 1 ] && command -v compute-sanitizer > /dev/null; then
    for tool in racecheck memcheck; do
      timeout 500 compute-sanitizer --tool $tool --error-exitcode 9 ./build/tests/gpu/kernels_gpu_test \
        --gtest_filter='AttentionGpu.MultiChunkLayoutOnFewChunksMatchesOneChunkPerBlock' > "$LOGS/san_$tool.log" 2>&1
      echo "compute-sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/san_$tool.log" | tr '\n' ' ')"
    done
    stamp "sanitizer"
  fi
fi
timeout 200 ./build/tests/gpu/kernels_bench attn > "$LOGS/kbench.log" 2>&1
sed -n '/^attn long decode/,/^$/p' "$LOGS/kbench.log"
grep -E "^attn " "$LOGS/kbench.log" | head -12
stamp "kernels_bench attn"
B="build/bin/decodelab bench --shape xs2 --kv-dtype fp8 --page-size 32"
for cpb in 1 default; do
  tune=(); [ "$cpb" != default ] && tune=(--tune attention_chunks_per_block=$cpb)
  echo "== chunks_per_block $cpb: 1K (1,024 + 256) =="
  timeout 120 $B --prompt-len 1024 --gen-len 256 --repeat 1 "${tune[@]}" --json-out "$RESULTS/tpot_1k_cpb_$cpb.json" \
    2> "$LOGS/tpot1k_$cpb.err" | grep -E "TPOT|device step|floor"
  echo "== chunks_per_block $cpb: 32K (32,768 + 128, max_seq_len 33024) =="
  timeout 300 $B --prompt-len 32768 --gen-len 128 --max-seq-len 33024 --prefill-chunk 8192 --repeat 1 "${tune[@]}" \
    --json-out "$RESULTS/tpot_32k_cpb_$cpb.json" 2> "$LOGS/tpot32k_$cpb.err" | grep -E "TPOT|device step|floor"
done
if [ "$SWEEP" = 1 ]; then
  for cpb in 2 3 5 6 8; do
    echo "== chunks_per_block $cpb: 32K =="
    timeout 300 $B --prompt-len 32768 --gen-len 128 --max-seq-len 33024 --prefill-chunk 8192 --repeat 1 \
      --tune attention_chunks_per_block=$cpb 2> "$LOGS/tpot32k_$cpb.err" | grep -E "TPOT|device step"
  done
fi
stamp "benches"
