#!/usr/bin/env bash
# Alternating A/B benches in one device-machine call: builds decodelab only, then runs the XS.2 bench
# (1 run each, 1024 + 1024, FP8 KV, page 32) for every configuration in turn, ROUNDS times, so that
# drift during the call (clocks, temperature) falls on every configuration alike; prints each run and
# the median per configuration last. A configuration is a space-separated list of kernel tuning
# settings NAME=VALUE (bench --tune); "" is the default engine.
#   usage (repo root, on the GPU machine, .deps carried):
#     bash tools/device/ab.sh [--rounds N] [--gen-len N] "" "late_release=o_proj" ...
set -uo pipefail
ROUNDS=3; GEN=1024; CONFIGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) shift; ROUNDS=$1 ;;
    --gen-len) shift; GEN=$1 ;;
    *) CONFIGS+=("$1") ;;
  esac
  shift
done
[ ${#CONFIGS[@]} -ge 1 ] || { echo "usage: ab.sh [--rounds N] [--gen-len N] CONFIG..."; exit 2; }
source tools/device/env.sh
LOG=${OUT:-/tmp}/ab_logs; mkdir -p "$LOG"
dl_configure build > "$LOG/configure.log" 2>&1 || { echo "CONFIGURE FAILED"; tail -20 "$LOG/configure.log"; exit 1; }
ninja -C build decodelab > "$LOG/build.log" 2>&1 || { echo "BUILD FAILED"; grep -A6 error "$LOG/build.log" | head -40; exit 1; }
echo "commit $(cat .decodelab-commit 2>/dev/null || echo '(no .decodelab-commit)'), $ROUNDS rounds, gen $GEN"
declare -A RUNS
for r in $(seq 1 "$ROUNDS"); do
  for i in "${!CONFIGS[@]}"; do
    cfg=${CONFIGS[$i]}
    tune=(); for t in $cfg; do tune+=(--tune "$t"); done
    tpot=$(timeout 200 build/bin/decodelab bench --shape xs2 --prompt-len 1024 --gen-len "$GEN" \
      --repeat 1 --kv-dtype fp8 --page-size 32 "${tune[@]}" 2>&1 | sed -n 's/^  TPOT *median \([0-9.]*\) ms.*/\1/p')
    echo "round $r  [${cfg:-default}]  ${tpot:-FAILED}"
    RUNS[$i]="${RUNS[$i]:-} ${tpot:-nan}"
  done
done
echo "== median TPOT (ms) per configuration =="
for i in "${!CONFIGS[@]}"; do
  med=$(printf '%s\n' ${RUNS[$i]} | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}')
  printf '%-8s %s   [%s]\n' "$med" "${RUNS[$i]}" "${CONFIGS[$i]:-default}"
done
