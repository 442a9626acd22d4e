// Producer/consumer pieces for kernels that stream weights through shared memory with TMA bulk
// copies (sm_90): mbarriers with transaction counts, the bulk copy itself, a PDL wait for a thread
// that is not thread 0 (no timeline stamp), and a barrier over the consumer warps only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"

namespace dl::kernels::dev {

// SMs of the current device (1 where the query fails: the caller then runs one block).
inline int SmCount() {
  static const int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 1;
    return n;
  }();
  return sms;
}
// Whether the current device has TMA bulk copies and mbarrier transaction counts (sm_90 or later);
// any query error: no.
inline bool DeviceHasBulkCopy() {
  static const bool ok = [] {
    int dev = 0, major = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
  }();
  return ok;
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
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(SmemAddr(dst)), "l"(src), "r"(bytes), "r"(SmemAddr(bar)), "l"(policy)
      : "memory");
#endif
}
// The PDL wait without the timeline stamp (the producer lane is not thread 0).
__device__ __forceinline__ void WaitForGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Named barrier 1 over the first kWarps warps only (a producer warp after them may have left).
template <int kWarps>
__device__ __forceinline__ void ConsumerSync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kWarps * 32) : "memory");
}

}  // namespace dl::kernels::dev
