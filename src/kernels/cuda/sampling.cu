// SampleRows (kernels/sampling.h): one block of 1024 threads per output row. Thread i owns the row's
// elements i, i + 1024, ...; every block-wide sum, count, max and argmax reduces the threads' partials
// in the same tree, so a row's token depends on that row alone.
#include <cfloat>
#include <climits>

#include "base/rng.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/sampling.h"

namespace dl::kernels {
namespace dev {

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;

// Monotonic map of floats to unsigned (larger float, larger key; -inf lowest of the non-NaN).
__device__ __forceinline__ unsigned OrderedKey(float f) {
  const unsigned b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float whose OrderedKey is k.
__device__ __forceinline__ float KeyValue(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The block's reduction of one value per thread by `op` (associative and commutative): a butterfly in
// each warp, then the warps' results in warp order, so the same inputs give the same bits.
template <typename T, typename Op>
__device__ __forceinline__ T BlockReduce(T v, Op op) {
  __shared__ T s[kSampleWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // s may still be read by an earlier call
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  T t = s[0];
  for (int w = 1; w < kSampleWarps; ++w) t = op(t, s[w]);
  return t;
}
__device__ __forceinline__ float BlockSumF(float v) {
  return BlockReduce(v, [](float a, float b) { return a + b; });
}
__device__ __forceinline__ int BlockSumI(int v) {
  return BlockReduce(v, [](int a, int b) { return a + b; });
}
__device__ __forceinline__ float BlockMaxF(float v) {
  return BlockReduce(v, [](float a, float b) { return fmaxf(a, b); });
}
// The block's (largest value, lowest index among equals); values that are NaN never win.
__device__ __forceinline__ int BlockArgmaxIndex(float v, int i) {
  __shared__ float s_v[kSampleWarps];
  __shared__ int s_i[kSampleWarps];
  auto better = [](float av, int ai, float bv, int bi) {
    if (isnan(bv)) return !isnan(av) || ai < bi;
    if (isnan(av)) return false;
    return av > bv || (av == bv && ai < bi);
  };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s_v[threadIdx.x >> 5] = v, s_i[threadIdx.x >> 5] = i;
  __syncthreads();
  float bv = s_v[0];
  int bi = s_i[0];
  for (int w = 1; w < kSampleWarps; ++w)
    if (better(s_v[w], s_i[w], bv, bi)) bv = s_v[w], bi = s_i[w];
  return bi;
}

// Of the tokens whose key is K, keeps the `keep` lowest ids; removes every token below K (z = -inf).
// Thread t scans the contiguous id range t: a prefix count over the threads puts the ties in id order.
__device__ __forceinline__ void KeepTiesInIdOrder(float* z, int V, unsigned K, int keep) {
  const int per = (V + kSampleThreads - 1) / kSampleThreads;
  const int lo = min(V, static_cast<int>(threadIdx.x) * per), hi = min(V, lo + per);
  int mine = 0;
  for (int i = lo; i < hi; ++i) mine += z[i] != -INFINITY && OrderedKey(z[i]) == K;
  int total = 0;
  int before = BlockExclusiveScan(mine, &total);
  for (int i = lo; i < hi; ++i) {
    if (z[i] == -INFINITY) continue;
    const unsigned key = OrderedKey(z[i]);
    if (key < K || (key == K && before++ >= keep)) z[i] = -INFINITY;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kSampleThreads) SampleRowsKernel(SampleRowsParams a) {
  DL_TIMELINE_SCOPE(kArgmax);
  AllowDependents();
  WaitForPrerequisites();
  const int r = blockIdx.x, V = a.vocab;
  const DeviceRowSampling sp = a.params[r];
  const bf16* in = a.logits + static_cast<size_t>(r) * V;
  float* z = a.scratch + static_cast<size_t>(r) * 2 * V;  // z, then (top-p) each token's mass
  bool bad = false;
  for (int i = threadIdx.x; i < V; i += kSampleThreads) {
    const float x = Bf16BitsToFloat(in[i]);
    bad = bad || !isfinite(x);
    z[i] = x;
  }
  bad = __syncthreads_or(bad);
  // 1. Adjustments (each token listed once: no two threads touch the same element).
  for (int q = threadIdx.x; q < sp.adj_count; q += kSampleThreads) {
    const LogitAdjustment adj = a.adjustments[sp.adj_begin + q];
    z[adj.token] = AdjustedLogit(z[adj.token], adj);
  }
  __syncthreads();
  if (sp.temperature <= 0.0f) {  // 2. greedy
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = threadIdx.x; i < V; i += kSampleThreads) {
      if (z[i] > bv || (bi == INT_MAX && !isnan(z[i]))) bv = z[i], bi = i;
    }
    const int tok = BlockArgmaxIndex(bv, bi);
    if (threadIdx.x == 0) {
      a.tokens[r] = tok == INT_MAX ? 0 : tok;
      a.nonfinite[r] = bad;
    }
    return;
  }
  // 3. z = l / temperature, then the filters; a removed token becomes -inf.
  float zmax = -INFINITY;
  for (int i = threadIdx.x; i < V; i += kSampleThreads) {
    z[i] = z[i] / sp.temperature;
    zmax = fmaxf(zmax, z[i]);
  }
  zmax = BlockMaxF(zmax);
  if (sp.min_p > 0.0f) {
    const float floor = zmax + logf(sp.min_p);
    for (int i = threadIdx.x; i < V; i += kSampleThreads)
      if (!(z[i] >= floor)) z[i] = -INFINITY;
    __syncthreads();
  }
  if (sp.top_k > 0) {
    int kept = 0;
    for (int i = threadIdx.x; i < V; i += kSampleThreads) kept += z[i] != -INFINITY;
    if (BlockSumI(kept) > sp.top_k) {
      // K: the k-th largest value's key (the largest K with count(key >= K) >= k).
      unsigned K = 0;
      for (int bit = 31; bit >= 0; --bit) {
        const unsigned cand = K | (1u << bit);
        int c = 0;
        for (int i = threadIdx.x; i < V; i += kSampleThreads) c += z[i] != -INFINITY && OrderedKey(z[i]) >= cand;
        if (BlockSumI(c) >= sp.top_k) K = cand;
      }
      int above = 0;
      for (int i = threadIdx.x; i < V; i += kSampleThreads) above += z[i] != -INFINITY && OrderedKey(z[i]) > K;
      KeepTiesInIdOrder(z, V, K, sp.top_k - BlockSumI(above));
    }
  }
  if (sp.top_p < 1.0f) {
    // Each kept token's unnormalised probability once (the bisection below sums them 32 times).
    float* mass = z + V;
    float m = 0.0f;
    for (int i = threadIdx.x; i < V; i += kSampleThreads) {
      mass[i] = z[i] != -INFINITY ? expf(z[i] - zmax) : 0.0f;
      m += mass[i];
    }
    const float target = sp.top_p * BlockSumF(m);
    // tau's key K: the largest K with mass(key(z) >= K) >= target.
    unsigned K = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const unsigned cand = K | (1u << bit);
      float part = 0.0f;
      for (int i = threadIdx.x; i < V; i += kSampleThreads) part += OrderedKey(z[i]) >= cand ? mass[i] : 0.0f;
      if (BlockSumF(part) >= target) K = cand;
    }
    // Tokens above tau stay; of those at tau, the lowest ids until the mass reaches the target.
    float part = 0.0f;
    for (int i = threadIdx.x; i < V; i += kSampleThreads) part += OrderedKey(z[i]) > K ? mass[i] : 0.0f;
    const float above = BlockSumF(part);
    const float tau_mass = expf(KeyValue(K) - zmax);
    const int ties = max(1, static_cast<int>(ceilf((target - above) / tau_mass)));
    KeepTiesInIdOrder(z, V, K, ties);
  }
  // 4. Gumbel-max over the kept tokens.
  const uint64_t row_key = SplitMix64(sp.key ^ SplitMix64(sp.step));
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int i = threadIdx.x; i < V; i += kSampleThreads) {
    if (z[i] == -INFINITY) continue;
    const float g = z[i] - logf(-logf(UniformAt(row_key, static_cast<uint64_t>(i))));
    if (bi == INT_MAX || g > bv) bv = g, bi = i;
  }
  const int tok = BlockArgmaxIndex(bv, bi);
  if (threadIdx.x == 0) {
    a.tokens[r] = tok == INT_MAX ? 0 : tok;
    a.nonfinite[r] = bad;
  }
}

}  // namespace dev

Status SampleRows(const SampleRowsParams& p, Stream stream) {
  if (!p.logits || !p.params || !p.tokens || !p.nonfinite || !p.scratch || (p.rows > 0 && p.vocab < 1)) {
    return InvalidArgument("sample_rows: logits, params, tokens, nonfinite and scratch must be set");
  }
  if (p.rows == 0) return Status::Ok();
  dev::LaunchDependent(dev::SampleRowsKernel, dim3(p.rows), dim3(dev::kSampleThreads),
                       reinterpret_cast<cudaStream_t>(stream), p);
  DL_KERNEL_LAUNCH_CHECK("sample_rows");
  return Status::Ok();
}

}  // namespace dl::kernels
