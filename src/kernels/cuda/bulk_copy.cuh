// Producer/consumer pieces for kernels that stream weights through shared memory with TMA bulk
// copies (sm_90): the device facts that decide whether they apply, mbarriers with transaction
// counts, the bulk copy itself, a ring's layout and set-up, the consumers' dot over a row in shared
// memory, and a barrier over the consumer warps only.
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
inline bool DeviceHasClusters() { return CurrentDeviceInfo().major >= 9; }  // thread-block clusters, DSMEM
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
// sm_90's limit on one block's shared memory, dynamic included.
constexpr size_t kMaxBlockSmem = 227 * 1024;
// bytes rounded up to a multiple of `to`: offsets of the regions a kernel carves out of its dynamic
// shared memory (16 for 16-byte vector access, 128 for bulk-copy destinations).
constexpr size_t AlignUp(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }
// Where a ring of bulk-copy slots starts after its header of 2 x max_slots mbarriers (full ones, then
// empty ones): 128-byte aligned, like the copies' destinations.
constexpr size_t RingOffset(int max_slots) { return AlignUp(2 * static_cast<size_t>(max_slots) * sizeof(uint64_t), 128); }
// Every thread of the block calls this: thread 0 initialises `slots` pairs of mbarriers, full[i]
// expecting `copies` arrivals (one per bulk copy into slot i, each with its bytes) and empty[i]
// `consumer_warps` (one per consumer warp done with the slot), and fences them for the async proxy;
// then the block synchronises.
__device__ __forceinline__ void InitRing(uint64_t* full, uint64_t* empty, int slots, uint32_t copies,
                                         uint32_t consumer_warps) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < slots; ++i) {
      MbarInit(full + i, copies);
      MbarInit(empty + i, consumer_warps);
    }
    FenceBarrierInit();
  }
  __syncthreads();
}
// A consumer lane's part of the dot of a BF16 row and x, both in shared memory: 16-byte chunks
// c = begin + lane, begin + lane + 32, ... below end, FP32 FMAs in chunk and element order (the
// register kernels' per-lane order, so a warp sum of it gives their bits).
__device__ __forceinline__ float LaneDotShared(const uint4* w_row, const uint4* x, int begin, int end, int lane) {
  float acc = 0.0f;
  for (int c = begin + lane; c < end; c += 32) {
    float wf[8], xf[8];
    Bf16x8ToFloat(w_row[c], wf);
    Bf16x8ToFloat(x[c], xf);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(wf[e], xf[e], acc);
  }
  return acc;
}
// Named barrier 1 over the first kWarps warps only (a producer warp after them may have left).
template <int kWarps>
__device__ __forceinline__ void ConsumerSync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kWarps * 32) : "memory");
}

}  // namespace dl::kernels::dev
