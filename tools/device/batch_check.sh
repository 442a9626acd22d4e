#!/usr/bin/env bash
# The batch-shaped engine in one device-machine call: build, the GPU tests (kernels and the CUDA backend,
# the batch-invariance schedules included), then the XS.2 bench through the serving scheduler at
# concurrency 1, 8 and 64 (in process) and the batched-kernel microbenchmarks. Logs under $OUT.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/batch_check.sh [--gen-len N] [--skip-tests] [--serve] [--concurrency "1 8 64"]
#   --serve adds `decodelab bench serve` (HTTP) at concurrency 1 and 64. KB_SECTIONS="moe" picks the
#   kernel microbenchmark's sections (default gemv_batch moe argmax; "" for none).
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
OUT=/tmp/batch_check; rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
source tools/device/env.sh
GEN=256; TESTS=1; SERVE=0; CONC="1 8 64"
while [ $# -gt 0 ]; do
  case "$1" in
    --gen-len) shift; GEN=$1 ;;
    --skip-tests) TESTS=0 ;;
    --serve) SERVE=1 ;;
    --concurrency) shift; CONC=$1 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
dl_build "$OUT" decodelab cuda_runner_test kernels_gpu_test kernels_bench || exit 1
B=build/bin/decodelab
if [ "$TESTS" = 1 ]; then
  timeout 300 ./build/tests/gpu/kernels_gpu_test > "$OUT/kernels_gpu_test.log" 2>&1
  echo "kernels_gpu_test rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kernels_gpu_test.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]|Failure|error:" "$OUT/kernels_gpu_test.log" | head -20
  grep -B1 -A6 "Failure" "$OUT/kernels_gpu_test.log" | head -60
  timeout 420 ./build/tests/gpu/cuda_runner_test > "$OUT/cuda_runner_test.log" 2>&1
  echo "cuda_runner_test rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/cuda_runner_test.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]" "$OUT/cuda_runner_test.log" | head -20
  grep -B1 -A6 "Failure" "$OUT/cuda_runner_test.log" | head -60
  echo "tests done: $(( $(date +%s) - t0 )) s"
fi
for c in $CONC; do
  g=$([ "$c" = 1 ] && echo 1024 || echo "$GEN")  # concurrency 1: the standard 1024 + 1024 TPOT
  timeout 300 $B bench --shape xs2 --prompt-len 1024 --gen-len "$g" --repeat 1 --kv-dtype fp8 --page-size 32 \
    --concurrency "$c" --json-out "$OUT/bench_c$c.json" > "$OUT/bench_c$c.log" 2>&1
  echo "bench c$c rc=$?:"; grep -E "^  (TPOT|throughput|TTFT|device step|bytes/step|floor|kernels)" "$OUT/bench_c$c.log"
  grep -iE "error|fail" "$OUT/bench_c$c.log" | head -5
done
echo "benches done: $(( $(date +%s) - t0 )) s"
if [ -n "${PREFILL_SKIPS:-}" ]; then  # where a 1,024-token prefill goes: TTFT with each op family left out
  for s in none $PREFILL_SKIPS; do
    skip=(); [ "$s" = none ] || skip=(--skip-ops "$s")
    ttft=$(timeout 120 $B bench --shape xs2 --prompt-len 1024 --gen-len 2 --repeat 1 --kv-dtype fp8 --page-size 32 \
      "${skip[@]}" 2>&1 | sed -n 's/^  TTFT *median \([0-9.]*\) ms.*/\1/p')
    echo "prefill 1024 skip=$s: TTFT ${ttft:-FAILED} ms"
  done
fi
for sec in ${KB_SECTIONS-gemv_batch moe argmax}; do  # the kernel microbenchmark sections
  timeout 120 ./build/tests/gpu/kernels_bench "$sec" > "$OUT/kb_$sec.log" 2>&1
  grep -vE "^(kernel|d2d copy|device:|$)" "$OUT/kb_$sec.log" | tail -n 60
done
if [ "$SERVE" = 1 ]; then
  for c in 1 64; do
    n=$([ "$c" = 1 ] && echo 4 || echo 128)
    timeout 400 $B bench serve --shape xs2 --kv-dtype fp8 --page-size 32 --input-len 1024 --output-len "$GEN" \
      --num-prompts "$n" --concurrency "$c" --serve-log "$OUT/serve_c$c.log" --json-out "$OUT/bench_serve_c$c.json" \
      > "$OUT/bench_serve_c$c.out" 2>&1
    echo "bench serve c$c rc=$?:"; grep -E "throughput|Median|P99" "$OUT/bench_serve_c$c.out" | head -12
  done
fi
echo "total: $(( $(date +%s) - t0 )) s"
tar -czf "$RESULTS/batch_check_logs.tgz" -C /tmp batch_check 2>/dev/null
