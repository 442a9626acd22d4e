// The split-KV paged attention kernel, instantiated once per preset (generated TUs include this).
//
// Grid (chunk, kv_head, query token), 128 threads. A block owns one KV head, its G query heads and one
// chunk of kAttnChunk ABSOLUTE key positions [c*C, c*C+C) clipped to the query's visible range
// [start, pos] (start = pos-W+1 on sliding layers, else 0). Three stages, all in a fixed order:
//   1. scores: lanes are grouped LPT = D/8 per key; each lane loads 8 elements of the key (16 bytes
//      BF16, 8 bytes FP8) through the block table and dots them with its 8 dims of the G queries;
//      an xor butterfly inside the lane group finishes the dot. Scores go to shared memory.
//   2. per query head: chunk max m and l = sum exp(s - m) (warp butterflies), p = exp(s - m) kept.
//   3. values: acc[g][8] += p * v over the block's keys, butterflies across lane groups, then the 4
//      warps are summed in order. Writes the unnormalised partial O, m and l to the workspace.
// The combine kernel (combine.cu) merges chunks in ascending order and applies the softplus gate.
// The page size only changes address arithmetic: results are bit-identical across page sizes.
#pragma once

#include <cmath>

#include "kernels/attention/attention.h"
#include "kernels/cuda/device_utils.cuh"

namespace dl::kernels {

// Merges the per-chunk partials, normalises, rounds, gates and writes out (combine.cu).
Status LaunchAttentionCombine(const AttentionParams& p, int num_chunks, Stream stream);

namespace dev {

template <int D, int G, int P, KvDtype KV, bool SLIDING>
__global__ void __launch_bounds__(128) SplitAttentionKernel(const AttentionParams a, int num_chunks) {
  constexpr int C = kAttnChunk;
  constexpr int kWarps = 4;
  constexpr int kVec = 8;
  constexpr int LPT = D / kVec;  // lanes per key
  constexpr int TPW = 32 / LPT;  // keys per warp step
  constexpr int TPB = TPW * kWarps;
  constexpr int kSteps = C / TPB;
  constexpr int U = kSteps < 8 ? kSteps : 8;  // keys in flight per lane (order of FMAs unchanged)
  static_assert(D % kVec == 0 && (LPT & (LPT - 1)) == 0 && LPT >= 1 && LPT <= 32, "head dim");
  static_assert(C % TPB == 0 && kSteps % U == 0, "chunk");
  static_assert(P >= 2, "page size");
  using KvVec = typename std::conditional<KV == KvDtype::kFp8, uint2, uint4>::type;
  constexpr int kElemBytes = KV == KvDtype::kFp8 ? 1 : 2;

  __shared__ float s_p[G][C];
  __shared__ float s_red[kWarps][G][D];
  // Page ids of the chunk's visible positions, loaded once: the per-key table lookup would otherwise
  // add a dependent global load in front of every KV load.
  constexpr int kChunkPages = (C + P - 1) / P + 1;
  __shared__ int s_page[kChunkPages];

  const int t = blockIdx.z;
  const int kvh = blockIdx.y;
  const int ci = blockIdx.x;
  const int H = a.num_q_heads;
  const int K = a.num_kv_heads;
  const int pos = a.positions ? a.positions[t] : a.first_position + t;
  const int start = SLIDING ? max(0, pos - a.window + 1) : 0;
  const int chunk_lo = (start / C + ci) * C;

  float* ws_o = static_cast<float*>(a.workspace);
  const size_t n_part = static_cast<size_t>(a.num_tokens) * H * num_chunks;
  float* ws_m = ws_o + n_part * D;
  float* ws_l = ws_m + n_part;
  auto part = [&](int g) { return (static_cast<size_t>(t) * H + kvh * G + g) * num_chunks + ci; };

  if (chunk_lo > pos) {  // past the query: an empty chunk (the grid is sized for the largest query)
    if (threadIdx.x < G) {
      ws_m[part(threadIdx.x)] = -INFINITY;
      ws_l[part(threadIdx.x)] = 0.0f;
    }
    return;
  }

  {
    const int first_page = max(start, chunk_lo) / P;
    const int last_page = min(pos, chunk_lo + C - 1) / P;
    if (threadIdx.x <= last_page - first_page) {
      s_page[threadIdx.x] = a.block_table[first_page + threadIdx.x];
    }
  }
  const int page0 = max(start, chunk_lo) / P;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int grp = lane / LPT;
  const int sub = lane % LPT;
  // softmax_scale is resolved on the host (launcher): D^-1/2 when the caller passed 0.
  const float score_scale = a.softmax_scale * (KV == KvDtype::kFp8 ? a.k_scale : 1.0f);

  float q[G][kVec];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const uint4 u = *reinterpret_cast<const uint4*>(
        a.q + (static_cast<size_t>(t) * H + kvh * G + g) * D + sub * kVec);
    Bf16x8ToFloat(u, q[g]);
  }

