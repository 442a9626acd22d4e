// Producer/consumer pieces for kernels that stream weights through shared memory with TMA bulk
// copies (sm_90): the device facts that decide whether they apply, mbarriers with transaction
// counts, the bulk copy itself, and a barrier over the consumer warps only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device.h"
#include "kernels/cuda/device_utils.cuh"

namespace dl::kernels::dev {

// The current device's facts (cuda::GetDeviceInfo), read once; a failed query reads as 1 SM and no
// sm_90 features, so callers take their plain paths.
inline const cuda::DeviceInfo& CurrentDeviceInfo() {
  static const cuda::DeviceInfo info = [] {
    int dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess) {
      if (auto i = cuda::GetDeviceInfo(dev); i.ok()) return *i;
    }
    cuda::DeviceInfo none;
    none.sm_count = 1;
    return none;
  }();
  return info;
}
inline int SmCount() { return CurrentDeviceInfo().sm_count; }
// Whether the current device has TMA bulk copies and mbarrier transaction counts (sm_90 or later).
inline bool DeviceHasBulkCopy() { return CurrentDeviceInfo().major >= 9; }
// The fence after a thread has initialised a block's mbarriers, so the bulk copies (the async proxy)
// see them; the block synchronises after it.
__device__ __forceinline__ void FenceBarrierInit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  }
#endif
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar)) : "memory");
#endif
}
// One bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into
// this block's shared memory; completion adds the bytes to `bar`'s transaction count, which this
// thread first raises by the same amount (arrive + expect_tx). Evict-first in L2, like LoadStreaming.
__device__ __forceinline__ void BulkCopyToShared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)), "r"(bytes) : "memory");
  const uint64_t policy = EvictFirstPolicy();
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(SmemAddr(dst)), "l"(src), "r"(bytes), "r"(SmemAddr(bar)), "l"(policy)
      : "memory");
#endif
}
// Named barrier 1 over the first kWarps warps only (a producer warp after them may have left).
template <int kWarps>
__device__ __forceinline__ void ConsumerSync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kWarps * 32) : "memory");
}

}  // namespace dl::kernels::dev
