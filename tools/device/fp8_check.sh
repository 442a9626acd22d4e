#!/usr/bin/env bash
# FP8 weights (issue 18, CUDA side) in one device-machine call: build, the FP8 kernel tests (GEMV and MoE
# against the CPU reference, the GEMV against the rule's host model bit for bit, batch 1 == batched ==
# grouped bit for bit, the synthetic FP8 fill), static SASS counts of the FP8 kernels, the BF16
# GEMV/MoE tests (their bits must not move), compute-sanitizer memcheck and racecheck on the FP8 tests,
# the kernel microbenchmark's FP8 sections beside BF16 (gemv_fp8, moe_fp8, moe), and, when the decodelab
# binary takes FP8 shape weights (`--shape-dtype fp8 --fp8-layout all-linear`, helper fp8's flags),
# `bench --shape xs2` BF16 against FP8 all-linear, and the prefill sweep (1K, 8K) of FP8 all-linear with
# prompt rows on the tensor-core product (ops.h 5d, the default) and on the CUDA-core FP8 rule
# (--tune prompt_fp8_mma=0) beside BF16. Logs under $OUT.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/fp8_check.sh [--skip-tests] [--skip-sanitizer] [--skip-bench] [--skip-prefill]
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
OUT=/tmp/fp8_check; rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
source tools/device/env.sh
SAN=1; BENCH=1; TESTS=1; PREFILL=1
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) TESTS=0 ;;
    --skip-sanitizer) SAN=0 ;;
    --skip-bench) BENCH=0 ;;
    --skip-prefill) PREFILL=0 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
dl_build "$OUT" kernels_fp8_gpu_test kernels_gpu_test kernels_bench cuda_runner_test decodelab || exit 1
# Static SASS counts of the FP8 kernels (the rule's instruction mix: no FMUL per element, no spills).
bash tools/device/fp8_sass.sh build > "$OUT/fp8_sass.txt" 2>&1
cat "$OUT/fp8_sass.txt"
if [ "$TESTS" = 1 ]; then
timeout 300 ./build/tests/gpu/kernels_fp8_gpu_test > "$OUT/kernels_fp8_gpu_test.log" 2>&1
dl_summary kernels_fp8_gpu_test "$OUT/kernels_fp8_gpu_test.log" $?
timeout 300 ./build/tests/gpu/kernels_gpu_test --gtest_filter='GemvGpu*:MoeGpu*' > "$OUT/kernels_gpu_test.log" 2>&1
dl_summary "kernels_gpu_test (BF16 GEMV/MoE)" "$OUT/kernels_gpu_test.log" $?
# The CUDA backend with FP8 shape weights (all-linear and the export's layout: invariances, BF16
# tracking), and the BF16 backend tests the weight-upload rewrite must keep (goldens, repeats, chunks).
timeout 420 ./build/tests/gpu/cuda_runner_test \
  --gtest_filter='*Fp8*:*TeacherForced*:*BitIdentical*:*TokensIdentical*:*MissingPreset*' > "$OUT/cuda_runner_test.log" 2>&1
dl_summary "cuda_runner_test (FP8 weights, BF16 goldens and invariances)" "$OUT/cuda_runner_test.log" $?
echo "tests: $(( $(date +%s) - t0 )) s"
grep -E "^\[(fp8-golden|prompt-fp8-mma)\]" "$OUT/cuda_runner_test.log"
fi
# sanitize TOOL TIMEOUT LOG_NAME LABEL FILTER: one compute-sanitizer run over kernels_fp8_gpu_test's FILTER,
# its summary line and its distinct error kinds.
sanitize() {
  local tool=$1 limit=$2 log="$OUT/sanitizer_$3.log" label=$4 filter=$5
  timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 ./build/tests/gpu/kernels_fp8_gpu_test \
    --gtest_filter="$filter" > "$log" 2>&1
  echo "compute-sanitizer $tool ($label) rc=$?: $(tail -1 "$log")"
  grep -E "^=+ (Invalid|Race|Error|ERROR)" "$log" | sort | uniq -c | head -10
}
if [ "$SAN" = 1 ]; then
  # memcheck over every FP8 kernel (the XS.2-width MoE cases make the second run the long one); racecheck
  # over the fill and the grouped MoE's shared-memory staging on small layers.
  sanitize memcheck 240 memcheck_gemv "GEMV fused norm, fill" \
    'Fp8GemvGpu.FusedInputNormMatchesSeparateKernels:Fp8GemvGpu.Refuses*:Fp8MoeGpu.Refuses*:Fp8FillGpu.*'
  sanitize memcheck 360 memcheck_moe "batched GEMV, MoE batch 1 and grouped" \
    'Fp8GemvGpu.MatchesReferenceAndIsBatchInvariant:Fp8MoeGpu.MatchesReference:Fp8MoeGpu.GroupedPath*'
  sanitize racecheck 240 racecheck "fill, grouped MoE, small layers" \
    'Fp8FillGpu.*:Fp8MoeGpu.GroupedPathMatchesEveryTokenAloneAndTheReference'
  # The tensor-core product with FP8 weights (ops.h 5d): dense and experts, in-place code conversion.
  sanitize memcheck 300 memcheck_mma "FP8 MMA product" 'Fp8MmaProductGpu.*:Fp8MoeGpu.MmaExperts*'
  sanitize racecheck 300 racecheck_mma "FP8 MMA experts, small layers" \
    'Fp8MmaProductGpu.Refuses*:Fp8MoeGpu.MmaExpertsMatchEveryTokenAloneAndTheReference'
  echo "sanitizer: $(( $(date +%s) - t0 )) s"