  const char* k_base = static_cast<const char*>(a.k_pool);
  const char* v_base = static_cast<const char*>(a.v_pool);
  auto kv_offset = [&](int s) {  // byte offset of this lane's 8 elements of key s
    const int page = s_page[s / P - page0];
    return ((static_cast<size_t>(page) * P + (s % P)) * K + kvh) * D * kElemBytes +
           sub * kVec * kElemBytes;
  };
  auto to_float = [](const KvVec& v, float* f) {
    if constexpr (KV == KvDtype::kFp8) {
      Fp8x8ToFloat(v, f);
    } else {
      Bf16x8ToFloat(v, f);
    }
  };

  __syncthreads();  // s_page

  // ---- Stage 1: scores.
#pragma unroll 1
  for (int step0 = 0; step0 < kSteps; step0 += U) {
    KvVec kv[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = chunk_lo + (step0 + u) * TPB + warp * TPW + grp;
      valid[u] = s >= start && s <= pos;
      if (valid[u]) kv[u] = *reinterpret_cast<const KvVec*>(k_base + kv_offset(s));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[kVec];
      if (valid[u]) {
        to_float(kv[u], kf);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) kf[e] = 0.0f;
      }
      const int tok = (step0 + u) * TPB + warp * TPW + grp;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) dot = fmaf(q[g][e], kf[e], dot);
#pragma unroll
        for (int o = LPT / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (sub == 0) s_p[g][tok] = valid[u] ? dot * score_scale : -INFINITY;
      }
    }
  }
  __syncthreads();

  // ---- Stage 2: chunk softmax statistics per query head.
  for (int g = warp; g < G; g += kWarps) {
    float v[C / 32];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < C / 32; ++j) {
      v[j] = s_p[g][lane + 32 * j];
      mx = fmaxf(mx, v[j]);
    }
    mx = WarpMax(mx);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < C / 32; ++j) {
      const float e = v[j] == -INFINITY ? 0.0f : expf(v[j] - mx);
      s_p[g][lane + 32 * j] = e;
      sum += e;
    }
    sum = WarpSum(sum);
    if (lane == 0) {
      ws_m[part(g)] = mx;
      ws_l[part(g)] = sum;
    }
  }
  __syncthreads();

  // ---- Stage 3: P @ V.
  float acc[G][kVec];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.0f;
#pragma unroll 1
  for (int step0 = 0; step0 < kSteps; step0 += U) {
    KvVec kv[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = chunk_lo + (step0 + u) * TPB + warp * TPW + grp;
      valid[u] = s >= start && s <= pos;
      if (valid[u]) kv[u] = *reinterpret_cast<const KvVec*>(v_base + kv_offset(s));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!valid[u]) continue;
      float vf[kVec];
      to_float(kv[u], vf);
      const int tok = (step0 + u) * TPB + warp * TPW + grp;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pg = s_p[g][tok];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(pg, vf[e], acc[g][e]);
      }
    }
  }
#pragma unroll
  for (int o = LPT; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  if (grp == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < kVec; ++e) s_red[warp][g][sub * kVec + e] = acc[g][e];
  }
  __syncthreads();
  const float v_scale = KV == KvDtype::kFp8 ? a.v_scale : 1.0f;
  for (int idx = threadIdx.x; idx < G * D; idx += 128) {
    const int g = idx / D, d = idx % D;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s_red[w][g][d];
    ws_o[part(g) * D + d] = o * v_scale;
  }
}

}  // namespace dev

template <int D, int G, int P, KvDtype KV, bool SLIDING>
Status LaunchSplitAttention(const AttentionParams& params, Stream stream) {
  AttentionParams p = params;
  if (p.softmax_scale <= 0.0f) p.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  const int num_chunks = AttentionMaxChunks(p);
  dim3 grid(num_chunks, p.num_kv_heads, p.num_tokens);
  dev::SplitAttentionKernel<D, G, P, KV, SLIDING>
      <<<grid, 128, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p, num_chunks);
  DL_KERNEL_LAUNCH_CHECK(CanonicalName(PresetKeyOf(p)));
  return LaunchAttentionCombine(p, num_chunks, stream);
}

}  // namespace dl::kernels
