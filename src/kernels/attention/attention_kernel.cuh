// The split-KV paged attention kernel, instantiated once per preset (generated TUs include this).
//
// Grid (chunk, kv_head, query token), 256 threads. A block owns one KV head, its G query heads and one
// chunk of kAttnChunk = 128 ABSOLUTE key positions [c*C, c*C+C) clipped to the query's visible range
// [start, pos] (start = pos-W+1 on sliding layers, else 0). Four stages, all in a fixed order:
//   1. scores: threads 2k, 2k+1 own key c*C+k: each loads half of the key's row (through the block
//      table) and dots it with the G queries held in shared memory, one dimension after another;
//      meanwhile the V half-row is copied into shared memory (cp.async). One shuffle adds the halves.
//      At batch 1 the kernel is latency-bound: short per-thread chains matter more than bytes.
//   2. per query head: chunk max m and l = sum exp(s - m) (warp butterflies), p = exp(s - m) kept.
//   3. values: warp g owns query head g, each lane a few dimensions; o += p_k * v_k over the chunk's
//      keys in ascending order, from shared memory. Writes the unnormalised partial O, m and l.
//   4. the last block of a (token, KV head) to finish (arrival ticket; the ticket decides only WHO
//      merges, never the order) merges the chunks in ascending order and applies the softplus gate;
//      or, where the chunks fit a thread-block cluster (AttentionParams::cluster_max_chunks), every
//      block merges a share of the outputs from the partials in the cluster's shared memory (same
//      formula and order: the same bits).
// The page size only changes address arithmetic: results are bit-identical across page sizes.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>

#include "kernels/attention/attention.h"
#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/device_utils.cuh"

