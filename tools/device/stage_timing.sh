#!/usr/bin/env bash
# Per-stage timing of one kernel family on the GPU machine: builds kernels_bench in build-timing with
# -D<MACRO> (DL_MOE_STAGE_TIMING or DL_ATTN_STAGE_TIMING), runs one section of it, and prints the
# median of every "name value" pair of the kernel's "... stages ns:" lines, grouped by the words
# before the first number (e.g. "block 0/264"). Usage: bash tools/device/stage_timing.sh MACRO SECTION
set -uo pipefail
MACRO=${1:?macro, e.g. DL_MOE_STAGE_TIMING}
SECTION=${2:?kernels_bench section, e.g. moe}
OUT=${OUT:-/tmp/stage_timing}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cmake -S . -B build-timing -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS="-D$MACRO" > "$OUT/timing_configure.log" 2>&1 || {
  echo "configure failed"; tail -20 "$OUT/timing_configure.log"; exit 1; }
ninja -C build-timing kernels_bench > "$OUT/timing_build.log" 2>&1 || {
  echo "build failed"; grep -A5 error "$OUT/timing_build.log" | head -40; exit 1; }
./build-timing/tests/gpu/kernels_bench "$SECTION" > "$OUT/timing_run.log" 2>&1
python3 - "$OUT/timing_run.log" <<'PY'
import re, statistics, sys
groups = {}
for line in open(sys.argv[1]):
    if "stages ns:" not in line:
        continue
    body = line.split("stages ns:", 1)[1]
    pairs = re.findall(r"([A-Za-z_+\-]+[0-9]*) (\d+)", body)
    key = "first block" if re.search(r"block 0/", body) else "last block" if "block" in body else "block"
    g = groups.setdefault(key, {})
    for name, value in pairs:
        g.setdefault(name, []).append(int(value))
for key, g in groups.items():
    n = len(next(iter(g.values())))
    cells = [f"{name} {statistics.median(v):.0f}" for name, v in g.items() if name != "start"]
    print(f"{key} (median of {n}): " + ", ".join(cells))
PY
grep -v "stages ns:" "$OUT/timing_run.log" | tail -8
