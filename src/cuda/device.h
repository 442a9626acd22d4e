// The one place that asks whether a GPU is usable. Any error from the runtime (no driver, no device,
// driver too old, a sandbox refusing the device) means "no GPU": the binary must load and run its CPU
// paths on machines that have the CUDA toolkit but no driver (CI).
#pragma once

#include <string>

#include "base/status.h"

namespace dl::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int sm_count = 0;
  int major = 0, minor = 0;
  size_t total_memory = 0;
  size_t l2_bytes = 0;
  std::string pci_bus_id;
};

// True when this build contains the CUDA backend.
bool BuiltWithCuda();
// Number of usable devices; 0 on any error. `why` (optional) receives the reason when 0.
int DeviceCount(std::string* why = nullptr);
Result<DeviceInfo> GetDeviceInfo(int device);
// Whether `device` can read `peer`'s memory (cudaDeviceCanAccessPeer); true for the same device,
// false on any error and without CUDA.
bool CanAccessPeer(int device, int peer);
// "13.0" style versions; empty when unknown.
std::string DriverVersionString();
std::string RuntimeVersionString();

}  // namespace dl::cuda
