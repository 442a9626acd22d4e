# Sourced (from the repository root, on the GPU machine) by the tools/device scripts: the environment
# every run there needs, and the one CMake configuration they build with. Not a script of its own.
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on the lent machines (KINDS.md)
export LD_LIBRARY_PATH=$PWD/.deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PKG_CONFIG_SYSROOT_DIR=$PWD/.deps
export PKG_CONFIG_PATH=$PWD/.deps/usr/lib/x86_64-linux-gnu/pkgconfig:$PWD/.deps/usr/share/pkgconfig

# dl_configure BUILD_DIR [extra cmake arguments...]: Release, Ninja, the carried .deps, H200 (sm_90).
dl_configure() {
  local dir=$1
  shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" \
    -DCMAKE_CUDA_ARCHITECTURES=90 "$@"
}

# dl_build LOG_DIR TARGET...: dl_configure build, then ninja the targets; on failure prints the
# errors and returns 1, else prints the build time and the commit. Callers: dl_build "$OUT" t1 t2 || exit 1
dl_build() {
  local log=$1 t=$SECONDS
  shift
  if ! dl_configure build > "$log/configure.log" 2>&1; then
    echo "CONFIGURE FAILED"; tail -30 "$log/configure.log"; return 1
  fi
  if ! ninja -C build "$@" > "$log/build.log" 2>&1; then
    echo "BUILD FAILED"; grep -B2 -A6 -E "error" "$log/build.log" | head -80; return 1
  fi
  echo "build: $(( SECONDS - t )) s, commit $(cat .decodelab-commit 2>/dev/null || echo '?')"
}

# dl_summary NAME LOG RC: a gtest run in a few lines: its PASSED/FAILED/SKIPPED totals, the failed
# tests and the first failures with their context.
dl_summary() {
  echo "$1 rc=$3: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$2" | tr '\n' ' ')"
  grep -E "^\[  FAILED  \]" "$2" | head -20
  grep -B1 -A8 "Failure" "$2" | head -60
}
