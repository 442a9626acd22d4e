#!/usr/bin/env bash
# The README's main job: installs dependencies, builds, generates the embedded default tiny model (if
# absent) and runs greedy generation on it (GPU if usable, else CPU), printing tokens and speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
MODEL_DIR=${DECODELAB_HOME:-$HOME/.cache/decodelab}/models/tiny-seed0
if [ ! -f "$MODEL_DIR/config.json" ]; then
  build/bin/decodelab make-model --shape tiny --seed 0 --out "$MODEL_DIR"
fi
build/bin/decodelab inspect --model "$MODEL_DIR"
build/bin/decodelab generate --model "$MODEL_DIR" --prompt-ids 2,17,42,99,5,301,7,8 \
  --max-tokens 64 --ignore-eos
