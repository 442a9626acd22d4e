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

// ---- One-shot collectives (device_reduce.h says how a call runs) ----

__device__ __forceinline__ void StoreRelease(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A meeting of block b of every rank (device_reduce.h's step 2): every thread's slot writes are done
// (bar.sync), thread t < size stores `mark` into rank t's flags[b][rank] and waits until rank t has
// stored `mark` or later into ours. Marks grow by two per call (device_reduce.h): 2e at a one-shot
// call's meeting, 2e - 1 and 2e at a two-shot call's two. False when the wait gave up (abort or
// timeout): the block then leaves without combining.
__device__ __forceinline__ bool OneShotBarrier(const OneShotView& v, uint64_t mark, volatile int* failed) {
  __syncthreads();
  const int t = threadIdx.x;
  const int b = blockIdx.x;
  if (t < v.size) {
    StoreRelease(v.flags[t] + b * kMaxOneShotRanks + v.rank, mark);
    const uint64_t* mine = v.flags[v.rank] + b * kMaxOneShotRanks + t;
    uint32_t spins = 0;
    uint64_t start = 0;
    while (LoadAcquire(mine) < mark) {
      if ((++spins & 1023u) != 0) continue;
      // Host-mapped reads are slow: every 1024 spins only.
      if (*v.abort != 0) {
        if (*v.error == 0) *v.error = 1;
        *failed = 1;
        break;
      }
      const uint64_t now = GlobalTimerNs();
      if (start == 0) {
        start = now;
      } else if (now - start > v.timeout_ns) {
        if (*v.error == 0) *v.error = 2;
        *failed = 1;
        break;
      }
    }
  }
  __syncthreads();
  return *failed == 0;
}

template <typename T, int kV>
struct alignas(sizeof(T) * kV) Pack {
  T e[kV];
};

// Rank-order sum of kV elements of every rank's slot at unit u, rounded once: the one-shot's bits.
template <typename T, int kV>
__device__ __forceinline__ Pack<T, kV> SumUnit(const OneShotView& v, size_t off, int64_t u) {
  using P = Pack<T, kV>;
  float acc[kV];
  const P p0 = reinterpret_cast<const P*>(static_cast<const char*>(v.slots[0]) + off)[u];
#pragma unroll
  for (int k = 0; k < kV; ++k) acc[k] = Load(p0.e, k);
  for (int q = 1; q < v.size; ++q) {
    const P pq = reinterpret_cast<const P*>(static_cast<const char*>(v.slots[q]) + off)[u];
#pragma unroll
    for (int k = 0; k < kV; ++k) acc[k] = __fadd_rn(acc[k], Load(pq.e, k));
  }
  P o;
#pragma unroll
  for (int k = 0; k < kV; ++k) Store(o.e, k, acc[k]);
  return o;
}

// data [count] of T, in place. Units of kV elements (16 bytes when data is 16-byte aligned, else
// one element) split over the grid by u = b * threads + t, u += blocks * threads; the count % kV
// tail elements go to block 0's first threads, in every step. Step 1 copies the whole input into
// this rank's slot. Then:
// - one-shot: after the meeting every rank sums every unit over all slots in rank order;
// - two-shot (device_reduce.h): a thread's k-th unit (u = first + k * stride) is owned by rank
//   k % size, the tail by rank 0. After a first meeting each rank sums the units it owns over every
//   rank's slot in rank order and writes the rounded sums into its own slot, in place (a unit is
//   written only by its owner and read there by its owner alone); after a second meeting every rank
//   copies each unit from its owner's slot.
// Either way each element is the same rank-order FP32 sum, rounded once (SumUnit).
template <typename T, int kV, bool kTwoShot>
__global__ void __launch_bounds__(kOneShotThreads) AllReduceKernel(OneShotView v, T* data, int64_t count) {
  using P = Pack<T, kV>;
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const int b = blockIdx.x;
  const uint64_t epoch = v.epochs[b] + 1;
  const size_t off = (epoch & 1) * v.capacity;
  const int64_t units = count / kV, tail0 = units * kV;
  const int64_t first = static_cast<int64_t>(b) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool tail = b == 0 && static_cast<int64_t>(threadIdx.x) < count - tail0;
  auto slot = [&](int q) { return reinterpret_cast<P*>(static_cast<char*>(v.slots[q]) + off); };
  P* mine = slot(v.rank);
  {
    const P* in = reinterpret_cast<const P*>(data);
    for (int64_t u = first; u < units; u += stride) mine[u] = in[u];
    if (tail) reinterpret_cast<T*>(mine)[tail0 + threadIdx.x] = data[tail0 + threadIdx.x];
  }
  if constexpr (!kTwoShot) {
    if (OneShotBarrier(v, 2 * epoch, &failed)) {
      for (int64_t u = first; u < units; u += stride) reinterpret_cast<P*>(data)[u] = SumUnit<T, kV>(v, off, u);
      if (tail) data[tail0 + threadIdx.x] = SumUnit<T, 1>(v, off, tail0 + threadIdx.x).e[0];
    }
  } else if (OneShotBarrier(v, 2 * epoch - 1, &failed)) {
    for (int64_t u = first + v.rank * stride; u < units; u += v.size * stride) mine[u] = SumUnit<T, kV>(v, off, u);
    if (tail && v.rank == 0) {
      const int64_t i = tail0 + threadIdx.x;
      reinterpret_cast<T*>(mine)[i] = SumUnit<T, 1>(v, off, i).e[0];
    }
    if (OneShotBarrier(v, 2 * epoch, &failed)) {
      int owner = 0;
      for (int64_t u = first; u < units; u += stride) {
        reinterpret_cast<P*>(data)[u] = slot(owner)[u];
        owner = owner + 1 == v.size ? 0 : owner + 1;
      }
      if (tail) data[tail0 + threadIdx.x] = reinterpret_cast<const T*>(slot(0))[tail0 + threadIdx.x];
    }
  }
  if (threadIdx.x == 0) v.epochs[b] = epoch;
}

// local [units] of U (the widest unit that divides the bytes and both pointers' alignment) into
// out [size, units], rank q's at q * units.
template <typename U>
__global__ void __launch_bounds__(kOneShotThreads) OneShotAllGatherKernel(OneShotView v, const U* local, int64_t units,
                                                                         U* out) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const int b = blockIdx.x;
  const uint64_t epoch = v.epochs[b] + 1;
  const size_t off = (epoch & 1) * v.capacity;
  const int64_t first = static_cast<int64_t>(b) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  U* mine = reinterpret_cast<U*>(static_cast<char*>(v.slots[v.rank]) + off);
  for (int64_t u = first; u < units; u += stride) mine[u] = local[u];
  if (OneShotBarrier(v, 2 * epoch, &failed)) {
    for (int q = 0; q < v.size; ++q) {
      const U* src = reinterpret_cast<const U*>(static_cast<const char*>(v.slots[q]) + off);
      for (int64_t u = first; u < units; u += stride) out[q * units + u] = src[u];
    }
  }
  if (threadIdx.x == 0) v.epochs[b] = epoch;
}

Status CheckLaunch(const char* what, const OneShotView& v) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Internal("one-shot {} on rank {} of {}: {}", what, v.rank, v.size, cudaGetErrorString(e));
  return Status::Ok();
}

