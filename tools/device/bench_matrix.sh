#!/usr/bin/env bash
# A few end-to-end benches in one device call: graph vs eager launches, KV page sizes, and a longer
# context, on the XS.2 shape (BF16 weights generated on the device, FP8 KV). Prints a table last.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried): bash tools/device/bench_matrix.sh
set -uo pipefail
RESULTS=${OUT:-/tmp/out}; W=/tmp/bm; rm -rf "$W"; mkdir -p "$W" "$RESULTS"
source tools/device/env.sh
dl_configure build > "$W/configure.log" 2>&1 || { tail -20 "$W/configure.log"; exit 1; }
ninja -C build decodelab > "$W/build.log" 2>&1 || { grep -A5 error "$W/build.log" | head -30; exit 1; }
B=build/bin/decodelab
run() {  # name, flags...
  local name=$1; shift
  timeout 150 $B bench --shape xs2 --kv-dtype fp8 --repeat 2 "$@" --json-out "$W/$name.json" \
    > "$W/$name.log" 2>&1 || echo "$name failed: $(tail -2 "$W/$name.log")"
}
run graph_p32      --prompt-len 1024 --gen-len 512 --page-size 32
run eager_p32      --prompt-len 1024 --gen-len 512 --page-size 32 --no-graph
run graph_p16      --prompt-len 1024 --gen-len 512 --page-size 16
run graph_p64      --prompt-len 1024 --gen-len 512 --page-size 64
run graph_p32_ctx8k --prompt-len 8192 --gen-len 256 --page-size 32 --prefill-chunk 512
printf "%-16s %10s %8s %8s %9s %8s\n" run tpot_ms p10 p90 floor_% kernels
for f in "$W"/*.json; do
  python3 -c "import json,sys,os; j=json.load(open('$f')); print('%-16s %10.4f %8.4f %8.4f %9.1f %8d' % (os.path.basename('$f')[:-5], j['tpot_ms_median'], j['tpot_ms_p10'], j['tpot_ms_p90'], j['pct_of_floor'], j['kernels_per_step']))"
done
tar czf "$RESULTS/bench_matrix.tgz" -C "$W" .
