#!/usr/bin/env bash
# Per-stage timing of one kernel family on the GPU machine: builds kernels_bench in build-timing with
# -D<MACRO> (on main: DL_ATTN_STAGE_TIMING; branch wip/fused-moe adds DL_MOE_STAGE_TIMING), runs one
# section of it, and prints the median of every "name value" pair of the kernel's "... stages ns:"
# lines, grouped as first block / last block where the lines name a block.
# Usage: bash tools/device/stage_timing.sh MACRO SECTION
set -uo pipefail
MACRO=${1:?macro, e.g. DL_ATTN_STAGE_TIMING}
SECTION=${2:?kernels_bench section, e.g. attn}
OUT=${OUT:-/tmp/stage_timing}
mkdir -p "$OUT"
source tools/device/env.sh
dl_configure build-timing -DCMAKE_CUDA_FLAGS="-D$MACRO" > "$OUT/timing_configure.log" 2>&1 || {
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