Status CheckView(const OneShotView& v) {
  if (v.size < 1 || v.size > kMaxOneShotRanks || v.rank < 0 || v.rank >= v.size || v.blocks < 1 ||
      v.blocks > kMaxOneShotBlocks) {
    return InvalidArgument("one-shot view: rank {} of {}, {} blocks (at most {} ranks, {} blocks)", v.rank, v.size,
                           v.blocks, kMaxOneShotRanks, kMaxOneShotBlocks);
  }
  return Status::Ok();
}

template <typename U>
void LaunchGather(const OneShotView& v, const void* local, size_t bytes, void* out, cudaStream_t s) {
  OneShotAllGatherKernel<U><<<v.blocks, kOneShotThreads, 0, s>>>(v, static_cast<const U*>(local),
                                                                   static_cast<int64_t>(bytes / sizeof(U)),
                                                                   static_cast<U*>(out));
}

template <typename T, int kV>
void LaunchAllReduce(const OneShotView& v, bool two_shot, void* data, int64_t count, cudaStream_t s) {
  auto* d = static_cast<T*>(data);
  if (two_shot) {
    AllReduceKernel<T, kV, true><<<v.blocks, kOneShotThreads, 0, s>>>(v, d, count);
  } else {
    AllReduceKernel<T, kV, false><<<v.blocks, kOneShotThreads, 0, s>>>(v, d, count);
  }
}

