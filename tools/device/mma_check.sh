#!/usr/bin/env bash
# The tensor-core product (issue 17, GemvParams::mma / --tune mma_products=1) in one device-machine call:
# build, the kernel GPU tests (the MMA product's reference and bit-for-bit row checks, the GEMV and MoE
# tests beside it), compute-sanitizer memcheck and racecheck on the MMA kernels' small shapes, the
# CUDA-backend tests with mma_products on (batch, chunk and page invariance), SASS counts (HMMA
# present, no local memory), the kernel microbenchmark's mma section (CUDA-core GEMV against the MMA
# product at T = 1 .. 4096 on XS.2's linear layers, with floors), then the XS.2 bench with
# mma_products 0 and 1 (TPOT at batch 1, TTFT of a 1,024-token prompt) and the TTFT of an 8,192-token
# prompt with it on. Logs under $OUT.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/mma_check.sh [--skip-tests] [--skip-bench] [--skip-e2e]
#   KB_SECTIONS="mma" picks the kernel microbenchmark's sections (default "mma moe").
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
OUT=/tmp/mma_check; rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
source tools/device/env.sh
TESTS=1; BENCH=1; E2E=1
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) TESTS=0 ;;
    --skip-bench) BENCH=0 ;;
    --skip-e2e) E2E=0 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
targets="kernels_gpu_test kernels_bench"
[ "$TESTS" = 1 ] && targets="$targets cuda_runner_test"
[ "$E2E" = 1 ] && targets="$targets decodelab"
dl_build "$OUT" $targets || exit 1
# Registers, spills and the instructions the product must use (HMMA; no LDL/STL local memory).
obj=$(find build -name 'mma.cu.o' | head -1)
CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
if [ -n "$obj" ] && [ -x "$CUOBJDUMP" ]; then
  "$CUOBJDUMP" --dump-sass "$obj" > "$OUT/mma_sass.txt" 2>&1
  echo "sass mma.cu.o: HMMA $(grep -c HMMA "$OUT/mma_sass.txt"), LDG.E.128 $(grep -c 'LDG.E.128' "$OUT/mma_sass.txt"), LDS.128 $(grep -c 'LDS.128' "$OUT/mma_sass.txt"), LDGSTS $(grep -c LDGSTS "$OUT/mma_sass.txt"), LDL/STL $(grep -cE 'LDL|STL' "$OUT/mma_sass.txt")"
else
  echo "sass: no cuobjdump or no mma.cu.o"
fi
if [ "$TESTS" = 1 ]; then
  timeout 400 ./build/tests/gpu/kernels_gpu_test > "$OUT/kernels_gpu_test.log" 2>&1
  echo "kernels_gpu_test rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kernels_gpu_test.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]" "$OUT/kernels_gpu_test.log" | head -20
  grep -B1 -A6 "Failure" "$OUT/kernels_gpu_test.log" | head -60
  grep -E "^\[       OK \] MmaGpu" "$OUT/kernels_gpu_test.log"
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 ./build/tests/gpu/kernels_gpu_test \
      --gtest_filter='MmaGpu.OddShapesEveryKernel:MmaGpu.RowStridesGiveTheDenseBits:MmaGpu.RejectsWhatItDoesNotDo' > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool (MmaGpu small shapes) rc=$?: $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
  done
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/gpu/kernels_gpu_test \
    --gtest_filter='MoeGpu.Mma*' > "$OUT/sanitizer_moe_memcheck.log" 2>&1
  echo "compute-sanitizer memcheck (MoeGpu.Mma*) rc=$?: $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$OUT/sanitizer_moe_memcheck.log" | tr '\n' ' ')"
  timeout 500 ./build/tests/gpu/cuda_runner_test --gtest_filter='CudaRunnerTest.MmaProducts*:CudaRunnerTest.BatchInvariant*' \
    > "$OUT/cuda_runner_test.log" 2>&1
  echo "cuda_runner_test (mma + batch invariance) rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/cuda_runner_test.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]|^\[mma\]" "$OUT/cuda_runner_test.log" | head -20
  grep -B1 -A6 "Failure" "$OUT/cuda_runner_test.log" | head -40
  echo "tests done: $(( $(date +%s) - t0 )) s"
fi
if [ "$BENCH" = 1 ]; then
  for sec in ${KB_SECTIONS-mma moe}; do
    timeout 300 ./build/tests/gpu/kernels_bench "$sec" > "$OUT/kb_$sec.log" 2>&1
    echo "kernels_bench $sec rc=$?"
    grep -vE "^(kernel |d2d copy|device:|$)" "$OUT/kb_$sec.log" | tail -n 190
  done
  echo "kernel bench done: $(( $(date +%s) - t0 )) s"
fi
if [ "$E2E" = 1 ]; then
  B=build/bin/decodelab
  for mma in 0 1; do
    timeout 200 $B bench --shape xs2 --prompt-len 1024 --gen-len 256 --repeat 1 --kv-dtype fp8 --page-size 32 \
      --tune mma_products=$mma --json-out "$OUT/bench_mma$mma.json" > "$OUT/bench_mma$mma.log" 2>&1
    echo "bench mma_products=$mma rc=$?:"
    grep -E "^  (TPOT|TTFT|device step|floor|kernels|tuning)" "$OUT/bench_mma$mma.log"
    grep -iE "error|fail" "$OUT/bench_mma$mma.log" | head -5
  done
  # An 8,192-token prompt with the product on (issue 17's second target; 8.5 s with it off, session 9).
  timeout 120 $B bench --shape xs2 --prompt-len 8192 --gen-len 2 --repeat 1 --kv-dtype fp8 --page-size 32 \
    --tune mma_products=1 > "$OUT/bench_mma1_8k.log" 2>&1
  echo "bench 8K prompt, mma_products=1 rc=$?: $(grep -E '^  TTFT' "$OUT/bench_mma1_8k.log")"
fi
echo "total: $(( $(date +%s) - t0 )) s"
tar -czf "$RESULTS/mma_check_logs.tgz" -C /tmp mma_check 2>/dev/null
