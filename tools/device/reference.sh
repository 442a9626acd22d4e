#!/usr/bin/env bash
# Runs the transformers reference on the GPU machine and packs everything into one tarball.
#
#   bash tools/device/reference.sh          (from the repo root; the device sets $OUT)
#
# 1. prints python / torch / transformers / tokenizers / safetensors / numpy versions and the GPUs;
# 2. tools/reference/make_goldens.py --out /tmp/ref/golden   (tiny checkpoints + FP32/BF16 goldens),
#    then tools/reference/make_fp8_goldens.py over the committed FP8 checkpoint (tiny_fp8);
# 3. tools/reference/train_tokenizer.py --out /tmp/ref/tokenizer, if that file exists (its failure
#    does not stop the script);
# 4. prints a per-config summary (first step with margin < 1e-3 per prompt, FP32 vs BF16 agreement);
# 5. tars /tmp/ref into "$OUT/reference.tar.gz" (plus "$OUT/summary.txt"), whatever happened above.
#
# Exit status: 0 all good; 1 goldens failed (or their summary check failed); 2 goldens ok but the
# tokenizer step failed. Everything runs offline (HF_HUB_OFFLINE=1).
# Time limits per phase (seconds; the device allows 600 per command): GOLDEN_TIMEOUT (default 330),
# TOKENIZER_TIMEOUT (default 200). PYTHON selects the interpreter (default python3).
set -u
set -o pipefail

cd "$(dirname "$0")/../.." || exit 1
export NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-/tmp/reference_out}
REF=/tmp/ref
GOLDEN_TIMEOUT=${GOLDEN_TIMEOUT:-330}
TOKENIZER_TIMEOUT=${TOKENIZER_TIMEOUT:-200}

rm -rf "$REF"
mkdir -p "$REF" "$OUT_DIR"

echo "== versions =="
"$PY" - <<'EOF' 2>&1 | tee "$REF/versions.txt"
import sys
print("python", sys.version.replace("\n", " "))
for name in ("torch", "transformers", "tokenizers", "safetensors", "numpy"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as e:  # report, never stop here
        print(name, "NOT AVAILABLE:", repr(e))
try:
    import torch
    print("torch.cuda.is_available()", torch.cuda.is_available())
    print("torch.cuda.device_count()", torch.cuda.device_count())
    for i in range(torch.cuda.device_count()):
        print("  cuda:%d %s" % (i, torch.cuda.get_device_name(i)))
except Exception as e:
    print("cuda query failed:", repr(e))
EOF

echo "== goldens =="
timeout --signal=TERM --kill-after=10 "$GOLDEN_TIMEOUT" \
  "$PY" tools/reference/make_goldens.py --out "$REF/golden" 2>&1 | tee "$REF/make_goldens.log"
gold_rc=${PIPESTATUS[0]}
echo "make_goldens.py exit status: $gold_rc"

# The FP8 golden: transformers' dequantising FP8 path over the committed FP8 checkpoint
# (tests/data/golden/tiny_fp8, written by `decodelab make-model --shape tiny --dtype fp8 --fp8-format
# native --fp8-layout all-linear --fp8-scales tensor --seed 7`).
echo "== fp8 golden =="
mkdir -p "$REF/golden/tiny_fp8"
cp tests/data/golden/tiny_fp8/*.json tests/data/golden/tiny_fp8/*.safetensors "$REF/golden/tiny_fp8/" 2>/dev/null
rm -f "$REF/golden/tiny_fp8/goldens_fp32.json"
timeout --signal=TERM --kill-after=10 120 \
  "$PY" tools/reference/make_fp8_goldens.py --model "$REF/golden/tiny_fp8" 2>&1 | tee "$REF/make_fp8_goldens.log"
fp8_rc=${PIPESTATUS[0]}
echo "make_fp8_goldens.py exit status: $fp8_rc"
[ "$gold_rc" = 0 ] && [ "$fp8_rc" != 0 ] && gold_rc=$fp8_rc

tok_rc=skipped
if [ -f tools/reference/train_tokenizer.py ]; then
  echo "== tokenizer =="
  timeout --signal=TERM --kill-after=10 "$TOKENIZER_TIMEOUT" \
    "$PY" tools/reference/train_tokenizer.py --out "$REF/tokenizer" 2>&1 | tee "$REF/train_tokenizer.log"
  tok_rc=${PIPESTATUS[0]}
  echo "train_tokenizer.py exit status: $tok_rc"
else
  echo "== tokenizer: tools/reference/train_tokenizer.py not present, skipped =="
fi

echo "== summary =="
sum_rc=1
if [ -d "$REF/golden" ]; then
  "$PY" tools/reference/make_goldens.py --summarize "$REF/golden" 2>&1 | tee "$REF/summary.txt"
  sum_rc=${PIPESTATUS[0]}
else
  echo "no golden directory" | tee "$REF/summary.txt"
fi
echo "goldens rc=$gold_rc summary rc=$sum_rc tokenizer rc=$tok_rc" | tee -a "$REF/summary.txt"

echo "== packing =="
cp "$REF/summary.txt" "$OUT_DIR/summary.txt" 2>/dev/null
if tar -czf "$OUT_DIR/reference.tar.gz" -C /tmp ref; then
  ls -l "$OUT_DIR"
  tar -tzf "$OUT_DIR/reference.tar.gz" | sed 's/^/  /'
else
  echo "tar failed"
  gold_rc=${gold_rc:-1}
  [ "$gold_rc" = 0 ] && gold_rc=1
fi

if [ "$gold_rc" != 0 ] || [ "$sum_rc" != 0 ]; then
  echo "RESULT: goldens FAILED (make_goldens rc=$gold_rc, summary rc=$sum_rc)"
  exit 1
fi
if [ "$tok_rc" != skipped ] && [ "$tok_rc" != 0 ]; then
  echo "RESULT: goldens ok, tokenizer FAILED (rc=$tok_rc)"
  exit 2
fi
echo "RESULT: ok"
exit 0
