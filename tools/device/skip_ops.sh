#!/usr/bin/env bash
# In-step cost of each op family on the XS.2 shape: `bench --skip-ops F` for each family F against a
# baseline in the same call (same settings, one run each, 1,024-token prompt, 256 generated), then a
# table of TPOT and the difference to the baseline. A family's difference is what removing it saves
# inside the real step (its own time plus what it delays), which the isolated kernel bench does not
# show. Run after a gpu_all build (reuses build/), from the repository root on the GPU machine.
set -uo pipefail
OUT=${OUT:-/tmp/skip_ops}
mkdir -p "$OUT"
source tools/device/env.sh
if [ ! -x build/bin/decodelab ]; then
  dl_configure build > "$OUT/configure.log" 2>&1 && ninja -C build decodelab > "$OUT/build.log" 2>&1 ||
    { echo "build failed (see $OUT)"; exit 1; }
fi
run() {  # $1 = label, rest = extra bench flags
  local label=$1; shift
  timeout 120 build/bin/decodelab bench --shape xs2 --prompt-len 1024 --gen-len 256 --repeat 1 \
    --kv-dtype fp8 --page-size 32 --json-out "$OUT/$label.json" "$@" > "$OUT/$label.log" 2>&1 ||
    echo "$label: bench failed (see $OUT/$label.log)"
}
run baseline
for f in norm qkvg rope attention o_proj moe; do run "$f" --skip-ops "$f"; done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def tpot(label):
    p = os.path.join(out, label + ".json")
    return json.load(open(p))["tpot_ms_median"] if os.path.exists(p) else None
base = tpot("baseline")
print(f"{'left out':<12} {'TPOT ms':>9} {'saves ms':>9} {'saves us per layer (/40)':>26}")
for label in ["baseline", "norm", "qkvg", "rope", "attention", "o_proj", "moe"]:
    t = tpot(label)
    if t is None or base is None:
        print(f"{label:<12} {'-':>9}")
        continue
    print(f"{label:<12} {t:9.4f} {base - t:9.4f} {(base - t) * 1000 / 40:26.2f}")
PY