bool Aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

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

namespace dl::comm {

Status LaunchOneShotAllReduce(const OneShotView& v, void* data, int64_t count, DeviceElem elem, CUstream_st* stream) {
  DL_RETURN_IF_ERROR(CheckView(v));
  const size_t bytes = static_cast<size_t>(count) * DeviceElemBytes(elem);
  if (count < 0 || bytes > v.capacity) {
    return InvalidArgument("one-shot all-reduce of {} bytes exceeds the slot capacity of {}", bytes, v.capacity);
  }
  // Every call runs the whole grid, even with nothing to add: the epochs of all blocks advance together.
  const bool two_shot = v.size > 1 && v.two_shot_min_bytes > 0 && bytes >= v.two_shot_min_bytes;
  if (Aligned(data, 16)) {
    if (elem == DeviceElem::kF32) {
      LaunchAllReduce<float, 4>(v, two_shot, data, count, stream);
    } else {
      LaunchAllReduce<__nv_bfloat16, 8>(v, two_shot, data, count, stream);
    }
  } else if (elem == DeviceElem::kF32) {
    LaunchAllReduce<float, 1>(v, two_shot, data, count, stream);
  } else {
    LaunchAllReduce<__nv_bfloat16, 1>(v, two_shot, data, count, stream);
  }
  return CheckLaunch(two_shot ? "two-shot all-reduce" : "all-reduce", v);
}

Status LaunchOneShotAllGather(const OneShotView& v, const void* local, size_t bytes, void* out, CUstream_st* stream) {
  DL_RETURN_IF_ERROR(CheckView(v));
  if (bytes > v.capacity) {
    return InvalidArgument("one-shot all-gather of {} bytes per rank exceeds the slot capacity of {}", bytes,
                           v.capacity);
  }
  auto fits = [&](size_t a) { return bytes % a == 0 && Aligned(local, a) && Aligned(out, a); };
  if (fits(16)) {
    LaunchGather<uint4>(v, local, bytes, out, stream);
  } else if (fits(8)) {
    LaunchGather<uint2>(v, local, bytes, out, stream);
  } else if (fits(4)) {
    LaunchGather<uint32_t>(v, local, bytes, out, stream);
  } else if (fits(2)) {
    LaunchGather<uint16_t>(v, local, bytes, out, stream);
  } else {
    LaunchGather<uint8_t>(v, local, bytes, out, stream);
  }
  return CheckLaunch("all-gather", v);
}

std::string TwoShotRule(const OneShotView& v) {
  return v.two_shot_min_bytes > 0 && v.size > 1 ? fmt::format("two-shot>={}", v.two_shot_min_bytes) : std::string();
}

Status PreloadOneShotKernels() {
  cudaFuncAttributes a;
  const void* kernels[] = {
      reinterpret_cast<const void*>(&AllReduceKernel<float, 4, false>),
      reinterpret_cast<const void*>(&AllReduceKernel<float, 1, false>),
      reinterpret_cast<const void*>(&AllReduceKernel<__nv_bfloat16, 8, false>),
      reinterpret_cast<const void*>(&AllReduceKernel<__nv_bfloat16, 1, false>),
      reinterpret_cast<const void*>(&AllReduceKernel<float, 4, true>),
      reinterpret_cast<const void*>(&AllReduceKernel<float, 1, true>),
      reinterpret_cast<const void*>(&AllReduceKernel<__nv_bfloat16, 8, true>),
      reinterpret_cast<const void*>(&AllReduceKernel<__nv_bfloat16, 1, true>),
      reinterpret_cast<const void*>(&OneShotAllGatherKernel<uint4>),
      reinterpret_cast<const void*>(&OneShotAllGatherKernel<uint2>),
      reinterpret_cast<const void*>(&OneShotAllGatherKernel<uint32_t>),
      reinterpret_cast<const void*>(&OneShotAllGatherKernel<uint16_t>),
      reinterpret_cast<const void*>(&OneShotAllGatherKernel<uint8_t>),
  };
  for (const void* k : kernels) {
    const cudaError_t e = cudaFuncGetAttributes(&a, k);
    if (e != cudaSuccess) return Internal("loading the one-shot kernels: {}", cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace dl::comm
