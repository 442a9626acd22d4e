#!/usr/bin/env bash
# Writes .decodelab-commit (git-ignored via .git/info/exclude or .gitignore) for a tree copied to the
# GPU machine: "<12 hex>" or "<12 hex>-dirty". cmake/BuildInfo.cmake prefers it over git metadata.
set -euo pipefail
cd "$(dirname "$0")/../.."
c=$(git rev-parse --short=12 HEAD)
git diff --quiet HEAD -- . && echo "$c" > .decodelab-commit || echo "$c-dirty" > .decodelab-commit
cat .decodelab-commit
