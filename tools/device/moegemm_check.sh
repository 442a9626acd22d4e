#!/usr/bin/env bash
# The MMA experts' grouped GEMM (issue 17; the only T > 1 MMA experts path) in one device-machine
# call: build, SASS of moe.cu.o (registers come from ptxas; LDL/STL and HMMA counted inside the
# grouped GEMM's kernels and in the whole object), the MoE and MMA kernel GPU tests (the MMA experts
# against the reference and every token alone at T 2 .. 1,000), compute-sanitizer memcheck and
# racecheck on the sanitizer-sized test, `kernels_bench moe_gemm` (T 512, 1,024, 2,048, 8,192: whole MoE
# and experts µs, weights TB/s and TFLOP/s), then the TTFT of 1,024- and 8,192-token prompts at the
# defaults. Logs under $OUT.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/moegemm_check.sh [--skip-tests] [--skip-bench] [--skip-e2e] [--ncu]
#   --ncu: Nsight Compute sections (speed of light, occupancy, warp states, memory) of the grouped
#   GEMM's kernels at T 1,024 and 2,048 inside `kernels_bench moe_gemm`; reports in ncu_moe_gemm_*.txt.
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
OUT=/tmp/moegemm_check; rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
source tools/device/env.sh
TESTS=1; BENCH=1; E2E=1; NCU=0
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) TESTS=0 ;;
    --skip-bench) BENCH=0 ;;
    --skip-e2e) E2E=0 ;;
    --ncu) NCU=1 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
targets="kernels_gpu_test kernels_bench"
[ "$E2E" = 1 ] && targets="$targets decodelab"
dl_build "$OUT" $targets || exit 1
obj=$(find build -name 'moe.cu.o' | head -1)
CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
if [ -n "$obj" ] && [ -x "$CUOBJDUMP" ]; then
  "$CUOBJDUMP" --dump-sass "$obj" > "$OUT/moe_sass.txt" 2>&1
  "$CUOBJDUMP" --dump-resource-usage "$obj" > "$OUT/moe_res.txt" 2>&1
  echo "sass moe.cu.o (all kernels): LDL/STL $(grep -cE 'LDL|STL' "$OUT/moe_sass.txt")"
  # Per grouped-GEMM kernel: its instructions between its 'Function :' header and the next one.
  awk '/Function :/ { f = $0 } f ~ /MoeMmaGemm/ { print f " | " $0 }' "$OUT/moe_sass.txt" |
    awk -F' [|] ' '{ n[$1]++; if ($2 ~ /LDL|STL/) l[$1]++; if ($2 ~ /HMMA/) h[$1]++; if ($2 ~ /LDGSTS/) g[$1]++ }
      END { for (k in n) printf "  %s: HMMA %d, LDGSTS %d, LDL/STL %d\n", k, h[k], g[k], l[k] }'
  grep -A1 "MoeMmaGemm" "$OUT/moe_res.txt" | grep -oE "Function [^:]*|REG:[0-9]+|STACK:[0-9]+|LOCAL:[0-9]+" | paste - - - - | head -8
else
  echo "sass: no cuobjdump or no moe.cu.o"
fi
if [ "$TESTS" = 1 ]; then
  timeout 500 ./build/tests/gpu/kernels_gpu_test --gtest_filter='MoeGpu.*:MmaGpu.*' > "$OUT/kernels_gpu_test.log" 2>&1
  echo "kernels_gpu_test MoeGpu.*:MmaGpu.* rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kernels_gpu_test.log" | tr '\n' ' ')"
  grep -E "^\[       OK \] MoeGpu.MmaExperts|^\[  FAILED  \]" "$OUT/kernels_gpu_test.log" | head -20
  grep -B1 -A6 "Failure" "$OUT/kernels_gpu_test.log" | head -60
  for tool in memcheck racecheck; do
    timeout 400 compute-sanitizer --tool "$tool" --error-exitcode 9 ./build/tests/gpu/kernels_gpu_test \
      --gtest_filter='MoeGpu.MmaExpertsSanitizerSizes' > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool (MoeGpu.MmaExpertsSanitizerSizes) rc=$?: $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
  done
  echo "tests done: $(( $(date +%s) - t0 )) s"
fi
if [ "$BENCH" = 1 ]; then
  timeout 400 ./build/tests/gpu/kernels_bench moe_gemm > "$OUT/kb_moe_gemm.log" 2>&1
  echo "kernels_bench moe_gemm rc=$?"
  sed -n '/^moe_gemm/,/^$/p' "$OUT/kb_moe_gemm.log"
  grep -i "error" "$OUT/kb_moe_gemm.log" | head -5
  echo "kernel bench done: $(( $(date +%s) - t0 )) s"
fi
if [ "$NCU" = 1 ]; then
  # The gate/up and down launch of T 1,024 and of T 2,048 (each T: 3 warm-up calls, then a graph of 10
  # replayed twice, 2 GEMM launches per call: 46 per T; T 512 comes first).
  for skip in 46 92; do
    timeout 200 ncu --clock-control none --graph-profiling node -k "regex:MoeMmaGemm" --launch-skip $skip --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis \
      ./build/tests/gpu/kernels_bench moe_gemm > "$OUT/ncu_moe_gemm_$skip.txt" 2>&1
    echo "ncu (skip $skip) rc=$?"
    cp "$OUT/ncu_moe_gemm_$skip.txt" "$RESULTS/" 2>/dev/null
    grep -E "^  void|Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Achieved Occupancy" \
      "$OUT/ncu_moe_gemm_$skip.txt" | head -20
  done
fi
if [ "$E2E" = 1 ]; then
  B=build/bin/decodelab
  for len in 1024 8192; do
    timeout 150 $B bench --shape xs2 --prompt-len $len --gen-len 2 --repeat 1 --kv-dtype fp8 --page-size 32 \
      > "$OUT/bench_$len.log" 2>&1
    echo "bench prompt $len (defaults) rc=$?: $(grep -E '^  TTFT' "$OUT/bench_$len.log")"
    grep -iE "error|fail" "$OUT/bench_$len.log" | head -3
  done
fi
echo "total: $(( $(date +%s) - t0 )) s"
tar -czf "$RESULTS/moegemm_check_logs.tgz" -C /tmp moegemm_check 2>/dev/null
