#!/usr/bin/env bash
# The decode step's timeline on the GPU machine: builds decodelab in build-timeline with
# -DDECODELAB_TIMELINE=ON (per-block globaltimer stamps in every decode kernel, kernels/timeline.h),
# runs bench on the XS.2 shape and prints, per kernel, how much of the step it exposes, when it
# started against its predecessor's end (PDL), how long its wait for that predecessor took, and what
# was left after. Extra arguments go to bench (e.g. --gen-len 128); environment switches pass through.
# Usage (repository root, .deps carried): bash tools/device/timeline.sh [bench flags...]
set -uo pipefail
OUT=${OUT:-/tmp/timeline}
mkdir -p "$OUT"
source tools/device/env.sh
dl_configure build-timeline -DDECODELAB_TIMELINE=ON -DDECODELAB_TESTS=OFF > "$OUT/timeline_configure.log" 2>&1 || {
  echo "configure failed"; tail -20 "$OUT/timeline_configure.log"; exit 1; }
ninja -C build-timeline decodelab > "$OUT/timeline_build.log" 2>&1 || {
  echo "build failed"; grep -A5 error "$OUT/timeline_build.log" | head -40; exit 1; }
timeout 200 build-timeline/bin/decodelab bench --shape xs2 --prompt-len 1024 --gen-len 256 --repeat 1 \
  --kv-dtype fp8 --page-size 32 --json-out "$OUT/timeline_bench.json" "$@" > "$OUT/timeline_bench.log" 2>&1 ||
  { echo "bench failed"; tail -20 "$OUT/timeline_bench.log"; exit 1; }
grep -E "^  (TPOT|kernels)" "$OUT/timeline_bench.log"
sed -n '/timeline of the last decode step/,$p' "$OUT/timeline_bench.log" | grep -v "wrote "
