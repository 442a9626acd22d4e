#!/usr/bin/env bash
# The library GEMM for prompt rows' dense layers and router logits (Tuning::prompt_gemm, issue 17) in
# one device call: build, its kernel tests (every row equals itself alone and in other launch sizes,
# bit for bit; the FP32 reference; the MoE's selection over precomputed logits), compute-sanitizer
# memcheck on the small ones, the engine's prompt-row invariance tests (and the drafter's, which share
# the runner), kernels_bench's products at XS.2's shapes (library against the tensor-core product),
# then bench's prefill sweep at prompt_gemm=1 (the default) and 0 in the same call, the 1K TPOT, and
# optionally the 32K prefill (chunk 8192) and decode at a 32K context.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/library_gemm_check.sh [--skip-tests] [--skip-kernels-bench] [--lens 1024,8192]
#       [--repeat N] [--32k]
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
LOGS=/tmp/library_gemm_check; rm -rf "$LOGS"; mkdir -p "$LOGS" "$RESULTS"
source tools/device/env.sh
TESTS=1; KBENCH=1; LENS=1024,8192; REPEAT=2; LONG=0
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) TESTS=0 ;;
    --skip-kernels-bench) KBENCH=0 ;;
    --lens) LENS=$2; shift ;;
    --repeat) REPEAT=$2; shift ;;
    --32k) LONG=1 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
dl_build "$LOGS" decodelab kernels_bench kernels_gpu_test cuda_runner_test || exit 1
if [ "$TESTS" = 1 ]; then
  timeout 200 ./build/tests/gpu/kernels_gpu_test \
    --gtest_filter='LibraryGemmGpu.*:MmaGpu.RowStrides*:MoeGpu.PrecomputedRouterLogits*:MoeGpu.MultiRowRouter*' \
    > "$LOGS/kernels_gpu_test.log" 2>&1
  dl_summary "kernels_gpu_test LibraryGemmGpu, MoeGpu routers" "$LOGS/kernels_gpu_test.log" $?
  grep -E "^  cuBLASLt" "$LOGS/kernels_gpu_test.log" | sort -u | head -12
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/gpu/kernels_gpu_test \
    --gtest_filter='LibraryGemmGpu.RowStrides*:MoeGpu.PrecomputedRouterLogits*' > "$LOGS/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' "$LOGS/memcheck.log" | tail -1)"
  timeout 400 ./build/tests/gpu/cuda_runner_test \
    --gtest_filter='*PromptRows*:*TokensIdentical*:*BitIdentical*:*Dflash*:*ReportsGraph*' > "$LOGS/cuda_runner_test.log" 2>&1
  dl_summary cuda_runner_test "$LOGS/cuda_runner_test.log" $?
  grep -E "^\[prompt" "$LOGS/cuda_runner_test.log"
  stamp "tests"
fi
if [ "$KBENCH" = 1 ]; then
  timeout 240 ./build/tests/gpu/kernels_bench mma > "$LOGS/kbench.log" 2>&1
  echo "kernels_bench mma rc=$?"
  grep -E "cuBLASLt|not measured" "$LOGS/kbench.log" | head -6
  grep -E "^(mma|library) " "$LOGS/kbench.log" | awk '$4 >= 256'
  cp "$LOGS/kbench.log" "$RESULTS/"
  stamp "kernels_bench"
fi
B="build/bin/decodelab bench --shape xs2 --kv-dtype fp8 --page-size 32"
for g in 1 0; do
  echo "== prompt_gemm=$g"
  timeout 300 $B --prefill-chunk 2048 --prefill-sweep $LENS --repeat $REPEAT --tune prompt_gemm=$g \
    --json-out "$RESULTS/prefill_sweep_gemm$g.json" 2> "$LOGS/sweep$g.err" | grep -vE "^  wrote"
  tail -3 "$LOGS/sweep$g.err"
done
timeout 120 $B --prompt-len 1024 --gen-len 256 --repeat 1 --json-out "$RESULTS/tpot_xs2.json" 2> "$LOGS/tpot.err" |
  grep -E "TPOT|device step|TTFT|prefill  "
if [ "$LONG" = 1 ]; then
  timeout 200 $B --prefill-chunk 8192 --prefill-sweep 32768 --repeat 1 --json-out "$RESULTS/prefill_sweep_32k.json" \
    2> "$LOGS/sweep32k.err" | grep -E "^ +32768"
  timeout 200 $B --prompt-len 32768 --gen-len 128 --max-seq-len 33024 --prefill-chunk 8192 --repeat 1 \
    --json-out "$RESULTS/tpot_xs2_32k.json" 2> "$LOGS/tpot32k.err" | grep -E "TPOT|device step|TTFT|floor"
fi
stamp "benches"
