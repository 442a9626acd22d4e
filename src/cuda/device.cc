#include "cuda/device.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

#include <fmt/format.h>

namespace dl::cuda {

#if defined(DECODELAB_HAVE_CUDA)

bool BuiltWithCuda() { return true; }

int DeviceCount(std::string* why) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why) *why = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error so later queries start clean
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device found";
  return n;
}

bool CanAccessPeer(int device, int peer) {
  if (device == peer) return true;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return can != 0;
}

Result<DeviceInfo> GetDeviceInfo(int device) {
  cudaDeviceProp p{};
  cudaError_t err = cudaGetDeviceProperties(&p, device);
  if (err != cudaSuccess) {
    return Unavailable("cannot query CUDA device {}: {}", device, cudaGetErrorString(err));
  }
  DeviceInfo info;
  info.index = device;
  info.name = p.name;
  info.sm_count = p.multiProcessorCount;
  info.major = p.major;
  info.minor = p.minor;
  info.total_memory = p.totalGlobalMem;
  info.l2_bytes = static_cast<size_t>(p.l2CacheSize);
  char bus[32] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) == cudaSuccess) info.pci_bus_id = bus;
  return info;
}

static std::string VersionString(int v) {
  return v > 0 ? fmt::format("{}.{}", v / 1000, (v % 1000) / 10) : std::string();
}

std::string DriverVersionString() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) return {};
  return VersionString(v);
}

std::string RuntimeVersionString() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return {};
  return VersionString(v);
}

#else

bool BuiltWithCuda() { return false; }
int DeviceCount(std::string* why) {
  if (why) *why = "this build of decodelab has no CUDA backend";
  return 0;
}
bool CanAccessPeer(int, int) { return false; }
Result<DeviceInfo> GetDeviceInfo(int device) {
  return Unavailable("this build of decodelab has no CUDA backend (device {})", device);
}
std::string DriverVersionString() { return {}; }
std::string RuntimeVersionString() { return {}; }

#endif

}  // namespace dl::cuda