namespace dl::kernels {

namespace dev {

// Stage timing for kernel work (build with -DDL_ATTN_STAGE_TIMING): block (0, 0, 0) prints the
// globaltimer deltas between the DL_ATTN_MARK points. Compiled out otherwise.
#ifdef DL_ATTN_STAGE_TIMING
#define DL_ATTN_MARK(i) \
  unsigned long long dl_ts_##i; \
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(dl_ts_##i))
#define DL_ATTN_REPORT()                                                                        \
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0)               \
  printf("attn stages ns: setup %llu scores %llu softmax+v-wait %llu pv %llu merge %llu\n",    \
         dl_ts_1 - dl_ts_0, dl_ts_2 - dl_ts_1, dl_ts_3 - dl_ts_2, dl_ts_4 - dl_ts_3,            \
         dl_ts_5 - dl_ts_4)
#else
#define DL_ATTN_MARK(i) \
  do {                  \
  } while (0)
#define DL_ATTN_REPORT() \
  do {                   \
  } while (0)
#endif

// The raw gate value of output (t, h, d) as BF16 bits (0 when there is no gate).
__device__ __forceinline__ uint16_t LoadGate(const AttentionParams& a, int t, int h, int d) {
  if (a.gate == nullptr) return 0;
  const size_t gi = static_cast<size_t>(t) * a.gate_stride +
                    (a.gate_per_element ? static_cast<size_t>(h) * a.head_dim + d : h);
  return a.gate[gi];
}
// out = bf16(attn); with a gate: out = bf16(out * bf16(softplus(g))) (reference order, §3.4).
__device__ __forceinline__ uint16_t ApplyGateAndRound(const AttentionParams& a, uint16_t gate_bits,
                                                      float attn) {
  float o = RoundBf16(attn);
  if (a.gate != nullptr) o = RoundBf16(o * RoundBf16(Softplus(Bf16BitsToFloat(gate_bits))));
  return FloatToBf16Bits(o);
}
__device__ __forceinline__ uint16_t GateAndRound(const AttentionParams& a, int t, int h, int d,
                                                 float attn) {
  return ApplyGateAndRound(a, LoadGate(a, t, h, d), attn);
}

// Stage 4 for query heads kvh*G .. kvh*G+G-1 of token t, kThreads threads, over the chunks [0, used)
// that hold visible keys (the grid's later chunks are empty, and every chunk below `used` holds at
// least one visible key, so l_c >= 1): m = max_c m_c, w_c = exp(m_c - m), l = sum l_c w_c,
// o = sum o_c w_c (ascending c), out = gate(bf16(o / l)). This block is the kernel's critical path,
// so its loads go out in one round: the first kBatch chunks' partials, the gates and, up to C chunks,
// every (l_c, m_c) into shared memory; longer contexts take further tiles of C chunks.
template <int D, int G, int C, int kThreads>
__device__ __forceinline__ void MergeChunks(const AttentionParams& a, int t, int kvh, int num_chunks,
                                            int used, const float* ws_o, const float* ws_m, const float* ws_l,
                                            float (&s_w)[G][C], float (&s_l)[G][C]) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kPer = (G * D + kThreads - 1) / kThreads;  // (g, d) outputs per thread
  constexpr int kBatch = 8;                                // chunk partials in flight per output
  const int H = a.num_q_heads;
  __shared__ float s_mx[G];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto part = [&](int g, int c) {
    return (static_cast<size_t>(t) * H + kvh * G + g) * num_chunks + c;
  };
  float ov[kPer][kBatch];
  uint16_t gate[kPer];
  auto load_partials = [&](int c) {  // chunks c .. c+kBatch-1 (< used) of this thread's outputs
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = threadIdx.x + kThreads * i;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        ov[i][u] = 0.0f;
        if (idx < G * D && c + u < used) ov[i][u] = __ldcg(&ws_o[part(idx / D, c + u) * D + idx % D]);
      }
    }
  };
  load_partials(0);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = threadIdx.x + kThreads * i;
    gate[i] = idx < G * D ? LoadGate(a, t, kvh * G + idx / D, idx % D) : 0;
  }
  auto load_stats = [&](int c0, int n) {  // (l, m) of chunks c0 .. c0+n-1 -> s_l, s_w (m for now)
    for (int idx = threadIdx.x; idx < G * n; idx += kThreads) {
      const int g = idx / n, c = idx % n;
      s_l[g][c] = __ldcg(&ws_l[part(g, c0 + c)]);
      s_w[g][c] = __ldcg(&ws_m[part(g, c0 + c)]);
    }
  };
  load_stats(0, min(C, used));
  __syncthreads();
  for (int g = warp; g < G; g += kWarps) {
    float mx = -INFINITY;
    for (int c = lane; c < used; c += 32) mx = fmaxf(mx, c < C ? s_w[g][c] : __ldcg(&ws_m[part(g, c)]));
    mx = WarpMax(mx);
    if (lane == 0) s_mx[g] = mx;
  }
  float l_acc[kPer], o_acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) l_acc[i] = o_acc[i] = 0.0f;
  for (int c0 = 0; c0 < used; c0 += C) {
    const int n = min(C, used - c0);
    __syncthreads();  // s_mx ready; the previous tile's s_w/s_l consumed
    if (c0 > 0) {
      load_stats(c0, n);
      __syncthreads();
    }
    for (int idx = threadIdx.x; idx < G * n; idx += kThreads) {
      const int g = idx / n, c = idx % n;
      s_w[g][c] = expf(s_w[g][c] - s_mx[g]);
    }
    __syncthreads();
    for (int c = 0; c < n; c += kBatch) {
      if (c0 + c > 0) load_partials(c0 + c);
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int idx = threadIdx.x + kThreads * i;
        if (idx >= G * D) break;
        const int g = idx / D;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (c + u >= n) break;
          l_acc[i] = fmaf(s_l[g][c + u], s_w[g][c + u], l_acc[i]);
          o_acc[i] = fmaf(ov[i][u], s_w[g][c + u], o_acc[i]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = threadIdx.x + kThreads * i;
    if (idx >= G * D) break;
    const int g = idx / D, d = idx % D;
    const int h = kvh * G + g;
    a.out[(static_cast<size_t>(t) * H + h) * D + d] = ApplyGateAndRound(a, gate[i], o_acc[i] / l_acc[i]);
  }
}

// N consecutive KV elements from shared memory -> float (code values; the caller applies the scale).
template <int N, KvDtype KV>
__device__ __forceinline__ void LoadKvDims(const unsigned char* p, float (&f)[N]) {
  if constexpr (KV == KvDtype::kFp8 && N == 4) {
    Fp8x4ToFloat(*reinterpret_cast<const uint32_t*>(p), f);
  } else if constexpr (KV == KvDtype::kBf16 && N == 4) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    f[0] = __uint_as_float(w.x << 16), f[1] = __uint_as_float(w.x & 0xffff0000u);
    f[2] = __uint_as_float(w.y << 16), f[3] = __uint_as_float(w.y & 0xffff0000u);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      f[e] = KV == KvDtype::kFp8 ? Fp8ToFloat(p[e]) : Bf16BitsToFloat(reinterpret_cast<const uint16_t*>(p)[e]);
    }
  }
}

