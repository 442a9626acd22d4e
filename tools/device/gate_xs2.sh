#!/usr/bin/env bash
# The lab's page-size gate on a GPU (issue 6): control = KV page 64, candidate = KV page 32, same
# binary, on the XS.2 shape with 8 layers generated on the device, with the NCCL probe over every GPU.
#   usage (repo root, on the GPU machine, .deps carried): bash tools/device/gate_xs2.sh
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
W=/tmp/gate; rm -rf "$W"; mkdir -p "$W" "$RESULTS"
source tools/device/env.sh
t0=$(date +%s)
dl_configure build > "$W/configure.log" 2>&1 || { tail -30 "$W/configure.log"; exit 1; }
ninja -C build decodelab > "$W/build.log" 2>&1 || { grep -A5 error "$W/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
B=$PWD/build/bin/decodelab
ngpu=$(nvidia-smi -L | wc -l)
$B lab lock --out "$W/control.lock" && $B lab lock --out "$W/candidate.lock"
cat > "$W/plan.json" <<JSON
{"format": "decodelab-lab-plan",
 "model": {"shape": "xs2", "seed": 0, "num_layers": 8},
 "control":   {"binary": "$B", "lock": "control.lock",   "flags": ["--page-size", "64"]},
 "candidate": {"binary": "$B", "lock": "candidate.lock", "flags": ["--page-size", "32"]},
 "probe": {"transport": "nccl", "ranks": $ngpu}}
JSON
timeout 420 $B lab gate "$W/plan.json" --backend cuda --runs-dir "$W/runs" --cache-dir "$W/cache" \
  > "$W/gate.log" 2>&1; rc=$?
tail -40 "$W/gate.log"
$B lab runs --runs-dir "$W/runs" 2>&1 | tail -12
$B lab report --runs-dir "$W/runs" --out "$W/report.html" > /dev/null 2>&1
cp "$W"/runs/gates/*/gate.json "$RESULTS/" 2>/dev/null
cp "$W/report.html" "$RESULTS/" 2>/dev/null
tar czf "$RESULTS/gate_logs.tgz" -C "$W" --exclude cache .
echo "gate rc=$rc; total $(( $(date +%s) - t0 )) s"
