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
