#include "comm/device_reduce.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <fmt/format.h>

namespace dl::comm {

namespace {

struct RankPointers {
  const void* p[kMaxReduceRanks];
};

__device__ __forceinline__ float Load(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float Load(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }
__device__ __forceinline__ void Store(float* y, int64_t i, float v) { y[i] = v; }
__device__ __forceinline__ void Store(__nv_bfloat16* y, int64_t i, float v) { y[i] = __float2bfloat16_rn(v); }

// One thread per element (grid-stride): the fixed rank order is the whole point, so no vector
// tricks that would change it; __fadd_rn keeps the compiler from contracting or reordering.
template <typename T>
__global__ void SumInRankOrderKernel(RankPointers in, int n, T* out, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = Load(static_cast<const T*>(in.p[0]), i);
    for (int r = 1; r < n; ++r) acc = __fadd_rn(acc, Load(static_cast<const T*>(in.p[r]), i));
    Store(out, i, acc);
  }
}

}  // namespace

Status LaunchSumInRankOrder(const std::vector<const void*>& inputs, void* out, int64_t count, DeviceElem elem,
                            CUstream_st* stream) {
  if (inputs.empty() || inputs.size() > kMaxReduceRanks) {
    return InvalidArgument("rank-order sum over {} ranks (1 to {})", inputs.size(), kMaxReduceRanks);
  }
  if (count <= 0) return Status::Ok();
  RankPointers p{};
  for (size_t r = 0; r < inputs.size(); ++r) p.p[r] = inputs[r];
  constexpr int kThreads = 256;
  const int64_t blocks64 = (count + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(blocks64 < 65535 ? blocks64 : 65535);
  const int n = static_cast<int>(inputs.size());
  if (elem == DeviceElem::kF32) {
    SumInRankOrderKernel<float><<<blocks, kThreads, 0, stream>>>(p, n, static_cast<float*>(out), count);
  } else {
    SumInRankOrderKernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(p, n, static_cast<__nv_bfloat16*>(out), count);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Internal("rank-order sum of {} {} over {} ranks: {}", count, DeviceElemName(elem), n,
                                        cudaGetErrorString(e));
  return Status::Ok();
}

}  // namespace dl::comm
