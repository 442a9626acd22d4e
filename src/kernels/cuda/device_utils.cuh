// Small device helpers shared by the kernels: BF16/FP8 conversions with the reference's rounding,
// 16-byte vector loads, and fixed-order warp reductions (xor butterflies: every lane ends with the
// same value, computed in the same order on every run).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "base/status.h"
#include "cuda/check.h"
#include "kernels/common.h"
#include "kernels/ops.h"
#include "kernels/cuda/timeline.cuh"

namespace dl::kernels::dev {


__device__ __forceinline__ float Bf16BitsToFloat(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
__device__ __forceinline__ uint16_t FloatToBf16Bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
// The value after a round trip through BF16 (the reference's "compute in FP32, store BF16").
__device__ __forceinline__ float RoundBf16(float f) {
  return __bfloat162float(__float2bfloat16_rn(f));
}
__device__ __forceinline__ float Fp8ToFloat(uint8_t v) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}
// Round to nearest even, saturating to +-448 (matches dl::FloatToFp8E4M3).
__device__ __forceinline__ uint8_t FloatToFp8(float f) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
}

// 8 BF16 values (16 bytes) -> float.
__device__ __forceinline__ void Bf16x8ToFloat(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
// 4 FP8 codes packed in a word (byte b = element b) -> float, two codes per conversion instruction
// (exact: every E4M3 value is a half, and every half a float).
__device__ __forceinline__ void Fp8x4ToFloat(uint32_t w, float* f) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}
// 8 FP8 codes (8 bytes) -> float (code value; the caller applies the scale).
__device__ __forceinline__ void Fp8x8ToFloat(const uint2& u, float* f) {
  Fp8x4ToFloat(u.x, f);
  Fp8x4ToFloat(u.y, f + 4);
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Exclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024 threads): returns
// this thread's offset and sets *total.
__device__ __forceinline__ int BlockExclusiveScan(int v, int* total) {
  __shared__ int s_warp[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  __syncthreads();  // s_warp may still be read by an earlier call
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    if (lane < warps) s_warp[lane] = w;  // inclusive scan of the warp totals
  }
  __syncthreads();
  *total = s_warp[warps - 1];
  return incl - v + (warp > 0 ? s_warp[warp - 1] : 0);
}

// ---- Programmatic dependent launch (sm_90+; no-ops on older targets and when launched plainly).
// Every kernel of the decode step is launched with LaunchDependent and follows two rules:
//   1. AllowDependents() first: the next kernel's blocks may be scheduled as soon as all of this
//      kernel's blocks run, so their prologue (weight loads, which depend on nothing) overlaps
//      this kernel's tail instead of following it (or, for a kernel whose successor's prologue
//      should not run beside its own wait, just after that wait: AllowDependentsAtStart(late) +
//      WaitReleasing(late), Tuning::late_release);
//   2. WaitForPrerequisites() in every block before the first read of anything an earlier kernel
//      wrote (and before any write another kernel reads). It returns once the previous kernel has
//      completed and its writes are visible; that kernel waited on its own predecessor before it
//      completed, so the ordering is transitive along the stream.
__device__ __forceinline__ void AllowDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The wait itself, without the timeline stamp: for a thread other than thread 0 (a producer warp's lane).
__device__ __forceinline__ void WaitForGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void WaitForPrerequisites() {
  WaitForGrid();
  DL_TIMELINE_WAITED();
}
// Rule 1 with a movable release point (Tuning::late_release): AllowDependentsAtStart(late)
// first, WaitReleasing(late) as the wait, so a late kernel lets its successor launch only once its
// own predecessor has completed.
__device__ __forceinline__ void AllowDependentsAtStart(bool late) {
  if (!late) AllowDependents();
}
__device__ __forceinline__ void WaitReleasing(bool late) {
  WaitForPrerequisites();
  if (late) AllowDependents();
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// L2 policy for data read once per step (weights): first to leave L2.
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
#endif
// A 16-byte load of data read once per step (weights): read-only path, and marked first to leave L2
// (evict_first policy), so streaming gigabytes of weights does not push out what is read again soon
// (lines prefetched for a later phase, activations, KV).
__device__ __forceinline__ uint4 LoadStreaming(const uint4* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(DL_LOAD_STREAMING_PLAIN)  // A/B build flag
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(EvictFirstPolicy()));
  return v;
#else
  return __ldg(p);
#endif
}
// Warms L2 with a line the kernel will read after WaitForPrerequisites.
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Warms L2 with the 128-byte lines of [p, p + bytes), thread `i` of `n` taking lines i, i + n, ...:
// for small data written by the host or a much earlier kernel and read right after the PDL wait,
// which would otherwise be a DRAM round trip on the critical path (a step streams ~5.6 GB through
// the 50 MB L2 between two reads of it). Safe before the wait even where the data is not final yet:
// L2 is the point of coherence, so a later write updates the warmed line.
__device__ __forceinline__ void PrefetchBytesL2(const void* p, size_t bytes, int i, int n) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{127};
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t a = first + 128 * static_cast<uintptr_t>(i); a < end; a += 128 * static_cast<uintptr_t>(n)) {
    PrefetchL2(reinterpret_cast<const void*>(a));
  }
}

__device__ __forceinline__ float Softplus(float z) {
  // PyTorch's softplus (beta 1, threshold 20).
  return z > 20.0f ? z : log1pf(expf(z));
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...) with the programmatic-stream-serialisation
// attribute (see AllowDependents above). Captured into a CUDA graph it becomes a programmatic edge.
// More than 48 KB of dynamic shared memory needs the kernel's opt-in, which this sets. cluster_x > 0:
// thread-block clusters of (cluster_x, 1, 1) blocks (sm_90; grid.x a multiple of it).
template <typename... Params, typename... Args>
cudaError_t LaunchDependentCluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                   unsigned cluster_x, cudaStream_t stream, Args&&... args) {
  if (smem_bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem_bytes));
    if (e != cudaSuccess) return e;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster_x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (DependentLaunchEnabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
template <typename... Params, typename... Args>
cudaError_t LaunchDependentSmem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                cudaStream_t stream, Args&&... args) {
  return LaunchDependentCluster(kernel, grid, block, smem_bytes, 0, stream, std::forward<Args>(args)...);
}
template <typename... Params, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                            Args&&... args) {
  return LaunchDependentSmem(kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

}  // namespace dl::kernels::dev

// Turns the last launch error into a Status naming the kernel.
#define DL_KERNEL_LAUNCH_CHECK(name)                                                      \
  do {                                                                                    \
    cudaError_t dl_launch_err_ = cudaGetLastError();                                      \
    if (dl_launch_err_ != cudaSuccess) {                                                  \
      return ::dl::Internal("launching {} failed: {}", name,                              \
                            cudaGetErrorString(dl_launch_err_));                          \
    }                                                                                     \
  } while (0)
