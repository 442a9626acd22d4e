#!/usr/bin/env bash
# One device-machine call: configure, build the kernel tests and benchmark, run the tests, run them
# under compute-sanitizer memcheck, run the benchmark. Logs go to $OUT; a short table comes last.
#   usage (repo root, on the GPU machine): tests/gpu/run_device.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=$PWD/.deps/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_SYSROOT_DIR=$PWD/.deps
export PKG_CONFIG_PATH=$PWD/.deps/usr/lib/x86_64-linux-gnu/pkgconfig:$PWD/.deps/usr/share/pkgconfig
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if ! cmake -S . -B build -G Ninja -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" -DCMAKE_CUDA_ARCHITECTURES=90 \
     > "$OUT/configure.log" 2>&1; then
  echo "CONFIGURE FAILED"; grep -B2 -A8 -i error "$OUT/configure.log" | head -60; exit 1
fi
start=$(date +%s)
if ! ninja -C build kernels_gpu_test kernels_bench kernels_test > "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED"; grep -B2 -A6 -E "error" "$OUT/build.log" | head -80; exit 1
fi
echo "build of kernel targets: $(( $(date +%s) - start )) s"
./build/src/kernels/kernels_test > "$OUT/cpu_test.log" 2>&1; cpu_rc=$?
./build/tests/gpu/kernels_gpu_test > "$OUT/gpu_test.log" 2>&1; gpu_rc=$?
grep -E "^\[  (FAILED|PASSED|SKIPPED)|Failure|error|outside tolerance|Expected|Which is|actual" \
  "$OUT/gpu_test.log" | head -60
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/gpu/kernels_gpu_test \
  > "$OUT/memcheck.log" 2>&1; mc_rc=$?
tail -5 "$OUT/memcheck.log"
timeout 200 ./build/tests/gpu/kernels_bench > "$OUT/bench.log" 2>&1; bench_rc=$?
echo "== cpu tests rc=$cpu_rc, gpu tests rc=$gpu_rc, memcheck rc=$mc_rc, bench rc=$bench_rc"
cat "$OUT/gpu.txt"
tail -20 "$OUT/bench.log"
