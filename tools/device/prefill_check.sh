#!/usr/bin/env bash
# Prefill work (issue 17) and everything it touches, in one device-machine call: build, the kernel GPU
# tests (attention one-row/multi-row bit for bit on every built preset, the MoE router and MMA experts,
# GEMV BF16 and FP8), the CUDA-backend tests, the attention prefill kernel bench, then bench:
# --prefill-sweep at the defaults (prompt rows on the tensor-core product: 128, 1K, 8K), the batch-1
# decode TPOT and TTFT at the defaults, optionally decode at a 32K context, and optionally S 2.1 with
# FP8 export weights on one GPU (TPOT).
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/prefill_check.sh [--skip-tests] [--skip-runner] [--s21] [--sweep-32k] [--decode-32k]
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
LOGS=/tmp/prefill_check; rm -rf "$LOGS"; mkdir -p "$LOGS" "$RESULTS"
source tools/device/env.sh
TESTS=1; RUNNER=1; S21=0; SWEEP32=0; DECODE32=0
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) TESTS=0 ;;
    --skip-runner) RUNNER=0 ;;
    --s21) S21=1 ;;
    --sweep-32k) SWEEP32=1 ;;
    --decode-32k) DECODE32=1 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
targets="decodelab kernels_bench"
[ "$TESTS" = 1 ] && targets="$targets kernels_gpu_test kernels_fp8_gpu_test"
[ "$RUNNER" = 1 ] && targets="$targets cuda_runner_test"
dl_build "$LOGS" $targets || exit 1
if [ "$TESTS" = 1 ]; then
  timeout 400 ./build/tests/gpu/kernels_gpu_test > "$LOGS/kernels_gpu_test.log" 2>&1
  dl_summary kernels_gpu_test "$LOGS/kernels_gpu_test.log" $?
  timeout 120 ./build/tests/gpu/kernels_fp8_gpu_test --gtest_filter='Fp8GemvGpu.*' > "$LOGS/kernels_fp8.log" 2>&1
  dl_summary "kernels_fp8_gpu_test Fp8GemvGpu.*" "$LOGS/kernels_fp8.log" $?
  stamp "kernel tests"
fi
if [ "$RUNNER" = 1 ]; then
  timeout 500 ./build/tests/gpu/cuda_runner_test > "$LOGS/cuda_runner_test.log" 2>&1
  dl_summary cuda_runner_test "$LOGS/cuda_runner_test.log" $?
  stamp "runner tests"
fi
timeout 120 ./build/tests/gpu/kernels_bench attn_prefill 2>&1 | grep -vE "^(copy|d2d|device|kernel  )" | tail -12
B="build/bin/decodelab bench --shape xs2 --kv-dtype fp8 --page-size 32"
lens=128,1024,8192; [ "$SWEEP32" = 1 ] && lens=$lens,32768
timeout 300 $B --prefill-chunk 2048 --prefill-sweep $lens --repeat 1 \
  --json-out "$RESULTS/prefill_sweep.json" 2> "$LOGS/sweep.err" | grep -vE "^  wrote"
timeout 120 $B --prompt-len 1024 --gen-len 256 --repeat 1 --json-out "$RESULTS/tpot_xs2.json" 2> "$LOGS/tpot.err" |
  grep -E "TPOT|device step|TTFT|prefill  "
if [ "$DECODE32" = 1 ]; then  # decode at a 32K context (issue 17: >= 55 % of that context's floor)
  timeout 300 $B --prompt-len 32768 --gen-len 128 --max-seq-len 33024 --prefill-chunk 8192 --repeat 1 \
    --json-out "$RESULTS/tpot_xs2_32k.json" 2> "$LOGS/tpot32k.err" | grep -E "TPOT|device step|TTFT|floor"
fi
stamp "benches"
if [ "$S21" = 1 ]; then
  timeout 400 build/bin/decodelab bench --shape s21 --shape-dtype fp8 --fp8-layout export --kv-dtype fp8 --page-size 32 \
    --prompt-len 1024 --gen-len 128 --repeat 1 --json-out "$RESULTS/tpot_s21_fp8.json" > "$LOGS/s21.log" 2>&1
  echo "s21 fp8 export rc=$?"; grep -E "TPOT|device step|TTFT|floor|weights/tok|error" "$LOGS/s21.log" | head -8
  stamp "s21"
fi
