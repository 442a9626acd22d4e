// Device-side random fill for tests and benchmarks (multi-GB tensors without host transfers).
#include "base/rng.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

__global__ void FillRandomBf16Kernel(bf16* dst, size_t n, uint64_t key, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = FloatToBf16Bits(scale * NormalAt(key, i));
  }
}

}  // namespace dev

Status FillRandomBf16(bf16* dst, size_t n, uint64_t key, float scale, Stream stream) {
  if (!dst) return InvalidArgument("fill_random_bf16: null destination");
  if (n == 0) return Status::Ok();
  const size_t blocks = std::min<size_t>((n + 255) / 256, 4096);
  dev::FillRandomBf16Kernel<<<blocks, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(dst, n, key,
                                                                                      scale);
  DL_KERNEL_LAUNCH_CHECK("fill_random_bf16");
  return Status::Ok();
}

}  // namespace dl::kernels