// Stage 4 with kCluster (AttentionParams::cluster_max_chunks): the num_chunks blocks of (token t, KV head
// kvh) are one cluster and block ci holds chunk ci's partial in shared memory (s_o [G][D] unnormalised,
// s_m / s_l [G]). After a cluster barrier, block ci computes outputs ci * kThreads + thread, stepping
// by the cluster's threads, reading every used chunk's m, l and o through distributed shared memory
// in one round: MergeChunks' formula and chunk order (m = max_c m_c, w_c = exp(m_c - m), l and o by
// fmaf in ascending c), so the same bits. A second barrier keeps every block's shared memory alive
// until the others have read it.
template <int D, int G, int kThreads>
__device__ __forceinline__ void ClusterMergeChunks(const AttentionParams& a, int t, int kvh, int ci, int num_chunks,
                                                   int used, float (&s_o)[G][D], float (&s_m)[G], float (&s_l)[G]) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int H = a.num_q_heads;
  constexpr int kPer = (G * D + kThreads - 1) / kThreads;  // at most, with one block
  uint16_t gate[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = (ci + i * num_chunks) * kThreads + threadIdx.x;
    gate[i] = idx < G * D ? LoadGate(a, t, kvh * G + idx / D, idx % D) : 0;
  }
  cluster.sync();  // every chunk's partial written (release / acquire across the cluster)
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = (ci + i * num_chunks) * kThreads + threadIdx.x;
    if (idx >= G * D) break;
    const int g = idx / D, d = idx % D;
    float m[kAttnMaxClusterChunks], l[kAttnMaxClusterChunks], o[kAttnMaxClusterChunks];
#pragma unroll
    for (int c = 0; c < kAttnMaxClusterChunks; ++c) {
      if (c >= used) break;
      m[c] = cluster.map_shared_rank(&s_m[0], c)[g];
      l[c] = cluster.map_shared_rank(&s_l[0], c)[g];
      o[c] = cluster.map_shared_rank(&s_o[0][0], c)[g * D + d];
    }
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < kAttnMaxClusterChunks; ++c) {
      if (c >= used) break;
      mx = fmaxf(mx, m[c]);
    }
    float l_acc = 0.0f, o_acc = 0.0f;
#pragma unroll
    for (int c = 0; c < kAttnMaxClusterChunks; ++c) {
      if (c >= used) break;
      const float w = expf(m[c] - mx);
      l_acc = fmaf(l[c], w, l_acc);
      o_acc = fmaf(o[c], w, o_acc);
    }
    a.out[(static_cast<size_t>(t) * H + kvh * G + g) * D + d] = ApplyGateAndRound(a, gate[i], o_acc / l_acc);
  }
  cluster.sync();  // no block leaves while another may still read its shared memory
}

