#!/usr/bin/env bash
# Issues 23 (two GPUs) and 24 (four and eight) on a machine with 2+ GPUs (nvidia-h200-x2/-x4/-x8), as
# few calls as possible. TP = every visible GPU unless --tp N. Steps, each skippable so the work can
# be split over calls (the build stays on a warm machine):
#   1. probe   `decodelab probe --ranks TP --transport nccl` (PROBE_RESULT=PASS clean_teardowns=TP/TP),
#              and the same with an injected hang (the supervisor must end it: exit 4)
#   2. comm    `bench comm --tp TP`: 4 KB - 16 MB all-reduce in a CUDA graph, one-shot vs two-shot vs NCCL
#   3. xs2     `bench --shape xs2` BF16 weights, FP8 KV, prompt 1,024 / generate 1,024: --tp 1, then
#              --tp TP in both embedding modes (per-rank topology: replicated has one collective fewer),
#              then --tp TP with tp_two_shot_min_kb=0 (every all-reduce one-shot) for the crossover
#   4. s21     `inspect --shape s21 --tp TP` (per-rank shapes) and `bench --shape s21 --tp TP` with FP8
#              export weights (every layer that fits: --s21-layers N to cut)
#   5. gate    `lab gate` on XS.2 (8 layers) at TP: control vocab-parallel, candidate replicated
#   6. serve   `bench serve --shape xs2 --tp TP` at concurrency 1 and 64
# Logs and JSON under $OUT (one tarball); a summary last. NCCL_NVLS_ENABLE=0 (env.sh).
#   usage (repo root, on the GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/multi_gpu_check.sh [--tp N] [--skip-probe] [--skip-comm] [--skip-xs2]
#          [--skip-s21] [--skip-gate] [--skip-serve] [--s21-layers N] [--gen-len N]
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
W=/tmp/multi_gpu; rm -rf "$W"; mkdir -p "$W" "$RESULTS"
source tools/device/env.sh
declare -A RUN=([probe]=1 [comm]=1 [xs2]=1 [s21]=1 [gate]=1 [serve]=1)
TP=0; S21_LAYERS=""; GEN=1024
while [ $# -gt 0 ]; do
  case "$1" in
    --tp) shift; TP=$1 ;;
    --skip-*) k=${1#--skip-}; [ -n "${RUN[$k]+x}" ] || { echo "unknown flag $1"; exit 2; }; RUN[$k]=0 ;;
    --s21-layers) shift; S21_LAYERS="--num-layers $1" ;;
    --gen-len) shift; GEN=$1 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$TP" -gt 0 ] || TP=$ngpu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$W/gpu.txt" 2>&1
nvidia-smi topo -m > "$W/topo.txt" 2>&1
echo "GPUs: $ngpu, TP $TP"
if [ "$ngpu" -lt 2 ] || [ "$TP" -lt 2 ] || [ "$TP" -gt "$ngpu" ]; then
  echo "needs 2+ GPUs and TP <= GPUs (the one-GPU two-rank run is tp_check.sh)"; exit 2
fi
dl_build "$W" decodelab || exit 1
B=$PWD/build/bin/decodelab
XS2=(--shape xs2 --backend cuda --kv-dtype fp8 --page-size 32 --prompt-len 1024 --gen-len "$GEN" --repeat 1)
tpot() { grep -E "^  (TPOT|device step|TTFT)|error|Error" "$1" | head -4; }

if [ "${RUN[probe]}" = 1 ]; then
  timeout 180 $B probe --ranks "$TP" --transport nccl --bytes 4096 --iters 200 --log-dir "$W/probe" > "$W/probe.log" 2>&1
  echo "probe rc=$?: $(grep -h PROBE_RESULT "$W/probe.log" | tail -1)"
  timeout 180 $B probe --ranks "$TP" --transport nccl --bytes 4096 --iters 20 --timeout-s 10 \
    --inject all_reduce-done:1:hang --log-dir "$W/probe-hang" > "$W/probe_hang.log" 2>&1
  echo "probe with rank 1 hung rc=$? (4 expected): $(grep -h PROBE_RESULT "$W/probe_hang.log" | tail -1)"
  pgrep -f __probe-rank > /dev/null && echo "ORPHAN PROBE RANKS LEFT" || echo "no probe rank processes left"
