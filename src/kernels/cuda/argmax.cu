// Argmax over a BF16 vector in one launch: each block scans a strided slice (16-byte loads), reduces
// (value, index) pairs in a fixed order and writes its winner; the last block to finish (a ticket from
// an atomic counter -- used for scheduling only, never for values) reduces the block winners in block
// order and resets the counter, so the launch is graph-capturable.
#include <climits>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxMaxBlocks = 256;

// torch.argmax order: NaN beats everything, then larger value, then lower index.
__device__ __forceinline__ bool Better(float v, int i, float bv, int bi) {
  const bool nv = isnan(v), nb = isnan(bv);
  if (nv != nb) return nv;
  if (nv) return i < bi;
  return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void BlockArgmax(float& v, int& i) {
  __shared__ float s_v[kArgmaxThreads / 32];
  __shared__ int s_i[kArgmaxThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (Better(ov, oi, v, i)) v = ov, i = oi;
  }
  if ((threadIdx.x & 31) == 0) s_v[threadIdx.x >> 5] = v, s_i[threadIdx.x >> 5] = i;
  __syncthreads();
  v = s_v[0], i = s_i[0];
  for (int w = 1; w < kArgmaxThreads / 32; ++w)
    if (Better(s_v[w], s_i[w], v, i)) v = s_v[w], i = s_i[w];
  __syncthreads();
}

__global__ void __launch_bounds__(kArgmaxThreads) ArgmaxKernel(ArgmaxParams a) {
  DL_TIMELINE_SCOPE(kArgmax);
  AllowDependents();
  WaitForPrerequisites();
  float best = -INFINITY;
  int bi = INT_MAX;
  bool bad = false;  // a NaN or Inf seen
  const int n8 = a.n / 8;
  const uint4* x8 = reinterpret_cast<const uint4*>(a.logits);
  for (int c = blockIdx.x * kArgmaxThreads + threadIdx.x; c < n8; c += gridDim.x * kArgmaxThreads) {
    float f[8];
    Bf16x8ToFloat(x8[c], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      bad = bad || !isfinite(f[e]);
      if (Better(f[e], c * 8 + e, best, bi)) best = f[e], bi = c * 8 + e;
    }
  }
  if (blockIdx.x == 0) {
    for (int i = n8 * 8 + threadIdx.x; i < a.n; i += kArgmaxThreads) {
      const float f = Bf16BitsToFloat(a.logits[i]);
      bad = bad || !isfinite(f);
      if (Better(f, i, best, bi)) best = f, bi = i;
    }
  }
  BlockArgmax(best, bi);
  bad = __syncthreads_or(bad);
  float* ws_v = static_cast<float*>(a.workspace);
  int* ws_i = reinterpret_cast<int*>(ws_v + kArgmaxMaxBlocks);
  int* ws_bad = ws_i + kArgmaxMaxBlocks;
  __shared__ bool s_last;
  if (threadIdx.x == 0) {
    ws_v[blockIdx.x] = best;
    ws_i[blockIdx.x] = bi;
    ws_bad[blockIdx.x] = bad;
    __threadfence();
    s_last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (threadIdx.x == 0) {
    float v = __ldcg(&ws_v[0]);
    int i = __ldcg(&ws_i[0]);
    int any_bad = __ldcg(&ws_bad[0]);
    for (int b = 1; b < static_cast<int>(gridDim.x); ++b) {
      const float bv = __ldcg(&ws_v[b]);
      const int bidx = __ldcg(&ws_i[b]);
      any_bad |= __ldcg(&ws_bad[b]);
      if (Better(bv, bidx, v, i)) v = bv, i = bidx;
    }
    a.out[0] = i;
    if (a.nonfinite) a.nonfinite[0] = any_bad != 0;
    *a.counter = 0u;
  }
}

}  // namespace dev

size_t ArgmaxWorkspaceBytes(int) { return dev::kArgmaxMaxBlocks * (sizeof(float) + 2 * sizeof(int)); }

Status Argmax(const ArgmaxParams& p, Stream stream) {
  if (!p.logits || !p.out || !p.workspace || !p.counter) {
    return InvalidArgument("argmax: logits, out, workspace and counter must be set");
  }
  if (p.n < 1) return InvalidArgument("argmax: empty input");
  const int per_block = dev::kArgmaxThreads * 8 * 4;  // 4 chunks of 8 per thread
  const int blocks = std::max(1, std::min(dev::kArgmaxMaxBlocks, (p.n + per_block - 1) / per_block));
  dev::LaunchDependent(dev::ArgmaxKernel, dim3(blocks), dim3(dev::kArgmaxThreads),
                       reinterpret_cast<cudaStream_t>(stream), p);
  DL_KERNEL_LAUNCH_CHECK("argmax");
  return Status::Ok();
}

}  // namespace dl::kernels
