#!/usr/bin/env bash
# Per-kernel hardware numbers (Nsight Compute) for the decode kernels: duration, DRAM bytes and
# throughput, registers, grid, occupancy. Runs after gpu_all.sh has built ./build (same call).
#   usage: bash tools/device/ncu_kernels.sh [regex]   (default: every decode kernel)
set -uo pipefail
source tools/device/env.sh
RX=${1:-"Moe|Attention|Gemv|AddRmsNorm|QkNorm|Argmax|Embed"}
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers
# In the decode graph of a 2-layer XS.2 model (kernels as the engine launches them): skip the prefill.
timeout 300 ncu --clock-control none --graph-profiling node -k "regex:$RX" --launch-skip 40 --launch-count 26 \
  --metrics $M --csv --page raw --log-file /tmp/ncu_log.txt build/bin/decodelab bench --shape xs2 --num-layers 2 --prompt-len 16 \
  --gen-len 8 --kv-dtype bf16 --page-size 32 --repeat 1 > /tmp/ncu_bench.log 2>&1
grep '^"' /tmp/ncu_log.txt > /tmp/ncu_raw.csv
python3 - <<'PY'
import csv
rows = list(csv.DictReader(open('/tmp/ncu_raw.csv')))
keys = ['gpu__time_duration.sum', 'dram__bytes_read.sum', 'dram__throughput.avg.pct_of_peak_sustained_elapsed',
        'launch__registers_per_thread', 'launch__grid_size', 'sm__warps_active.avg.pct_of_peak_sustained_active']
units = rows[0] if rows and rows[0].get('ID', '').strip() == '' else {}
tu = units.get('gpu__time_duration.sum', 'nsecond'); bu = units.get('dram__bytes_read.sum', 'byte')
tdiv = {'nsecond': 1e3, 'usecond': 1.0, 'msecond': 1e-3}.get(tu, 1e3)
bdiv = {'byte': 1e6, 'Kbyte': 1e3, 'Mbyte': 1.0, 'Gbyte': 1e-3}.get(bu, 1e6)
print(f"(units: time {tu}, bytes {bu})")
print(f"{'kernel':60s} {'us':>8s} {'MB read':>9s} {'dram%':>6s} {'regs':>5s} {'grid':>6s} {'warps%':>7s}")
for r in rows[1:] if rows and rows[0].get('ID', '').strip() == '' else rows:
    try:
        name = r['Kernel Name'][:60]
        t = float(r['gpu__time_duration.sum'].replace(',', '')) / tdiv
        mb = float(r['dram__bytes_read.sum'].replace(',', '')) / bdiv
        print(f"{name:60s} {t:8.2f} {mb:9.2f} {float(r[keys[2]]):6.1f} {r[keys[3]]:>5s} {r[keys[4]]:>6s} {float(r[keys[5]]):7.1f}")
    except (KeyError, ValueError):
        continue
PY