fi
if [ "${RUN[comm]}" = 1 ]; then
  timeout 300 $B bench comm --tp "$TP" --sizes 4K,16K,64K,1M,4M,16M --iters 200 --json-out "$W/bench_comm.json" \
    > "$W/bench_comm.log" 2>&1
  echo "bench comm --tp $TP rc=$?:"; grep -E "^  [0-9]|size|settings" "$W/bench_comm.log"
fi
if [ "${RUN[xs2]}" = 1 ]; then
  for v in "tp1:--tp 1" "replicated:--tp $TP --embedding replicated" "vocab:--tp $TP --embedding vocab-parallel" \
           "oneshot_only:--tp $TP --tune tp_two_shot_min_kb=0"; do
    name=${v%%:*}
    timeout 420 $B bench "${XS2[@]}" ${v#*:} --json-out "$W/xs2_$name.json" > "$W/xs2_$name.log" 2>&1
    echo "bench xs2 ${v#*:} rc=$?:"; tpot "$W/xs2_$name.log"
  done
fi
if [ "${RUN[s21]}" = 1 ]; then
  $B inspect --shape s21 --tp "$TP" > "$W/inspect_s21.log" 2>&1
  echo "inspect --shape s21 --tp $TP rc=$?:"; grep -iE "rank|q=|kv=" "$W/inspect_s21.log" | head -12
  timeout 540 $B bench --shape s21 $S21_LAYERS --shape-dtype fp8 --fp8-layout export --backend cuda --kv-dtype fp8 \
    --page-size 32 --prompt-len 1024 --gen-len 256 --repeat 1 --tp "$TP" --json-out "$W/s21.json" > "$W/s21.log" 2>&1
  echo "bench s21 fp8 --tp $TP $S21_LAYERS rc=$?:"; tpot "$W/s21.log"
fi
if [ "${RUN[gate]}" = 1 ]; then
  $B lab lock --out "$W/control.lock" && $B lab lock --out "$W/candidate.lock"
  cat > "$W/plan.json" <<JSON
{"format": "decodelab-lab-plan",
 "model": {"shape": "xs2", "seed": 0, "num_layers": 8},
 "control":   {"binary": "$B", "lock": "control.lock",   "flags": ["--tp", "$TP", "--embedding", "vocab-parallel"]},
 "candidate": {"binary": "$B", "lock": "candidate.lock", "flags": ["--tp", "$TP", "--embedding", "replicated"]},
 "probe": {"transport": "nccl", "ranks": $TP}}
JSON
  timeout 540 $B lab gate "$W/plan.json" --backend cuda --runs-dir "$W/runs" --cache-dir "$W/cache" > "$W/gate.log" 2>&1
  echo "lab gate (vocab-parallel -> replicated, --tp $TP) rc=$?:"; tail -15 "$W/gate.log"
fi
if [ "${RUN[serve]}" = 1 ]; then
  for c in 1 64; do
    n=$(( c == 1 ? 8 : 256 ))
    timeout 540 $B bench serve --shape xs2 --backend cuda --kv-dtype fp8 --page-size 32 --tp "$TP" --concurrency $c \
      --num-prompts $n --input-len 1024 --output-len 256 --json-out "$W/serve_c$c.json" > "$W/serve_c$c.log" 2>&1
    echo "bench serve --tp $TP --concurrency $c rc=$?:"; grep -iE "throughput|tpot|ttft|error" "$W/serve_c$c.log" | head -8
  done
fi
python3 - "$W" <<'PY'
import json, sys, glob, os
d = sys.argv[1]
for f in sorted(glob.glob(f"{d}/xs2_*.json")) + glob.glob(f"{d}/s21.json"):
    try:
        j = json.load(open(f))
        b = j.get("backend", {})
        sigs = [t.get("signature") for t in b.get("topology", [])]
        print(f"{os.path.basename(f)}: topology {sigs}")
    except Exception as e:
        print(f"{os.path.basename(f)}: {e}")
PY
echo "total: $(( $(date +%s) - t0 )) s"
tar czf "$RESULTS/multi_gpu_logs.tgz" -C /tmp --exclude cache multi_gpu 2>/dev/null
