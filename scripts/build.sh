#!/usr/bin/env bash
# Configures and builds decodelab into build/ (Release). CUDA parts are built where nvcc exists
# (/usr/local/cuda/bin/nvcc), for sm_90 unless CMAKE_CUDA_ARCHITECTURES says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
