#!/usr/bin/env bash
# Where a prefill's time goes, per kernel (issue 17): Nsight Compute over the prefill of an
# XS.2-shaped model cut to --num-layers (default 8: 2 full-attention layers, 6 sliding, 1 dense MLP,
# 7 MoE), GPU time per kernel name summed over the prefill's launches, with the launch count and the
# share of the total. Kernels run serialised under ncu, so the sum is an upper bound of the eager
# prefill's device time; bench's own prefill_ms (without ncu) is printed beside it.
# --detail REGEX adds Nsight Compute's speed-of-light, warp-state, occupancy and memory sections for
# the first two launches of each kernel matching REGEX (e.g. "MoeMma|MmaTiled"): what limits them.
#   usage (repo root, GPU machine, after a build of ./build/bin/decodelab; .deps carried):
#     bash tools/device/prefill_profile.sh [--layers N] [--prompt-len N] [--detail REGEX] [bench flags...]
set -uo pipefail
source tools/device/env.sh
LAYERS=8; PROMPT=1024; DETAIL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) LAYERS=$2; shift 2 ;;
    --prompt-len) PROMPT=$2; shift 2 ;;
    --detail) DETAIL=$2; shift 2 ;;
    *) break ;;
  esac
done
LOG=${OUT:-/tmp}/prefill_profile_${PROMPT}_${LAYERS}
BENCH=(build/bin/decodelab bench --shape xs2 --num-layers "$LAYERS" --prompt-len "$PROMPT" --gen-len 2 --repeat 1
       --kv-dtype fp8 --page-size 32 --no-graph "$@")
timeout 120 "${BENCH[@]}" --json-out "$LOG.bench.json" > "$LOG.bench.log" 2>&1
grep -E "TTFT|prefill" "$LOG.bench.log" | head -4
# --gen-len 2 decodes one token after the prefill; the decode step's kernels are a small tail.
timeout 400 ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw --log-file "$LOG.ncu.txt" \
  "${BENCH[@]}" > "$LOG.ncu_bench.log" 2>&1
echo "ncu rc=$?"
grep '^"' "$LOG.ncu.txt" > "$LOG.csv"
python3 - "$LOG.csv" <<'PY'
import csv, re, sys
rows = list(csv.DictReader(open(sys.argv[1])))
if rows and rows[0].get('ID', '').strip() == '':
    unit = rows[0].get('gpu__time_duration.sum', 'nsecond'); rows = rows[1:]
else:
    unit = 'nsecond'
div = {'nsecond': 1e3, 'usecond': 1.0, 'msecond': 1e-3}.get(unit, 1e3)
agg = {}
for r in rows:
    try:
        t = float(r['gpu__time_duration.sum'].replace(',', '')) / div
    except (KeyError, ValueError):
        continue
    name = re.sub(r'\(.*', '', r['Kernel Name'])[:70]
    a = agg.setdefault(name, [0.0, 0]); a[0] += t; a[1] += 1
total = sum(v[0] for v in agg.values())
print(f"{'kernel':70s} {'ms':>9s} {'launches':>8s} {'share':>6s}")
for name, (t, n) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
    print(f"{name:70s} {t/1e3:9.3f} {n:8d} {100*t/total:5.1f}%")
print(f"{'total':70s} {total/1e3:9.3f}")
PY
if [ -n "$DETAIL" ]; then
  # Skip the load's weight generation (FillAffineKernel is not matched) and take two launches per kernel.
  timeout 300 ncu --clock-control none -k "regex:$DETAIL" --launch-count 6 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
    "${BENCH[@]}" > "$LOG.detail.txt" 2>&1
  echo "ncu detail rc=$?"
  grep -E "^  [a-zA-Z_:<>, 0-9]+\(|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size|Stall|Warp Cycles Per Issued|Issue Slot|Theoretical Occupancy|Dynamic Shared|Static Shared|Mem Busy|Max Bandwidth" "$LOG.detail.txt" | head -150
fi
