#!/usr/bin/env bash
# Where a prefill's time goes, per kernel (issue 17): Nsight Compute over the prefill of an
# XS.2-shaped model cut to --num-layers (default 8: 2 full-attention layers, 6 sliding, 1 dense MLP,
# 7 MoE), GPU time per kernel name summed over the prefill's launches, with the launch count and the
# share of the total. Kernels run serialised under ncu, so the sum is an upper bound of the eager
# prefill's device time; bench's own prefill_ms (without ncu) is printed beside it.
#   usage (repo root, GPU machine, after a build of ./build/bin/decodelab; .deps carried):
#     bash tools/device/prefill_profile.sh [--layers N] [--prompt-len N] [bench flags...]
set -uo pipefail
source tools/device/env.sh
LAYERS=8; PROMPT=1024
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) LAYERS=$2; shift 2 ;;
    --prompt-len) PROMPT=$2; shift 2 ;;
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