template <int D, int G, int P, KvDtype KV, bool SLIDING, bool kCluster>
__global__ void __launch_bounds__(256) SplitAttentionKernel(const AttentionParams a, int num_chunks) {
  DL_TIMELINE_SCOPE(kAttention);
  AllowDependentsAtStart(a.release_after_wait);
  constexpr int C = kAttnChunk;  // keys per block: two threads per key in stage 1
  constexpr int kThreads = 256;
  constexpr int kWarps = kThreads / 32;
  static_assert(C * 2 == kThreads, "stage 1 maps one key to each pair of threads");
  static_assert(G >= 1 && G <= kWarps, "stage 3 gives each query head one warp");
  static_assert(P >= 2, "page size");
  constexpr int kElemBytes = KV == KvDtype::kFp8 ? 1 : 2;
  constexpr int kRowBytes = D * kElemBytes;  // one head of one key
  static_assert(kRowBytes % 16 == 0, "head dim: a key row must be whole 16-byte chunks");
  // Stage 1 splits a key row between the two threads of a pair where halves are whole 16-byte chunks;
  // otherwise the first thread takes the row and the second contributes 0.
  constexpr bool kSplitRow = kRowBytes % 32 == 0;
  constexpr int kPartBytes = kSplitRow ? kRowBytes / 2 : kRowBytes;
  constexpr int kPartDims = kPartBytes / kElemBytes;
  constexpr int kVec = 16 / kElemBytes;  // elements per 16-byte load
  constexpr int kDimsPerLane = D >= 32 ? D / 32 : 1;  // stage 3
  static_assert(D < 32 || D % 32 == 0, "head dim");

  __shared__ __align__(16) float s_q[G][D];
  __shared__ __align__(16) float s_p[G][C];
  // The chunk's V rows, copied asynchronously during stage 1 (zeros for keys outside the visible
  // range); reused by stage 4 for its weights.
  constexpr int kVBytes = C * kRowBytes;
  constexpr int kMergeBytes = 2 * G * C * 4;
  __shared__ __align__(16) unsigned char s_raw[kVBytes > kMergeBytes ? kVBytes : kMergeBytes];
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

  // kCluster: this chunk's partial stays here (stage 4 reads it through distributed shared memory).
  __shared__ __align__(16) float s_co[kCluster ? G : 1][kCluster ? D : 1];
  __shared__ float s_cm[kCluster ? G : 1], s_cl[kCluster ? G : 1];
  __shared__ bool s_last;
  // Stage 4's entry: count this block in; the last one of the (token, KV head) merges.
  auto arrive_and_merge = [&]() {
    if constexpr (kCluster) {
      ClusterMergeChunks<D, G, kThreads>(a, t, kvh, ci, num_chunks, pos / C - start / C + 1, s_co, s_cm, s_cl);
      return;
    }
    __syncthreads();  // every partial of this block is written; s_raw is free
    if (threadIdx.x == 0) {
      __threadfence();
      s_last = atomicAdd(&a.counters[t * K + kvh], 1u) == static_cast<unsigned>(num_chunks) - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    MergeChunks<D, G, C, kThreads>(a, t, kvh, num_chunks, pos / C - start / C + 1, ws_o, ws_m, ws_l,
                                   *reinterpret_cast<float(*)[G][C]>(s_raw),
                                   *reinterpret_cast<float(*)[G][C]>(s_raw + G * C * 4));
    if (threadIdx.x == 0) a.counters[t * K + kvh] = 0u;
  };

  if (chunk_lo > pos) {  // past the query: an empty chunk (the grid is sized for the largest query)
    WaitReleasing(a.release_after_wait);
    if (!kCluster && threadIdx.x < G) {  // (a cluster merges only the used chunks: nothing to write)
      ws_m[part(threadIdx.x)] = -INFINITY;
      ws_l[part(threadIdx.x)] = 0.0f;
    }
    arrive_and_merge();
    return;
  }

  const int lo = max(start, chunk_lo);        // first visible key of the chunk
  const int hi = min(pos, chunk_lo + C - 1);  // last
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // softmax_scale is resolved on the host (launcher): D^-1/2 when the caller passed 0.
  const float score_scale = a.softmax_scale * (KV == KvDtype::kFp8 ? a.k_scale : 1.0f);
  const char* k_base = static_cast<const char*>(a.k_pool);
  const char* v_base = static_cast<const char*>(a.v_pool);

  // ---- Stage 1: threads 2k and 2k+1 own key s = chunk_lo + k, one half of its row each: load the
  // K half, start copying the V half into shared memory, dot the K half with the G queries (FMAs in
  // dimension order); score = lower half + upper half. Keys written by earlier launches are loaded
  // before waiting on the previous kernel (which wrote q and this launch's own keys).
  const int k = threadIdx.x >> 1, half = threadIdx.x & 1;
  const int s = chunk_lo + k;
  const bool valid = s >= lo && s <= hi;
  const bool active = kSplitRow || half == 0;
  const int first = a.history ? a.history[t] : (a.positions ? a.positions[0] : a.first_position);
  const bool early = a.history_stable && s < first;
  const int32_t* table = RowBlockTable(a.block_table, a.token_seq, a.block_table_stride, t);
  unsigned char* v_dst = s_raw + k * kRowBytes + (kSplitRow ? half * kPartBytes : 0);
  constexpr int kLoads = kPartBytes / 16;
  uint4 kv[kLoads];
  const size_t off = valid ? ((static_cast<size_t>(table[s / P]) * P + s % P) * K + kvh) * kRowBytes +
                                 (kSplitRow ? half * kPartBytes : 0)
                           : 0;
  auto fetch = [&]() {
    const uint4* krow = reinterpret_cast<const uint4*>(k_base + off);
    const uint32_t v_sh = static_cast<uint32_t>(__cvta_generic_to_shared(v_dst));
#pragma unroll
    for (int c = 0; c < kLoads; ++c) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(v_sh + 16 * c), "l"(v_base + off + 16 * c));
    }
#pragma unroll
    for (int c = 0; c < kLoads; ++c) kv[c] = krow[c];
  };
  if (valid && active && early) fetch();
  WaitReleasing(a.release_after_wait);
  DL_ATTN_MARK(0);
  if (valid && active && !early) fetch();
  if (!valid && active) {  // outside the visible range: p will be 0; V must be finite
#pragma unroll
    for (int c = 0; c < kLoads; ++c) reinterpret_cast<uint4*>(v_dst)[c] = make_uint4(0, 0, 0, 0);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    s_q[i / D][i % D] = Bf16BitsToFloat(a.q[(static_cast<size_t>(t) * H + kvh * G) * D + i]);
  }
  __syncthreads();  // s_q
  DL_ATTN_MARK(1);
  {
    float sc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) sc[g] = 0.0f;
    if (valid && active) {
      const int dim0 = kSplitRow ? half * kPartDims : 0;
#pragma unroll
      for (int c = 0; c < kLoads; ++c) {
        float kf[kVec];
        if constexpr (KV == KvDtype::kFp8) {
          Fp8x8ToFloat(make_uint2(kv[c].x, kv[c].y), kf);
          Fp8x8ToFloat(make_uint2(kv[c].z, kv[c].w), kf + 8);
        } else {
          Bf16x8ToFloat(kv[c], kf);
        }
        const int d0 = dim0 + c * kVec;
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int e = 0; e < kVec; e += 4) {
            const float4 qv = *reinterpret_cast<const float4*>(&s_q[g][d0 + e]);
            sc[g] = fmaf(qv.x, kf[e], sc[g]);
            sc[g] = fmaf(qv.y, kf[e + 1], sc[g]);
            sc[g] = fmaf(qv.z, kf[e + 2], sc[g]);
            sc[g] = fmaf(qv.w, kf[e + 3], sc[g]);
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float other = __shfl_xor_sync(0xffffffffu, sc[g], 1);
      const float dot = half == 0 ? sc[g] + other : other + sc[g];  // lower half + upper half
      if (half == 0) s_p[g][k] = valid ? dot * score_scale : -INFINITY;
    }
  }
  DL_ATTN_MARK(2);
  __syncthreads();

  // ---- Stage 2: chunk softmax statistics, warp g for query head g.
  if (warp < G) {
    const int g = warp;
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
      if constexpr (kCluster) {
        s_cm[g] = mx, s_cl[g] = sum;
      } else {
        ws_m[part(g)] = mx;
        ws_l[part(g)] = sum;
      }
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads();  // s_p probabilities and every V row in shared memory
  DL_ATTN_MARK(3);

  // ---- Stage 3: warp g owns query head g, each lane kDimsPerLane dims; o += p_k * v_k over all C
  // keys in ascending order (keys outside the visible range have p = 0 and v = 0).
  const float v_scale = KV == KvDtype::kFp8 ? a.v_scale : 1.0f;
  const int d0 = lane * kDimsPerLane;
  if (warp < G && d0 < D) {
    const int g = warp;
    float acc[kDimsPerLane];
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e) acc[e] = 0.0f;
    const unsigned char* vcol = s_raw + d0 * kElemBytes;
#pragma unroll 2
    for (int k0 = 0; k0 < C; k0 += 8) {
      const float4 p0 = *reinterpret_cast<const float4*>(&s_p[g][k0]);
      const float4 p1 = *reinterpret_cast<const float4*>(&s_p[g][k0 + 4]);
      const float pk[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
      float vf[8][kDimsPerLane];
#pragma unroll
      for (int u = 0; u < 8; ++u) LoadKvDims<kDimsPerLane, KV>(vcol + (k0 + u) * kRowBytes, vf[u]);
#pragma unroll
      for (int u = 0; u < 8; ++u)
#pragma unroll
        for (int e = 0; e < kDimsPerLane; ++e) acc[e] = fmaf(pk[u], vf[u][e], acc[e]);
    }
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e) {
      if constexpr (kCluster) {
        s_co[g][d0 + e] = acc[e] * v_scale;
      } else {
        ws_o[part(g) * D + d0 + e] = acc[e] * v_scale;
      }
    }
  }
  DL_ATTN_MARK(4);
  arrive_and_merge();
  DL_ATTN_MARK(5);
  DL_ATTN_REPORT();
}

}  // namespace dev

