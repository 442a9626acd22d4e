#!/usr/bin/env bash
# The README's test command: installs dependencies, builds, and runs every test with CTest. GPU tests
# skip with a visible message where no GPU is usable.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
BUILD_DIR=${BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" --timeout 600
