#!/usr/bin/env bash
# Configures and builds decodelab into build/ (Release). CUDA parts are built where nvcc exists
# (/usr/local/cuda/bin/nvcc), for sm_90 unless CMAKE_CUDA_ARCHITECTURES says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
EXTRA=()
if [ "${CI:-}" = "true" ]; then
  # CI has nvcc but no GPU: compile the CUDA code, but only a small attention preset subset, so the
  # build stays fast on 2 cores (the GPU machine builds the full default set).
  EXTRA+=("-DDECODELAB_ATTN_PRESETS=attn_d32_g2_p16_bf16_global;attn_d32_g4_p16_fp8_sliding")
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "${EXTRA[@]}" "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