template <int D, int G, int P, KvDtype KV, bool SLIDING>
Status LaunchSplitAttention(const AttentionParams& params, Stream stream) {
  AttentionParams p = params;
  if (p.softmax_scale <= 0.0f) p.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  const int num_chunks = AttentionMaxChunks(p);
  dim3 grid(num_chunks, p.num_kv_heads, p.num_tokens);
  // The SMs attention runs on keep the largest shared-memory carveout, so the next kernel's blocks
  // (the o_proj GEMV: ~145 KB each as the default streaming kernel, ~195 KB as the staged one) can
  // become resident beside it and copy their first weights while it runs; an SM can change its
  // carveout only when idle. Added for the staged kernel (session 4) and kept since: every TPOT
  // figure from then on was measured with it.
  const bool cluster = num_chunks <= std::min(p.cluster_max_chunks, kAttnMaxClusterChunks) && dev::DeviceHasClusters();
  auto launch = [&](auto kernel) -> cudaError_t {
    static const bool carveout = [&] {  // a hint: a failure leaves the default, never a wrong result
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared) !=
          cudaSuccess) {
        (void)cudaGetLastError();  // not for the launch check below
        return false;
      }
      return true;
    }();
    (void)carveout;
    return dev::LaunchDependentCluster(kernel, grid, dim3(256), 0, cluster ? static_cast<unsigned>(num_chunks) : 0u,
                                       reinterpret_cast<cudaStream_t>(stream), p, num_chunks);
  };
  const cudaError_t e = cluster ? launch(dev::SplitAttentionKernel<D, G, P, KV, SLIDING, true>)
                                : launch(dev::SplitAttentionKernel<D, G, P, KV, SLIDING, false>);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Internal("launching {}{} failed: {}", CanonicalName(PresetKeyOf(p)), cluster ? " (cluster merge)" : "",
                    cudaGetErrorString(e));
  }
  DL_KERNEL_LAUNCH_CHECK(CanonicalName(PresetKeyOf(p)));
  return Status::Ok();
}

}  // namespace dl::kernels
