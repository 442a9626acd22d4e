#include "cuda/nvml.h"

#include <dlfcn.h>

namespace dl::cuda {

Result<std::string> NvmlDriverVersion() {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return Unavailable("libnvidia-ml.so.1 not found: {}", dlerror());
  using InitFn = int (*)();
  using VersionFn = int (*)(char*, unsigned);
  using ShutdownFn = int (*)();
  auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
  auto version = reinterpret_cast<VersionFn>(dlsym(lib, "nvmlSystemGetDriverVersion"));
  auto shutdown = reinterpret_cast<ShutdownFn>(dlsym(lib, "nvmlShutdown"));
  if (!init || !version || !shutdown) {
    dlclose(lib);
    return Unavailable("libnvidia-ml.so.1 lacks nvmlInit_v2 / nvmlSystemGetDriverVersion");
  }
  if (int rc = init(); rc != 0) {
    dlclose(lib);
    return Unavailable("nvmlInit failed with NVML error {}", rc);
  }
  char buf[96] = {0};
  const int rc = version(buf, sizeof(buf));
  shutdown();
  dlclose(lib);
  if (rc != 0) return Unavailable("nvmlSystemGetDriverVersion failed with NVML error {}", rc);
  return std::string(buf);
}

}  // namespace dl::cuda
