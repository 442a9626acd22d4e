#!/usr/bin/env bash
# The README's main job: installs dependencies, builds, and runs the lab on the embedded default model:
# generates the tiny model if absent, records its teacher, runs a screen (GPU backend if one is usable,
# else the CPU reference), prints the check table and speeds, writes the HTML report and says where.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
HOME_DIR=${DECODELAB_HOME:-$HOME/.cache/decodelab}
RUNS_DIR=${DECODELAB_RUNS:-$HOME_DIR/runs}
mkdir -p "$RUNS_DIR"
build/bin/decodelab lab screen --cache-dir "$HOME_DIR" --runs-dir "$RUNS_DIR"
build/bin/decodelab lab report --runs-dir "$RUNS_DIR" --out "$RUNS_DIR/report.html"
echo "report: $RUNS_DIR/report.html (runs and ledger.sqlite in $RUNS_DIR)"
