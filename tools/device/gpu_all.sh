#!/usr/bin/env bash
# One device-machine call: build everything, run the GPU tests (and the whole suite), the GPU tests
# under compute-sanitizer memcheck, the NCCL probe (2+ GPUs), `decodelab bench` on the XS.2 shape and
# the per-kernel microbenchmark; logs go to $OUT, a short table comes last.
#   usage (repo root, on the GPU machine, .deps and .decodelab-commit carried; write the latter here
#   first with tools/device/stamp-commit.sh): bash tools/device/gpu_all.sh [--peer|--quick]
#   --peer also times transformers on the same GPU (tools/peers/transformers_bench.py).
#   --quick: kernel work in progress: only the GPU targets, GPU tests, one bench run, kernel bench.
#   --ab NAME=VALUE (repeatable): after the main bench, one more bench run (same settings, 1 run)
#     with that kernel tuning (bench --tune NAME=VALUE), e.g. --ab dependent_launch=0: an A/B in the
#     same call. Several settings for one run: --ab "A=1 B=2" (space-separated).
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
# Logs go to a scratch folder and come back as one tarball (the device returns at most 8 files).
OUT=/tmp/gpu_all
rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
source tools/device/env.sh
PEER=0; QUICK=0; AB=()
while [ $# -gt 0 ]; do
  case "$1" in
    --peer) PEER=1 ;;
    --quick) QUICK=1 ;;
    --ab) shift; [[ "${1:-}" == *=* ]] || { echo "--ab needs NAME=VALUE"; exit 2; }; AB+=("$1") ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
declare -A R
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if ! dl_configure build > "$OUT/configure.log" 2>&1; then
  echo "CONFIGURE FAILED"; grep -B2 -A8 -i error "$OUT/configure.log" | head -60; exit 1
fi
# What the GPU work needs must build; the rest is built too (-k 0) and reported, but does not stop it.
if ! ninja -C build decodelab cuda_runner_test kernels_gpu_test kernels_bench > "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED"; grep -B2 -A6 -E "error" "$OUT/build.log" | head -80; exit 1
fi
[ "$QUICK" = 1 ] || ninja -C build -k 0 > "$OUT/build_rest.log" 2>&1 || { echo "NOTE: some non-GPU targets failed to build:"; grep -E "^FAILED" "$OUT/build_rest.log" | head; }
echo "build: $(( $(date +%s) - t0 )) s, commit $(cat .decodelab-commit 2>/dev/null || echo '(no .decodelab-commit)')"
B=build/bin/decodelab
timeout 300 ctest --test-dir build -L gpu --output-on-failure > "$OUT/gpu_tests.log" 2>&1; R[gpu_tests]=$?
grep -E "tests passed|Failed|\*\*\*|\[bf16-golden\]" "$OUT/gpu_tests.log" | head -30
if [ "$QUICK" = 0 ]; then
timeout 200 ctest --test-dir build -LE "gpu|node" -j 16 > "$OUT/all_tests.log" 2>&1; R[cpu_tests]=$?
grep -E "tests passed|Failed" "$OUT/all_tests.log" | head -10
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/gpu/cuda_runner_test \
  --gtest_filter='*TeacherForced*:*Topology*:*MissingPreset*' > "$OUT/memcheck_runner.log" 2>&1
R[memcheck_runner]=$?; tail -3 "$OUT/memcheck_runner.log"
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/gpu/kernels_gpu_test \
  --gtest_filter='GemvGpu*:MoeGpu*:AddRmsNormGpu*:QkNormRopeAppendGpu*' > "$OUT/memcheck_kernels.log" 2>&1
R[memcheck_kernels]=$?; tail -2 "$OUT/memcheck_kernels.log"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$ngpu" -ge 2 ]; then
  timeout 120 $B probe --ranks 2 --transport nccl --bytes 4096 --iters 200 --log-dir "$OUT/probe" \
    > "$OUT/probe.log" 2>&1; R[probe_4k]=$?
  timeout 120 $B probe --ranks 2 --transport nccl --bytes 4096 --iters 20 --timeout-s 10 \
    --inject all_reduce-done:1:hang --log-dir "$OUT/probe-hang" > "$OUT/probe_hang.log" 2>&1
  R[probe_hang_expect4]=$?
  grep -h -E "PROBE_RESULT|busbw|latency|time" "$OUT/probe.log" "$OUT/probe_hang.log" | head -12
  pgrep -f __probe-rank >/dev/null && echo "ORPHAN PROBE RANKS LEFT" || echo "no probe rank processes left"
fi
timeout 200 python3 tools/device/serve_check.py $B --model tests/data/golden/tiny --backend cuda \
  --kv-dtype bf16 > "$OUT/serve_tiny.log" 2>&1; R[serve_cuda_tiny]=$?
timeout 300 python3 tools/device/serve_check.py $B --shape xs2 --num-layers 4 --backend cuda \
  --kv-dtype fp8 --page-size 32 > "$OUT/serve_xs2.log" 2>&1; R[serve_cuda_xs2_4l]=$?
tail -n 2 "$OUT/serve_tiny.log" "$OUT/serve_xs2.log"
fi
timeout 300 $B bench --shape xs2 --prompt-len 1024 --gen-len 1024 --repeat $([ "$QUICK" = 1 ] && echo 1 || echo 3) --kv-dtype fp8 \
  --page-size 32 --json-out "$OUT/bench_xs2_fp8_p32.json" > "$OUT/bench_xs2.log" 2>&1; R[bench_xs2]=$?
cat "$OUT/bench_xs2.log" | tail -12
for kv in "${AB[@]}"; do
  name=$(printf '%s' "$kv" | tr -c 'A-Za-z0-9_' '_')  # NAME=VALUE as a file name
  tune=(); for t in $kv; do tune+=(--tune "$t"); done
  timeout 200 $B bench --shape xs2 --prompt-len 1024 --gen-len 1024 --repeat 1 --kv-dtype fp8 \
    --page-size 32 "${tune[@]}" --json-out "$OUT/bench_xs2_ab_$name.json" > "$OUT/bench_ab_$name.log" 2>&1; R[bench_ab_$name]=$?
  echo "A/B $kv: $(grep -E '^  TPOT' "$OUT/bench_ab_$name.log")"
done
timeout 120 ./build/tests/gpu/kernels_bench > "$OUT/kernels_bench.log" 2>&1; R[kernels_bench]=$?
if [ "$PEER" = 1 ]; then
  timeout 400 python3 tools/peers/transformers_bench.py --prompt-len 1024 --gen-len 64 \
    --json-out "$OUT/transformers_xs2.json" > "$OUT/transformers.log" 2>&1; R[peer]=$?
  tail -3 "$OUT/transformers.log"
fi
echo "== kernels (per-kernel microbenchmark) =="
tail -16 "$OUT/kernels_bench.log"
echo "== summary ($(( $(date +%s) - t0 )) s) =="
cat "$OUT/gpu.txt"
for k in "${!R[@]}"; do printf "  %-22s rc=%s\n" "$k" "${R[$k]}"; done | sort
cp "$OUT"/*.json "$RESULTS"/ 2>/dev/null
tar czf "$RESULTS/gpu_all_logs.tgz" -C "$OUT" .