fi
if [ "$BENCH" = 1 ]; then
  for sec in gemv_fp8 moe_fp8 moe; do
    timeout 200 ./build/tests/gpu/kernels_bench "$sec" > "$OUT/kb_$sec.log" 2>&1
    echo "kernels_bench $sec rc=$?:"; grep -vE "^(kernel|device:|$)" "$OUT/kb_$sec.log" | tail -n 30
  done
  B=build/bin/decodelab
  # The XS.2 shape end to end, BF16 and FP8 (all-linear) weights generated on the device, when this
  # binary's bench takes the shape-only FP8 layout (helper fp8's flags; FP8_BENCH_FLAGS overrides).
  FP8_FLAGS=${FP8_BENCH_FLAGS:---shape-dtype fp8 --fp8-layout all-linear}
  # (help captured first: grep -q closing the pipe early fails the pipeline under pipefail)
  bench_help=$($B bench --help 2>&1)
  if grep -q -- "${FP8_FLAGS%% *}" <<< "$bench_help"; then
    for wd in bf16 fp8; do
      extra=(); [ "$wd" = fp8 ] && read -r -a extra <<< "$FP8_FLAGS"
      timeout 300 $B bench --shape xs2 "${extra[@]}" --prompt-len 1024 --gen-len 1024 --repeat 1 --kv-dtype fp8 \
        --page-size 32 --json-out "$OUT/bench_$wd.json" > "$OUT/bench_$wd.log" 2>&1
      echo "bench xs2 weights $wd rc=$?:"; grep -E "^  (TPOT|TTFT|device step|bytes/step|floor|weights)" "$OUT/bench_$wd.log"
      grep -iE "error|fail" "$OUT/bench_$wd.log" | head -5
    done
  else
    echo "bench: decodelab bench has no ${FP8_FLAGS%% *} (the shape-only FP8 layout is not wired in this build): skipped"
  fi
fi
if [ "$PREFILL" = 1 ]; then
  B=build/bin/decodelab
  for run in "bf16" "fp8" "fp8 --tune prompt_fp8_mma=0"; do
    read -r -a a <<< "$run"
    extra=(); [ "${a[0]}" = fp8 ] && extra=(--shape-dtype fp8 --fp8-layout all-linear "${a[@]:1}")
    tag=$(echo "$run" | tr ' =' '__')
    timeout 400 $B bench --shape xs2 "${extra[@]}" --kv-dtype fp8 --page-size 32 --prefill-chunk 2048 \
      --prefill-sweep 1024,8192 --repeat 3 --json-out "$OUT/prefill_$tag.json" > "$OUT/prefill_$tag.log" \
      2> "$OUT/prefill_$tag.err"
    echo "prefill sweep $run rc=$?:"; grep -vE "^  wrote" "$OUT/prefill_$tag.log" | tail -n 8
    grep -iE "error|fail" "$OUT/prefill_$tag.err" | head -5
  done
fi
echo "total: $(( $(date +%s) - t0 )) s"
tar -czf "$RESULTS/fp8_check_logs.tgz" -C /tmp fp8_check 2>/dev/null
