#!/usr/bin/env bash
# Runs the OpenAI Node SDK test against `decodelab serve` on an ephemeral loopback port.
# Usage: run_sdk_test.sh <decodelab binary> <scratch dir>. Exit 77 (skipped) without node/npm or
# when `npm ci` cannot fetch the pinned packages.
set -euo pipefail
BIN=$1
SCRATCH=$2
HERE=$(cd "$(dirname "$0")" && pwd)
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "SKIPPED: node/npm not found; the OpenAI Node SDK test did not run"
  exit 77
fi
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"
cp "$HERE/package.json" "$HERE/package-lock.json" "$HERE/sdk_test.mjs" "$SCRATCH/"
if ! (cd "$SCRATCH" && npm ci --no-audit --no-fund --loglevel=error); then
  echo "SKIPPED: npm ci failed (no registry access?); the OpenAI Node SDK test did not run"
  exit 77
fi
MODEL="$SCRATCH/model"
"$BIN" make-model --shape tiny --seed 3 --out "$MODEL" >/dev/null
# make-model may not write a chat template yet: give the test model a small Laguna-shaped one.
if [ ! -f "$MODEL/chat_template.jinja" ]; then
  cat > "$MODEL/chat_template.jinja" <<'TEMPLATE'
{{- bos_token -}}<system>{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}</system>
{% for m in messages %}{% if m.role == 'user' %}<user>{{ m.content }}</user>
{% elif m.role == 'assistant' %}<assistant></think>{{ m.content }}</assistant>
{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant></think>{% endif %}
TEMPLATE
fi
"$BIN" serve --model "$MODEL" --backend cpu --host 127.0.0.1 --port 0 --api-key sdk-test-key \
  --max-seq-len 256 >"$SCRATCH/serve.out" 2>"$SCRATCH/serve.err" &
PID=$!
trap 'kill -TERM $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
URL=""
for _ in $(seq 1 200); do
  URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$SCRATCH/serve.out" || true)
  [ -n "$URL" ] && break
  if ! kill -0 $PID 2>/dev/null; then cat "$SCRATCH/serve.err"; exit 1; fi
  sleep 0.1
done
[ -n "$URL" ] || { echo "server did not become ready"; cat "$SCRATCH/serve.err"; exit 1; }
(cd "$SCRATCH" && BASE_URL="$URL/v1" API_KEY=sdk-test-key node sdk_test.mjs)
kill -TERM $PID
wait $PID
echo "server stopped cleanly on SIGTERM"
trap - EXIT
