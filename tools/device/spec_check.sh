#!/usr/bin/env bash
# Speculative decoding (issue 20) in one device-machine call: build, the GPU exactness test (verify rows
# equal decode rows: speculative output == plain decoding token for token and logit for logit, alone and
# in a scheduler batch, FP8/BF16 caches, graphs/eager), then on the XS.2 shape (BF16 weights, FP8 KV,
# page 32): the verify step's device time against one decode step for K in {2,4,8,15} at batch 1 and 8,
# and `generate` / `bench` on a repetitive code-like prompt with and without the n-gram drafter (tokens
# must be identical; tok/s and acceptance are printed), `bench serve` with and without it (acceptance beside
# tok/s), and lab screens of the default tiny model, plain and --spec ngram, against one plain teacher.
# Logs and JSON under $OUT.
#   usage (repo root, GPU machine, .deps and .decodelab-commit carried):
#     bash tools/device/spec_check.sh [--skip-tests] [--gen-len N]
set -uo pipefail
RESULTS=${OUT:-/tmp/out}
OUT=/tmp/spec_check; rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
source tools/device/env.sh
GEN=512; TESTS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --gen-len) shift; GEN=$1 ;;
    --skip-tests) TESTS=0 ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
dl_build "$OUT" decodelab cuda_runner_test || exit 1
B=build/bin/decodelab
if [ "$TESTS" = 1 ]; then
  timeout 300 ./build/tests/gpu/cuda_runner_test --gtest_filter='*Speculative*' > "$OUT/spec_gpu_test.log" 2>&1
  echo "spec gpu test rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/spec_gpu_test.log" | tr '\n' ' ')"
  grep -B1 -A6 "Failure" "$OUT/spec_gpu_test.log" | head -40
fi
COMMON=(--shape xs2 --kv-dtype fp8 --page-size 32)
timeout 240 $B bench "${COMMON[@]}" --verify-cost --prompt-len 1024 --verify-k 2,4,8,15 --verify-batch 1,8 \
  --json-out "$OUT/verify_cost.json" > "$OUT/verify_cost.log" 2>&1
echo "verify cost rc=$?:"; grep -vE "^(measuring|copy bandwidth|backend:)" "$OUT/verify_cost.log" | head -20
PROMPT=tools/bench/prompts/repetitive_code.txt
for spec in none ngram; do
  timeout 120 $B generate "${COMMON[@]}" --prompt "$(cat $PROMPT)" --max-tokens "$GEN" --ignore-eos --spec "$spec" \
    --spec-k 4 --json > "$OUT/generate_$spec.json" 2> "$OUT/generate_$spec.log"
  echo "generate --spec $spec rc=$?: $(grep -E '^(generated|speculative)' "$OUT/generate_$spec.log" | tr '\n' ' ')"
done
python3 - "$OUT" <<'EOF'
import json, sys
d = sys.argv[1]
a = json.loads(open(f"{d}/generate_none.json").read().strip().splitlines()[-1])
b = json.loads(open(f"{d}/generate_ngram.json").read().strip().splitlines()[-1])
same = a["tokens"] == b["tokens"]
print(f"generate exactness: tokens {'IDENTICAL' if same else 'DIFFER'} ({len(a['tokens'])} tokens); "
      f"decode tok/s plain {a['decode_tok_s']:.1f}, ngram {b['decode_tok_s']:.1f} "
      f"({b['decode_tok_s'] / a['decode_tok_s']:.2f}x); ngram mean acceptance length "
      f"{b['speculative'].get('mean_acceptance_length', 0):.2f}")
EOF
for spec in "none" "ngram --spec-k 4" "ngram --spec-k 8"; do
  tag=$(echo "$spec" | tr -d ' -')
  timeout 150 $B bench "${COMMON[@]}" --prompt-file "$PROMPT" --gen-len "$GEN" --repeat 2 --spec $spec \
    --json-out "$OUT/bench_$tag.json" > "$OUT/bench_$tag.log" 2>&1
  echo "bench --spec $spec rc=$?:"; grep -E "^  (model|throughput|decode|speculative)" "$OUT/bench_$tag.log"
  grep -iE "error|fail" "$OUT/bench_$tag.log" | head -5
done
# Over HTTP: bench serve on the same prompt, plain and n-gram; the speculative one must print vLLM's
# Speculative Decoding block (acceptance beside tok/s) and write the spec_decode_* keys.
for spec in none ngram; do
  timeout 240 $B bench serve "${COMMON[@]}" --prompt-file "$PROMPT" --output-len "$GEN" --num-prompts 4 \
    --concurrency 1 --spec $spec --spec-k 4 --serve-log "$OUT/bench_serve_$spec.server.log" \
    --json-out "$OUT/bench_serve_$spec.json" > "$OUT/bench_serve_$spec.log" 2>&1
  echo "bench serve --spec $spec rc=$?: $(grep -E '^(Output token throughput|Median TPOT|Acceptance (rate|length))' \
    "$OUT/bench_serve_$spec.log" | tr -s ' ' | tr '\n' ';')"
done
# The lab on the GPU (default tiny model, its own cache): the plain screen and the n-gram screen must
# both PASS against the same plain-decoding teacher; the speculative one prints its acceptance.
LAB=(lab screen --backend cuda --cache-dir "$OUT/lab-cache" --runs-dir "$OUT/lab-runs")
timeout 300 $B "${LAB[@]}" --label plain > "$OUT/lab_plain.log" 2>&1
echo "lab screen plain rc=$?: $(grep -E 'verdict|exactness|decode tok/s' "$OUT/lab_plain.log" | tr -s ' ' | tr '\n' ';')"
timeout 300 $B "${LAB[@]}" --spec ngram --spec-k 4 > "$OUT/lab_ngram.log" 2>&1
echo "lab screen --spec ngram rc=$?: $(grep -E 'verdict|exactness|speculative:|decode tok/s' "$OUT/lab_ngram.log" | tr -s ' ' | tr '\n' ';')"
$B lab compare --runs-dir "$OUT/lab-runs" plain screen-spec-ngram 2>&1 | tail -1
echo "total: $(( $(date +%s) - t0 )) s"
tar -czf "$RESULTS/spec_check_logs.tgz" -C /tmp spec_check 2>/dev/null
