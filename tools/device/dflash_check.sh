#!/usr/bin/env bash
# The DFlash drafter on CUDA (issue 20) in one device-machine call: builds, runs the DFlash GPU tests
# (speculation = plain decoding with the drafter on the GPU and on the CPU; the GPU drafter's logits
# against the CPU reference), the kernel tests of what it reuses (AddRmsNorm's row stride,
# QkNormRopeAppend without query heads), compute-sanitizer memcheck on the drafter test, then on the
# XS.2 shape a random drafter shaped as Poolside's XS.2 drafter (5 layers, block 16) and
# `bench --verify-cost --spec dflash` (verify, block and per-row drafter cost, cycle break-even) and
# `bench --spec dflash` (end to end; random drafter weights: near-zero acceptance).
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/dflash_check.sh [--skip-tests] [--skip-sanitizer]
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
LOGS=/tmp/dflash_check; rm -rf "$LOGS"; mkdir -p "$LOGS" "$RESULTS"
source tools/device/env.sh
TESTS=1; SANITIZER=1
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) TESTS=0 ;;
    --skip-sanitizer) SANITIZER=0 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
targets="decodelab"
[ "$TESTS" = 1 ] && targets="$targets cuda_runner_test kernels_gpu_test"
dl_build "$LOGS" $targets || exit 1
if [ "$TESTS" = 1 ]; then
  timeout 300 ./build/tests/gpu/cuda_runner_test --gtest_filter='*Dflash*' > "$LOGS/dflash_test.log" 2>&1
  dl_summary "cuda_runner_test *Dflash*" "$LOGS/dflash_test.log" $?
  grep -E "^dflash gpu vs cpu" "$LOGS/dflash_test.log"; echo "speculative runs: $(grep -cE '^dflash .* on (cuda|cpu) k' "$LOGS/dflash_test.log")"
  timeout 120 ./build/tests/gpu/kernels_gpu_test --gtest_filter='AddRmsNorm*:QkNormRope*' \
    > "$LOGS/kernels.log" 2>&1
  dl_summary "kernels_gpu_test norm/rope" "$LOGS/kernels.log" $?
  if [ "$SANITIZER" = 1 ]; then
    timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/gpu/cuda_runner_test \
      --gtest_filter='*DflashDrafterOnGpuMatchesCpuReference*' > "$LOGS/memcheck.log" 2>&1
    echo "memcheck DflashDrafterOnGpuMatchesCpuReference rc=$?: $(grep -E 'ERROR SUMMARY' "$LOGS/memcheck.log")"
  fi
fi
DRAFTER=/tmp/dflash_xs2
rm -rf "$DRAFTER"
build/bin/decodelab make-model --dflash-for xs2 --num-layers 5 --block-size 16 --out "$DRAFTER" 2>&1 | tail -1
B="build/bin/decodelab bench --shape xs2 --kv-dtype fp8 --page-size 32 --spec dflash --spec-model $DRAFTER"
timeout 240 $B --verify-cost --spec-k 15 --json-out "$RESULTS/verify_cost_dflash.json" > "$LOGS/verify.log" 2>&1
echo "bench --verify-cost --spec dflash rc=$?"; grep -vE "^  wrote" "$LOGS/verify.log" | tail -16
timeout 200 $B --spec-k 7 --prompt-len 1024 --gen-len 256 --repeat 1 --json-out "$RESULTS/bench_dflash.json" \
  > "$LOGS/bench.log" 2>&1
echo "bench --spec dflash rc=$?"; grep -E "TPOT|speculative|drafter|TTFT|error" "$LOGS/bench.log" | head -10
