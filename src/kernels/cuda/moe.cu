// MoE for T tokens, three launches, no host round trip (token t: the grid's last dimension):
//   1. router GEMV over E rows (warp per expert) + last-block top-k selection (ticket counter used for
//      scheduling only; selection and weights come from one block in a fixed order);
//   2. gate/up of the k selected experts and the shared expert (warp per (slot, row): both rows' loads
//      in flight together), SwiGLU;
//   3. down projections (ceil(k/4) warps per output row, each with 4 routed rows and, for the first,
//      the shared row loaded together) + the weighted combine in slot order.
// Expert ids never leave the device: the router's last block writes the selected experts' base
// pointers into the workspace, and kernels 2 and 3 read those. Batch 1 is memory-bound: the point of
// the layout is enough 16-byte loads in flight per SM (~64 KB) to keep HBM busy, with FMAs in the
// reference's per-lane order.
#include <algorithm>
#include <array>
#include <iterator>
#include <utility>

#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/fp8_weights.cuh"
#include "kernels/cuda/mma_product.cuh"
#include "kernels/cuda/norm_block.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kMoeWarps = 8;
constexpr int kMoeMaxExperts = 1024;
constexpr int kMoeMaxTopK = 32;
constexpr int kDownGroup = 4;  // routed slots whose down rows one warp loads together

struct MoeWs {
  float* logits;      // [E]
  float* weights;     // [k]
  const bf16** rows;  // [3, k]: gate, up and down base pointers of each selected expert (FP8 experts:
                      // their code pointers)
  uint16_t* h;        // [k+1, h_stride]
  int h_stride;       // max(F, Fs)
  int32_t* ids;       // [k] the selected expert ids (FP8 experts: index their scale pointer arrays)
};
__host__ __device__ inline size_t Align16(size_t x) { return (x + 15) & ~size_t{15}; }
// One token's workspace: byte offsets of MoeWs's arrays and the total; the one place that knows it.
struct MoeWsLayout {
  size_t logits, weights, rows, h, ids, bytes;
  int h_stride;
};
__host__ __device__ inline MoeWsLayout MoeWorkspaceLayout(int E, int k, int ffn, int shared_ffn) {
  MoeWsLayout l;
  l.h_stride = ffn > shared_ffn ? ffn : shared_ffn;
  size_t off = 0;
  l.logits = off, off += Align16(E * sizeof(float));
  l.weights = off, off += Align16(k * sizeof(float));
  l.rows = off, off += Align16(3 * k * sizeof(void*));
  l.h = off, off += Align16((k + 1) * static_cast<size_t>(l.h_stride) * sizeof(uint16_t));
  l.ids = off, off += Align16(k * sizeof(int32_t));
  l.bytes = off;
  return l;
}
// Token t's slice of the workspace.
__host__ __device__ inline MoeWs MoeWorkspace(const MoeParams& a, int t) {
  const MoeWsLayout l = MoeWorkspaceLayout(a.num_experts, a.top_k, a.ffn, a.shared_ffn);
  char* base = static_cast<char*>(a.workspace) + t * l.bytes;
  return {reinterpret_cast<float*>(base + l.logits), reinterpret_cast<float*>(base + l.weights),
          reinterpret_cast<const bf16**>(base + l.rows), reinterpret_cast<uint16_t*>(base + l.h), l.h_stride,
          reinterpret_cast<int32_t*>(base + l.ids)};
}

// Per-lane partial dots of NR BF16 rows (row r: n8[r] chunks, with vector xs[r]; a null row is skipped)
// over the 16-byte chunks lane, lane+32, ..., in ascending order: the FMA sequence per row is the same
// whatever NR and U are. U chunks per row are loaded before any is used (NR * U loads in flight).
// before_use() runs once, after the first batch of row loads is issued and before any xs is read: the
// rows are weights (independent of earlier kernels) but xs are not, so this is where the warp waits
// (and where the router computes its fused input norm) with its weight loads in flight. The trip
// count depends on n8 only, never on which rows are null, and is the same for every lane, so a
// before_use that synchronises the block runs at one point of the code in every warp that passes
// the same n8.
template <int NR, int U, typename BeforeUse>
__device__ __forceinline__ void LaneDots(const bf16* const (&rows)[NR], const bf16* const (&xs)[NR],
                                         const int (&n8)[NR], int lane, float (&acc)[NR],
                                         BeforeUse&& before_use) {
  int n8max = 0;
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    acc[r] = 0.0f;
    n8max = max(n8max, n8[r]);
  }
  bool used = false;
  for (int base = 0; base < n8max; base += 32 * U) {
    const int c0 = base + lane;
    uint4 rv[NR][U];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (rows[r] && c0 + 32 * u < n8[r]) rv[r][u] = LoadStreaming(reinterpret_cast<const uint4*>(rows[r]) + c0 + 32 * u);
    if (!used) {
      before_use();
      used = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (!rows[r] || c >= n8[r]) continue;
        float rf[8], xf[8];
        Bf16x8ToFloat(rv[r][u], rf);
        Bf16x8ToFloat(reinterpret_cast<const uint4*>(xs[r])[c], xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r] = fmaf(rf[e], xf[e], acc[r]);
      }
    }
  }
  if (!used) before_use();
}
// A pointer another kernel wrote, read from L2 (not L1, which is not coherent across kernels).
__device__ __forceinline__ const bf16* LoadPointerFromL2(const bf16* const* p) {
  return reinterpret_cast<const bf16*>(__ldcg(reinterpret_cast<const unsigned long long*>(p)));
}
struct NothingToWaitFor {
  __device__ void operator()() const {}
};
struct WaitForEarlierKernels {
  __device__ void operator()() const { WaitForPrerequisites(); }
};

// NR rows of n8 chunks each (a null row is skipped: its sums are garbage-free zeros) dotted with nt <= TT
// vectors staged in shared memory (xs: [nt][n8] 16-byte chunks): acc[r][tt] with LaneDots' per-lane
// order (chunks lane, lane + 32, ... ascending, the 8 elements of a chunk in order), so acc[r][tt] is
// LaneDots' sum of row r with vector tt whatever NR, TT and U are. U chunks of each row are loaded at
// once; the vectors come from shared memory, so no token's load waits behind another's. before_use()
// runs as in LaneDots: once in every warp, after the first batch of row loads is issued and before any
// xs is read (the trip count depends on n8 only).
template <int NR, int TT, int U, typename BeforeUse>
__device__ __forceinline__ void SmemLaneDots(const bf16* const (&rows)[NR], const uint4* xs, int nt, int n8, int lane,
                                             float (&acc)[NR][TT], BeforeUse&& before_use) {
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) acc[r][tt] = 0.0f;
  bool used = false;
  for (int base = 0; base < n8; base += 32 * U) {
    const int c0 = base + lane;
    uint4 rv[NR][U];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (rows[r] && c0 + 32 * u < n8) rv[r][u] = LoadStreaming(reinterpret_cast<const uint4*>(rows[r]) + c0 + 32 * u);
    if (!used) {
      before_use();
      used = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= n8) break;
      float rf[NR][8];
#pragma unroll
      for (int r = 0; r < NR; ++r) Bf16x8ToFloat(rows[r] ? rv[r][u] : make_uint4(0, 0, 0, 0), rf[r]);
#pragma unroll
      for (int tt = 0; tt < TT; ++tt) {
        if (tt >= nt) break;
        float xf[8];
        Bf16x8ToFloat(xs[tt * n8 + c], xf);
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][tt] = fmaf(rf[r][e], xf[e], acc[r][tt]);
      }
    }
  }
  if (!used) before_use();
}
template <int NR, int TT, int U>
__device__ __forceinline__ void SmemLaneDots(const bf16* const (&rows)[NR], const uint4* xs, int nt, int n8, int lane,
                                             float (&acc)[NR][TT]) {
  SmemLaneDots<NR, TT, U>(rows, xs, nt, n8, lane, acc, NothingToWaitFor{});
}

// ---- The router. MoeRouterKernel<kRows>: grid (ceil(E / 8), ceil(T / kRows)); block (x, y) takes
// experts e = 8x .. 8x + 7 (warp w: e = 8x + w) and token rows t0 = kRows y .. t0 + rows - 1 (rows =
// min(kRows, T - t0)). A warp's logit for (t, e) is bf16 of the warp sum of LaneDots' per-lane FMA
// sequence of router row e with token t's vector, whatever kRows is; then each of the block's rows
// takes an arrival ticket (MoeParams::counter[t] counts the blocks along x), and the last arrival of a
// token selects its experts (RouterTopK) from the logits every block of the token wrote.
//   kRows 1 (decode): one token per block, router row e dotted by LaneDots.
//   kRows > 1 (prefill, T >= MoeParams::router_rows_min_tokens): grid (ceil(E / 8 N), ...), a warp
//   loads N = kRouterRowExperts router rows (e = 8 (N x + r) + w) once per block and dots them with the
//   block's rows staged in shared memory (SmemLaneDots: each row's sum in LaneDots' order whatever
//   the number of rows), so the [E, d] router matrix is read ceil(T / kRows) times instead of T
//   times, and the block's fused norm runs once for its rows together (FusedNormRows, each row
//   FusedNormRow's bits) for 8 N experts.
// Logits, selection, weights, expert pointers, u2 and the updated residual are the same bits either way.
//
// Dynamic shared memory: first the block's vectors ([rows][d] BF16): with a fused input norm, the rows'
// u2, computed by every block of the rows after its router-row loads are issued (block x = 0 writes
// it to x for the expert kernels, and the updated residual); kRows > 1 without the norm, the rows of
// x copied there; kRows 1 without the norm, nothing (LaneDots reads x). kRows > 1: after the dots the
// same bytes hold the selection's scratch (RouterTopKScratch, [kRows] tokens). Then the [3][E] expert
// pointer tables (gate, up, down) and the [E] correction biases as FP32, copied before the wait (they
// never change), so the block that selects the experts writes their pointers and reads the biases
// without one more dependent memory round trip each.
constexpr int kRouterRows = 8;  // token rows per block of the multi-row router
// Router rows per warp of the multi-row router (block x: experts 8 N x .. + 8 N, N = kRouterRowExperts,
// warp w the rows 8 (N x + r) + w): each block's fused norm of its token rows, its pointer-table copy
// and its ticket serve 8 N experts instead of 8. kRouterRowChunks: chunks of each row in flight per
// lane (2 rows x 4 chunks fit the 128-register cap without spills; 4 rows spill at 1 or 2 chunks).
constexpr int kRouterRowExperts = 2, kRouterRowChunks = 4;
// The multi-row router's register cap: 2 blocks per SM (128 registers, no spills with 8 rows; 3 blocks
// per SM spill).
constexpr int kRouterRowsMinBlocks = 2;

// The selection's shared-memory arrays, per token v of a block's batch: score[v * score_stride + e]
// the sigmoid score of expert e; cand_b / cand_id[v * cand_stride + c * k + r] the r-th candidate of
// 32-expert chunk c (biased score, id; -1: a lane past E); sel[v * sel_stride + j] the j-th selected id.
struct RouterTopKScratch {
  float* score;
  float* cand_b;
  int* cand_id;
  int* sel;
  int score_stride, cand_stride, sel_stride;
};
__host__ __device__ inline int RouterCandidates(int E, int k) { return (E + 31) / 32 * k; }
__host__ __device__ inline size_t RouterTopKScratchBytes(int E, int k, int tokens) {
  return static_cast<size_t>(tokens) * (E + 2 * RouterCandidates(E, k) + k) * sizeof(float);
}
__device__ __forceinline__ RouterTopKScratch RouterTopKScratchAt(void* base, int E, int k, int tokens) {
  const int cands = RouterCandidates(E, k);
  float* score = static_cast<float*>(base);
  float* cand_b = score + static_cast<size_t>(tokens) * E;
  int* cand_id = reinterpret_cast<int*>(cand_b + static_cast<size_t>(tokens) * cands);
  int* sel = cand_id + static_cast<size_t>(tokens) * cands;
  return {score, cand_b, cand_id, sel, E, cands, k};
}
__host__ __device__ inline size_t RouterVectorBytes(const MoeParams& a, int rows) {
  const size_t vectors = static_cast<size_t>(rows) * a.d * sizeof(uint16_t);
  if (rows == 1) return a.norm.residual ? AlignUp(vectors, 16) : 0;
  const size_t scratch = RouterTopKScratchBytes(a.num_experts, a.top_k, rows);
  return AlignUp(vectors > scratch ? vectors : scratch, 16);
}
__host__ __device__ inline size_t RouterPointerTableOffset(const MoeParams& a, int rows) { return RouterVectorBytes(a, rows); }
__host__ __device__ inline size_t RouterBiasOffset(const MoeParams& a, int rows) {
  return RouterPointerTableOffset(a, rows) + 3 * sizeof(void*) * a.num_experts;
}
__host__ __device__ inline size_t RouterSharedBytes(const MoeParams& a, int rows) {
  return RouterBiasOffset(a, rows) + sizeof(float) * a.num_experts;
}

// Selects the experts of the m <= kTokens tokens tok[0 .. m) (tok: the same in every thread), whose
// logits every block of the token has written and whose ticket elected this block; every thread of
// the block calls it, after a barrier that follows the ticket. kTokens > 1 first stages the m tokens'
// logits in `score` (all their loads in flight at once) and then runs each round over the m tokens
// together; kTokens 1 reads the logits in the first round.
//
// Top-k in two rounds instead of an O(E^2) rank pass: each warp ranks a 32-expert chunk with
// shuffles and keeps its first k as candidates; a candidate's rank among all candidates is then its
// true rank when that is below k (every expert ahead of a true top-k member is itself in its
// chunk's first k) and at least k otherwise. The order is total (higher biased score first, ties
// to the lower id; NaN never wins), so this is exactly the iterative top-k, and a token's selection
// and weights do not depend on which other tokens share the call.
template <int kTokens>
__device__ __forceinline__ void RouterTopK(const MoeParams& a, const int* tok, int m, const RouterTopKScratch& s,
                                           const bf16* const* s_ptr, const float* s_bias) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int E = a.num_experts, k = a.top_k;
  auto ahead = [](float b_other, int id_other, float b, int id) {
    return b_other > b || (b_other == b && id_other < id);
  };
  if constexpr (kTokens > 1) {
    for (int idx = threadIdx.x; idx < m * E; idx += kMoeWarps * 32) {
      const int v = idx / E, i = idx - v * E;
      s.score[v * s.score_stride + i] = __ldcg(&MoeWorkspace(a, tok[v]).logits[i]);
    }
    __syncthreads();
  }
  const int chunks = (E + 31) / 32;
  for (int q = warp; q < m * chunks; q += kMoeWarps) {
    const int v = kTokens == 1 ? 0 : q / chunks, c = q - v * chunks;
    float* score = s.score + v * s.score_stride;
    const int i = c * 32 + lane;
    float b = -INFINITY;
    if (i < E) {
      float z = kTokens == 1 ? __ldcg(&MoeWorkspace(a, tok[0]).logits[i]) : score[i];
      if (a.softcap > 0.0f) z = a.softcap * tanhf(z / a.softcap);
      const float sc = 1.0f / (1.0f + expf(-z));
      // s_bias was filled before the wait; the ticket's barriers order it before this read.
      b = sc + s_bias[i];
      if (isnan(b)) b = -INFINITY;
      score[i] = sc;
    }
    int rank = 0;
#pragma unroll
    for (int l = 0; l < 32; ++l) rank += ahead(__shfl_sync(0xffffffffu, b, l), c * 32 + l, b, i);
    if (rank < k) {  // lanes past E rank after every real expert of the chunk
      s.cand_b[v * s.cand_stride + c * k + rank] = b;
      s.cand_id[v * s.cand_stride + c * k + rank] = i < E ? i : -1;
    }
  }
  __syncthreads();
  // Second round: four consecutive threads share a candidate, each counting the candidates ahead of
  // it (of the same token) in one quarter of the list; two shuffles add the quarters (a count: the
  // order is irrelevant).
  const int cands = chunks * k;  // <= 32 * 32
  const int quarter = (cands + 3) / 4;
  for (int q0 = 0; q0 < m * cands; q0 += kMoeWarps * 32 / 4) {  // same trip count in every lane
    const int qq = q0 + static_cast<int>(threadIdx.x >> 2), part = threadIdx.x & 3;
    const int v = kTokens == 1 ? 0 : qq / cands, q = qq - v * cands;
    const float* cand_b = s.cand_b + v * s.cand_stride;
    const int* cand_id = s.cand_id + v * s.cand_stride;
    const int id = qq < m * cands ? cand_id[q] : -1;
    const float b = qq < m * cands ? cand_b[q] : 0.0f;
    int rank = 0;
    if (id >= 0) {
      const int o_end = min(cands, (part + 1) * quarter);
      for (int o = part * quarter; o < o_end; ++o) rank += cand_id[o] >= 0 && ahead(cand_b[o], cand_id[o], b, id);
    }
    rank += __shfl_xor_sync(0xffffffffu, rank, 1);
    rank += __shfl_xor_sync(0xffffffffu, rank, 2);
    if (id >= 0 && part == 0 && rank < k) s.sel[v * s.sel_stride + rank] = id;
  }
  __syncthreads();
  // Thread (v, j) writes token v's slot j: the expert's base pointers (resolved here once, so the
  // expert kernels start with one dependent load, the pointer, instead of two) and its weight, after
  // adding the k scores in slot order (the reference's sum, the same in every thread).
  for (int idx = threadIdx.x; idx < m * k; idx += kMoeWarps * 32) {
    const int v = kTokens == 1 ? 0 : idx / k, j = idx - v * k;
    const int t = tok[v];
    const MoeWs ws = MoeWorkspace(a, t);
    const int* sel = s.sel + v * s.sel_stride;
    const float* score = s.score + v * s.score_stride;
    const int e = sel[j];
    // s_ptr is complete: __syncthreads since the copy.
    ws.rows[j] = s_ptr[e];
    ws.rows[k + j] = s_ptr[E + e];
    ws.rows[2 * k + j] = s_ptr[2 * E + e];
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) sum += score[sel[i]];
    const float w = RoundBf16(score[e] / sum);
    ws.weights[j] = w;
    ws.ids[j] = e;
    if (a.topk_ids) a.topk_ids[t * k + j] = e;
    if (a.topk_weights) a.topk_weights[t * k + j] = w;
  }
  if (threadIdx.x < m) a.counter[tok[threadIdx.x]] = 0u;
}

// The selecting block's tables: the experts' base pointers [3][E] (gate, up, down) and the
// correction biases as FP32. They never change, so every router block copies them before its wait.
__device__ __forceinline__ void CopyRouterTables(const MoeParams& a, const bf16** s_ptr, float* s_bias) {
  const int E = a.num_experts;
  // FP8 routed experts: their code pointers take the BF16 pointers' place (the expert kernels know which).
  const bf16* const* gate_table = a.gate_fp8.on() ? reinterpret_cast<const bf16* const*>(a.gate_fp8.codes) : a.gate_w;
  const bf16* const* up_table = a.up_fp8.on() ? reinterpret_cast<const bf16* const*>(a.up_fp8.codes) : a.up_w;
  const bf16* const* down_table = a.down_fp8.on() ? reinterpret_cast<const bf16* const*>(a.down_fp8.codes) : a.down_w;
  for (int i = threadIdx.x; i < E; i += kMoeWarps * 32) {
    s_ptr[i] = gate_table[i], s_ptr[E + i] = up_table[i], s_ptr[2 * E + i] = down_table[i];
    s_bias[i] = Bf16BitsToFloat(a.router_bias[i]);
  }
}

template <int kRows>
__global__ void __launch_bounds__(kMoeWarps * 32, kRows == 1 ? 1 : kRouterRowsMinBlocks) MoeRouterKernel(MoeParams a) {
  DL_TIMELINE_SCOPE(kMoeRouter);
  AllowDependentsAtStart(a.router_release_after_wait);
  const int t0 = static_cast<int>(blockIdx.y) * kRows;
  const int rows = min(kRows, a.num_tokens - t0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int E = a.num_experts;
  constexpr int kNE = kRows == 1 ? 1 : kRouterRowExperts;  // router rows per warp: e + r kMoeWarps
  const int e = blockIdx.x * kMoeWarps * kNE + warp;
  extern __shared__ uint4 s_u[];
  const bf16** s_ptr = reinterpret_cast<const bf16**>(reinterpret_cast<unsigned char*>(s_u) + RouterPointerTableOffset(a, kRows));
  float* s_bias = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(s_u) + RouterBiasOffset(a, kRows));
  CopyRouterTables(a, s_ptr, s_bias);
  const FusedInputNorm& nm = a.norm;
  const bool fused = nm.residual != nullptr;
  const size_t row = static_cast<size_t>(t0) * a.d;
  // Every warp runs the dots (a warp past E with a null row) so the block-wide norm is reached by all.
  if constexpr (kRows == 1) {
    const bf16* router_row = e < E ? a.router_w + static_cast<size_t>(e) * a.d : nullptr;
    auto wait_then_norm = [&] {
      NormWeights weight;
      if (fused) {
        weight = LoadNormWeights(nm.weight, a.d);
        PrefetchNormResidual(nm, row, a.d, 1, kMoeWarps * 32);
      }
      WaitReleasing(a.router_release_after_wait);
      if (fused) FusedNormRow(nm, row, weight, a.d, blockIdx.x == 0, reinterpret_cast<uint16_t*>(s_u));
    };
    const bf16* rw[1] = {router_row};
    const bf16* xs[1] = {fused ? reinterpret_cast<const bf16*>(s_u) : a.x + row};
    const int n8[1] = {a.d / 8};
    float acc[1];
    LaneDots<1, 8>(rw, xs, n8, lane, acc, wait_then_norm);
    const float z = WarpSum(acc[0]);
    if (e < E && lane == 0) MoeWorkspace(a, t0).logits[e] = RoundBf16(z);
  } else {
    auto wait_then_stage = [&] {
      NormWeights weight;
      if (fused) {
        weight = LoadNormWeights(nm.weight, a.d);
        PrefetchNormResidual(nm, row, a.d, rows, kMoeWarps * 32);
      }
      WaitReleasing(a.router_release_after_wait);
      if (fused) {
        FusedNormRows<kRows>(nm, row, rows, weight, a.d, blockIdx.x == 0, reinterpret_cast<uint16_t*>(s_u));
      } else {
        const uint4* x = reinterpret_cast<const uint4*>(a.x + row);
        for (int c = threadIdx.x; c < rows * (a.d / 8); c += kMoeWarps * 32) s_u[c] = x[c];
        __syncthreads();
      }
    };
    const bf16* rw[kNE];
#pragma unroll
    for (int r = 0; r < kNE; ++r) {
      const int er = e + r * kMoeWarps;
      rw[r] = er < E ? a.router_w + static_cast<size_t>(er) * a.d : nullptr;
    }
    float acc[kNE][kRows];
    SmemLaneDots<kNE, kRows, kRouterRowChunks>(rw, s_u, rows, a.d / 8, lane, acc, wait_then_stage);
#pragma unroll
    for (int v = 0; v < kRows; ++v) {
      if (v >= rows) break;
#pragma unroll
      for (int r = 0; r < kNE; ++r) {
        const float z = WarpSum(acc[r][v]);
        const int er = e + r * kMoeWarps;
        if (er < E && lane == 0) MoeWorkspace(a, t0 + v).logits[er] = RoundBf16(z);
      }
    }
  }
  // The tickets: lane v < rows of warp 0 arrives for token t0 + v; the tokens this block arrived last
  // for are listed in s_tok (ascending).
  __shared__ int s_tok[kRows];
  __shared__ int s_selecting;
  __syncthreads();
  if (warp == 0) {
    bool last = false;
    if (lane < rows) {
      __threadfence();
      last = atomicAdd(&a.counter[t0 + lane], 1u) == gridDim.x - 1;
    }
    const unsigned mask = __ballot_sync(0xffffffffu, last);
    if (last) s_tok[__popc(mask & ((1u << lane) - 1u))] = t0 + lane;
    if (lane == 0) s_selecting = __popc(mask);
  }
  __syncthreads();
  const int m = s_selecting;
  if (m == 0) return;
  __threadfence();
  if constexpr (kRows == 1) {
    __shared__ float s_score[kMoeMaxExperts];
    __shared__ float s_cand_b[kMoeMaxExperts];
    __shared__ int s_cand_id[kMoeMaxExperts];
    __shared__ int s_sel[kMoeMaxTopK];
    RouterTopK<1>(a, s_tok, 1, RouterTopKScratch{s_score, s_cand_b, s_cand_id, s_sel, 0, 0, 0}, s_ptr, s_bias);
  } else {
    // The vectors are dead: every warp's dots ended before the ticket's barrier.
    RouterTopK<kRows>(a, s_tok, m, RouterTopKScratchAt(s_u, E, a.top_k, kRows), s_ptr, s_bias);
  }
}

// The router over precomputed logits (MoeParams::router_logits): grid ceil(T / kRouterRows), block
// x's tokens t0 = kRouterRows x .. + rows. The block puts its tokens' logits where the router's dots
// put theirs (the token's workspace, as FP32 of the BF16 values) and selects them all
// (RouterTopK<kRouterRows>): the selection, weights, expert pointers and ids of the router above.
__global__ void __launch_bounds__(kMoeWarps * 32) MoeSelectKernel(MoeParams a) {
  DL_TIMELINE_SCOPE(kMoeRouter);
  AllowDependentsAtStart(a.router_release_after_wait);
  const int t0 = static_cast<int>(blockIdx.x) * kRouterRows;
  const int rows = min(kRouterRows, a.num_tokens - t0);
  const int E = a.num_experts;
  extern __shared__ uint4 s_u[];
  const bf16** s_ptr =
      reinterpret_cast<const bf16**>(reinterpret_cast<unsigned char*>(s_u) + RouterPointerTableOffset(a, kRouterRows));
  float* s_bias = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(s_u) + RouterBiasOffset(a, kRouterRows));
  CopyRouterTables(a, s_ptr, s_bias);
  __shared__ int s_tok[kRouterRows];
  if (threadIdx.x < kRouterRows) s_tok[threadIdx.x] = t0 + static_cast<int>(threadIdx.x);
  WaitReleasing(a.router_release_after_wait);  // the logits are the previous kernel's
  for (int idx = threadIdx.x; idx < rows * E; idx += kMoeWarps * 32) {
    const int v = idx / E, e = idx - v * E;
    MoeWorkspace(a, t0 + v).logits[e] = Bf16BitsToFloat(a.router_logits[static_cast<size_t>(t0 + v) * E + e]);
  }
  __syncthreads();  // the block's own global writes are visible to its threads after the barrier
  RouterTopK<kRouterRows>(a, s_tok, rows, RouterTopKScratchAt(s_u, E, a.top_k, kRouterRows), s_ptr, s_bias);
}

// The expert kernels' shape: at least kMinBlocks blocks per SM (the register cap) and kU chunks per row
// in flight per lane. Gate/up {3, 4}, down {4, 1} measured fastest of those tried (docs/performance.md,
// session 4); down at 4 blocks per SM holds all its blocks in one wave.
constexpr int kGateUpMinBlocks = 3, kGateUpChunks = 4;
constexpr int kDownMinBlocks = 4, kDownChunks = 1;

// Grid (ceil(Fmax / 8), k + 1, T). blockIdx.y 0 is the shared expert (slot k of h), 1..k the routed
// slots 0..k-1: blocks are scheduled in index order, so the shared expert's, which need not wait for
// the router, are resident first and stream their weights during the router's selection, instead of
// queueing behind routed blocks that hold every free slot while they wait.
template <int kMinBlocks, int kU>
__global__ void __launch_bounds__(kMoeWarps * 32, kMinBlocks) MoeGateUpKernel(MoeParams a) {
  DL_TIMELINE_SCOPE(kMoeGateUp);
  // A routed block lets the down kernel launch only after its own wait: the down kernel reads the
  // router's expert pointers before its wait, which is safe only once every routed block has seen
  // the router complete.
  const bool shared = blockIdx.y == 0;
  const bool late = !shared;
  AllowDependentsAtStart(late);
  const int t = blockIdx.z;
  const MoeWs ws = MoeWorkspace(a, t);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = shared ? a.top_k : static_cast<int>(blockIdx.y) - 1;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int f = blockIdx.x * kMoeWarps + warp;
  if (f >= F) {
    if (late) WaitReleasing(late);  // the block's trigger must still follow the router
    return;
  }
  const bf16* x = a.x + static_cast<size_t>(t) * a.d;
  const bf16* xs[2] = {x, x};
  const int n8[2] = {a.d / 8, a.d / 8};
  float acc[2];
  if (shared) {  // the shared expert's rows are known before the router has run
    const bf16* rows[2] = {a.shared_gate_w + static_cast<size_t>(f) * a.d,
                           a.shared_up_w + static_cast<size_t>(f) * a.d};
    LaneDots<2, kU>(rows, xs, n8, lane, acc, WaitForEarlierKernels{});
  } else {
    WaitReleasing(late);
    const bf16* rows[2] = {ws.rows[j] + static_cast<size_t>(f) * a.d,
                           ws.rows[a.top_k + j] + static_cast<size_t>(f) * a.d};
    LaneDots<2, kU>(rows, xs, n8, lane, acc, NothingToWaitFor{});
  }
  const float g = RoundBf16(WarpSum(acc[0]));
  const float u = RoundBf16(WarpSum(acc[1]));
  if (lane == 0) {
    const float act = RoundBf16(g / (1.0f + expf(-g)));
    ws.h[static_cast<size_t>(j) * ws.h_stride + f] = FloatToBf16Bits(act * u);
  }
}

// Grid (ceil(d / rows per block), T). Each output row gets ceil(k / kDownGroup) warps; warp r of a
// row loads the down rows of slots [r*kDownGroup, r*kDownGroup + kDownGroup) (and warp 0 the shared
// expert's) all at once, writes bf16(o_j * w_j) per slot to shared memory, and the row's first lane
// adds them in slot order — the same sum as one warp walking the slots.
__host__ __device__ inline int MoeDownWarpsPerRow(int top_k) { return (top_k + kDownGroup - 1) / kDownGroup; }

template <int kMinBlocks, int kU>
__global__ void __launch_bounds__(kMoeWarps * 32, kMinBlocks) MoeDownKernel(MoeParams a) {
  DL_TIMELINE_SCOPE(kMoeDown);
  const bool late = a.down_release_after_wait;
  AllowDependentsAtStart(late);
  const int t = blockIdx.y;
  const MoeWs ws = MoeWorkspace(a, t);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per_row = MoeDownWarpsPerRow(a.top_k);
  const int rows_per_block = kMoeWarps / per_row;
  const int local_row = warp / per_row, group = warp % per_row;
  const int i = blockIdx.x * rows_per_block + local_row;
  const bool live = local_row < rows_per_block && i < a.d;
  const bf16* shared_row = a.shared_down_w + static_cast<size_t>(live ? i : 0) * a.shared_ffn;
  if (!live) WaitReleasing(late);
  // The rows' first loads go out, then the wait (before h, written by gate/up, is read). The expert
  // pointers come from the router, complete by now (see MoeGateUpKernel); __ldcg because the
  // workspace is rewritten every layer and L1 is not coherent.
  auto wait_after_loads = [late] { WaitReleasing(late); };
  __shared__ float s_routed[kMoeWarps][kDownGroup];
  __shared__ float s_shared[kMoeWarps];
  const bf16* h = reinterpret_cast<const bf16*>(ws.h);
  if (live) {
    const int j0 = group * kDownGroup;
    const bf16* rows[kDownGroup + 1];
    const bf16* xs[kDownGroup + 1];
    int n8[kDownGroup + 1];
#pragma unroll
    for (int r = 0; r < kDownGroup; ++r) {
      const int j = j0 + r;
      rows[r] = j < a.top_k ? LoadPointerFromL2(&ws.rows[2 * a.top_k + j]) + static_cast<size_t>(i) * a.ffn : nullptr;
      xs[r] = h + static_cast<size_t>(j < a.top_k ? j : 0) * ws.h_stride;
      n8[r] = a.ffn / 8;
    }
    rows[kDownGroup] = group == 0 ? shared_row : nullptr;
    xs[kDownGroup] = h + static_cast<size_t>(a.top_k) * ws.h_stride;
    n8[kDownGroup] = a.shared_ffn / 8;
    float o[kDownGroup + 1];
    LaneDots<kDownGroup + 1, kU>(rows, xs, n8, lane, o, wait_after_loads);
#pragma unroll
    for (int r = 0; r < kDownGroup; ++r) {
      const float v = j0 + r < a.top_k ? RoundBf16(RoundBf16(WarpSum(o[r])) * ws.weights[j0 + r]) : 0.0f;
      if (lane == 0) s_routed[warp][r] = v;
    }
    if (group == 0) {
      const float sh = RoundBf16(WarpSum(o[kDownGroup]));
      if (lane == 0) s_shared[warp] = sh;
    }
  }
  __syncthreads();
  if (live && group == 0 && lane == 0) {
    float routed = 0.0f;
    for (int j = 0; j < a.top_k; ++j) routed += s_routed[warp + j / kDownGroup][j % kDownGroup];
    const float y = RoundBf16(RoundBf16(RoundBf16(routed) * a.alpha) + s_shared[warp]);
    a.y[static_cast<size_t>(t) * a.d + i] = FloatToBf16Bits(y);
  }
}

// ---- Streaming gate/up (MoeParams::gate_up_stream_ring_kb): batch 1. Work in units of kGuRows rows
// f0 .. f0 + 3 of one slot: those rows of its gate and of its up matrix, two bulk copies into one
// ring slot. The shared expert's units go round-robin over the blocks (each block's first, copied
// before the PDL wait: they need no router), the routed units in contiguous runs (slot-major, so
// mostly one expert's consecutive rows). The producer warp waits for the router before its first
// routed unit and then loads all 2k expert pointers at once. Consumers: warp w computes row w / 2 of
// matrix w % 2 (gate, up) with MoeGateUpKernel's lane order, warp sum and roundings; after a
// barrier of the 8 warps, kGuRows threads write h = bf16(bf16(silu(g)) * u): the same bits.
// Shared memory: [2 x kGuMaxSlots] mbarriers | ring [slots][2][kGuRows][d] BF16 | x [d] BF16 |
// g, u [2][kGuRows][2] FP32.
constexpr int kGuRows = kMoeWarps / 2;
constexpr int kGuMaxSlots = 16;
struct MoeGateUpStreamGeometry {
  int grid = 0, shared_units = 0, routed_units = 0, routed_per_block = 0, slots = 0;
  size_t slot_bytes = 0, ring_off = 0, x_off = 0, gu_off = 0, smem = 0;
};
inline MoeGateUpStreamGeometry GateUpStreamGeometry(int d, int ffn, int shared_ffn, int top_k, int ring_kb, int sms) {
  MoeGateUpStreamGeometry g;
  if (ring_kb <= 0 || sms < 1 || top_k < 1 || top_k > kMoeMaxTopK || ffn % kGuRows || shared_ffn % kGuRows) return g;
  g.shared_units = shared_ffn / kGuRows;
  g.routed_units = top_k * (ffn / kGuRows);
  g.routed_per_block = (g.routed_units + sms - 1) / sms;
  g.grid = (g.routed_units + g.routed_per_block - 1) / g.routed_per_block;
  const int units_per_block = g.routed_per_block + (g.shared_units + g.grid - 1) / g.grid;
  g.slot_bytes = 2 * kGuRows * static_cast<size_t>(d) * sizeof(uint16_t);
  const int slots = std::min<int>({units_per_block, kGuMaxSlots, static_cast<int>(static_cast<size_t>(ring_kb) * 1024 / g.slot_bytes)});
  if (slots < std::min(2, units_per_block)) return MoeGateUpStreamGeometry{};
  g.ring_off = RingOffset(kGuMaxSlots);
  g.x_off = g.ring_off + slots * g.slot_bytes;
  g.gu_off = g.x_off + AlignUp(static_cast<size_t>(d) * sizeof(uint16_t), 16);
  g.smem = g.gu_off + 2 * kGuRows * 2 * sizeof(float);
  if (g.smem > kMaxBlockSmem) return MoeGateUpStreamGeometry{};
  g.slots = slots;
  return g;
}

__global__ void __launch_bounds__((kMoeWarps + 1) * 32, 1) MoeGateUpStreamKernel(MoeParams a, MoeGateUpStreamGeometry g) {
  DL_TIMELINE_SCOPE(kMoeGateUp);
  // The trigger follows each consumer's own wait (the down kernel reads the router's pointers before
  // its wait; see MoeGateUpKernel).
  AllowDependentsAtStart(true);
  extern __shared__ __align__(128) unsigned char s_gu_stream[];
  uint64_t* full = reinterpret_cast<uint64_t*>(s_gu_stream);
  uint64_t* empty = full + kGuMaxSlots;
  unsigned char* ring = s_gu_stream + g.ring_off;
  uint4* s_x = reinterpret_cast<uint4*>(s_gu_stream + g.x_off);
  float* s_gu = reinterpret_cast<float*>(s_gu_stream + g.gu_off);  // [2][kGuRows][2]
  __shared__ const bf16* s_expert[2 * kMoeMaxTopK];                 // gate pointers, then up
  const MoeWs ws = MoeWorkspace(a, 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int k = a.top_k, n8 = a.d / 8;
  const int b = blockIdx.x;
  const int n_shared = b < g.shared_units ? (g.shared_units - b + g.grid - 1) / g.grid : 0;
  const int r_begin = b * g.routed_per_block, r_end = min(g.routed_units, r_begin + g.routed_per_block);
  const int n_units = n_shared + max(0, r_end - r_begin);
  const int units_per_slot = a.ffn / kGuRows;
  // Unit i of this block: its slot j (k = the shared expert) and first row.
  auto unit = [&](int i, int* j, int* f0) {
    if (i < n_shared) {
      *j = k, *f0 = (b + i * g.grid) * kGuRows;
    } else {
      const int u = r_begin + i - n_shared;
      *j = u / units_per_slot, *f0 = (u % units_per_slot) * kGuRows;
    }
  };
  InitRing(full, empty, g.slots, 2, kMoeWarps);  // two copies per slot: gate rows, up rows
  if (warp == kMoeWarps) {  // the producer warp; lane 0 issues
    bool have_pointers = false;
    const uint32_t bytes = kGuRows * static_cast<uint32_t>(a.d) * sizeof(uint16_t);
    for (int i = 0; i < n_units; ++i) {
      int j, f0;
      unit(i, &j, &f0);
      if (j < k && !have_pointers) {  // the first routed unit: the router must have completed
        WaitForGrid();
        for (int q = lane; q < 2 * k; q += 32) s_expert[q] = LoadPointerFromL2(&ws.rows[q]);
        __syncwarp();
        have_pointers = true;
      }
      if (lane == 0) {
        const int slot = i % g.slots, use = i / g.slots;
        if (use > 0) MbarWait(empty + slot, (use - 1) & 1);
        const bf16* gate = j == k ? a.shared_gate_w : s_expert[j];
        const bf16* up = j == k ? a.shared_up_w : s_expert[k + j];
        unsigned char* dst = ring + slot * g.slot_bytes;
        BulkCopyToShared(dst, gate + static_cast<size_t>(f0) * a.d, bytes, full + slot);
        BulkCopyToShared(dst + bytes, up + static_cast<size_t>(f0) * a.d, bytes, full + slot);
      }
    }
    return;
  }
  WaitReleasing(true);
  for (int c = threadIdx.x; c < n8; c += kMoeWarps * 32) s_x[c] = reinterpret_cast<const uint4*>(a.x)[c];
  ConsumerSync<kMoeWarps>();
  const int row = warp >> 1, mat = warp & 1;
  for (int i = 0; i < n_units; ++i) {
    int j, f0;
    unit(i, &j, &f0);
    const int slot = i % g.slots, use = i / g.slots;
    MbarWait(full + slot, use & 1);
    const uint4* w_row = reinterpret_cast<const uint4*>(ring + slot * g.slot_bytes) + (mat * kGuRows + row) * n8;
    const float v = RoundBf16(WarpSum(LaneDotShared(w_row, s_x, 0, n8, lane)));
    float* gu = s_gu + (i & 1) * kGuRows * 2;  // two buffers: the next unit's writes need no second barrier
    if (lane == 0) gu[row * 2 + mat] = v;
    __syncwarp();
    if (lane == 0) MbarArrive(empty + slot);
    ConsumerSync<kMoeWarps>();
    if (threadIdx.x < kGuRows) {
      const float gv = gu[threadIdx.x * 2], uv = gu[threadIdx.x * 2 + 1];
      const float act = RoundBf16(gv / (1.0f + expf(-gv)));
      ws.h[static_cast<size_t>(j) * ws.h_stride + f0 + threadIdx.x] = FloatToBf16Bits(act * uv);
    }
  }
}

// ---- The grouped path (T > 1): each selected expert's rows are read once for all the tokens routed
// to it. After the router (per token, as above):
//   1. MoeGroupKernel (one block) lists, from topk_ids [T, k], the experts selected at least once
//      (ascending id) and, per expert, its (token, slot) pairs t * k + j in ascending order;
//   2. MoeGroupGateUpKernel, grid (ceil(Fmax / kGroupRows), min(E, T k) + 1, ceil(T / kGroupSplit)):
//      block row 0 is the shared expert over all T tokens, row 1 + a the a-th listed expert (rows past
//      the list return at once); blockIdx.z takes kGroupSplit of the expert's tokens (the shared
//      expert's T tokens spread over more blocks at prefill). The block stages its (token, slot) list
//      in shared memory once, and then their x rows kGuTokens at a time; warp w computes gate and up rows
//      f = kGroupRows bx + w, + 8, ... for the staged tokens, with MoeGateUpKernel's lane order and
//      roundings: h(t, j)[f] in token t's workspace;
//   3. MoeGroupDownKernel, grid (ceil(d / kGroupRows), min(E, T k) + 1, ceil(T / kGroupSplit)),
//      likewise per output row i over the pairs' h vectors (kDownTokens at a time): bf16(bf16(o) *
//      w(t, j)) into routed [T k, d] (BF16), the shared expert's bf16(o) into shared [T, d];
//   4. MoeCombineKernel: y[t, i] = bf16(bf16(alpha * bf16(sum_j routed[t k + j, i])) + shared[t, i]),
//      slots in ascending order: MoeDownKernel's sum and roundings.
// The per-(token, row) arithmetic is MoeGateUpKernel's and MoeDownKernel's, so it does not depend on
// which other tokens share an expert: the grouped path gives the batch-1 kernels' bits.
constexpr int kGuTokens = 16;     // gate/up: x rows staged per pass (16 x d BF16 of shared memory)
constexpr int kDownTokens = 8;    // down: h vectors staged per pass
constexpr int kDownRows = 4;      // down: rows per warp at once
constexpr int kGroupRows = 64;    // rows per block (8 per warp): the block's set-up is paid once for them
constexpr int kGroupSplit = 64;   // tokens per block of one expert
constexpr size_t kGroupSmemBudget = 160 * 1024;

struct MoeGroupLayoutT {
  size_t active_count, active, begin, count, pairs, routed, shared, bytes;
};
__host__ __device__ inline MoeGroupLayoutT MoeGroupLayout(int E, int k, int d, int T) {
  MoeGroupLayoutT l;
  size_t off = 0;
  l.active_count = off, off += 16;
  l.active = off, off += Align16(E * sizeof(int32_t));
  l.begin = off, off += Align16(E * sizeof(int32_t));
  l.count = off, off += Align16(E * sizeof(int32_t));
  l.pairs = off, off += Align16(static_cast<size_t>(T) * k * sizeof(int32_t));
  l.routed = off, off += Align16(static_cast<size_t>(T) * k * d * sizeof(uint16_t));
  l.shared = off, off += Align16(static_cast<size_t>(T) * d * sizeof(uint16_t));
  l.bytes = off;
  return l;
}
struct MoeGroupWs {
  int32_t* active_count;  // [1]
  int32_t* active;        // [E]
  int32_t* begin;         // [E]
  int32_t* count;         // [E]
  int32_t* pairs;         // [T k]
  uint16_t* routed;       // [T k, d] BF16
  uint16_t* shared;       // [T, d] BF16
};
__host__ __device__ inline MoeGroupWs MoeGroupWorkspace(const MoeParams& a) {
  const MoeWsLayout per = MoeWorkspaceLayout(a.num_experts, a.top_k, a.ffn, a.shared_ffn);
  char* base = static_cast<char*>(a.workspace) + per.bytes * static_cast<size_t>(a.num_tokens);
  const MoeGroupLayoutT l = MoeGroupLayout(a.num_experts, a.top_k, a.d, a.num_tokens);
  return {reinterpret_cast<int32_t*>(base + l.active_count), reinterpret_cast<int32_t*>(base + l.active),
          reinterpret_cast<int32_t*>(base + l.begin),        reinterpret_cast<int32_t*>(base + l.count),
          reinterpret_cast<int32_t*>(base + l.pairs),        reinterpret_cast<uint16_t*>(base + l.routed),
          reinterpret_cast<uint16_t*>(base + l.shared)};
}

constexpr int kGroupThreads = 1024;
constexpr int kGroupSegments = kGroupThreads / 32;  // one per warp

// One block of kGroupThreads: a stable counting sort of the T k pairs by expert, in integers only.
// The pairs are cut into kGroupSegments consecutive segments, warp w walking segment w 32 pairs per
// step (the lanes of a step with the same expert meet in __match_any_sync):
//   1. per segment and expert, its pairs' count (the lowest lane of each expert adds the step's);
//   2. thread e: the segments' counts of expert e become each segment's first place within e's list,
//      the block scans give the list's begin and the active slot (experts in ascending id);
//   3. each warp walks its segment again: pair i goes to begin(e) + its segment's first place + the
//      pairs of e before it in the segment.
// Expert e's list holds its pairs in ascending pair index, as the one-thread-per-expert scan this
// replaced gave (that scan read all T k ids once per expert thread). Ids outside [0, E) are never
// listed. Dynamic shared memory: [kGroupSegments][E] int32 (MoeGroupSmem).
__global__ void __launch_bounds__(kGroupThreads) MoeGroupKernel(MoeParams a) {
  DL_TIMELINE_SCOPE(kMoeRouter);
  AllowDependents();
  WaitForPrerequisites();
  const MoeGroupWs g = MoeGroupWorkspace(a);
  extern __shared__ int32_t s_seg[];
  __shared__ int32_t s_begin[kGroupThreads];
  const int E = a.num_experts, n = a.num_tokens * a.top_k;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg_len = (n + kGroupSegments - 1) / kGroupSegments;
  const int seg_lo = min(n, warp * seg_len), seg_hi = min(n, seg_lo + seg_len);
  const unsigned below = (1u << lane) - 1u;
  for (int i = threadIdx.x; i < kGroupSegments * E; i += kGroupThreads) s_seg[i] = 0;
  __syncthreads();
  int32_t* const mine = s_seg + warp * E;
  // Lane's pair of the step at i0: its expert (-1: none) and the step's lanes with the same one.
  auto step = [&](int i0, int* id, unsigned* same) {
    const int i = i0 + lane;
    int e = i < seg_hi ? __ldcg(&a.topk_ids[i]) : -1;
    if (e >= E) e = -1;
    *id = e;
    *same = __match_any_sync(0xffffffffu, e < 0 ? -1 - lane : e);  // no two lanes share a key < 0
  };
  for (int i0 = seg_lo; i0 < seg_hi; i0 += 32) {
    int id;
    unsigned same;
    step(i0, &id, &same);
    if (id >= 0 && (same & below) == 0) mine[id] += __popc(same);
    __syncwarp();
  }
  __syncthreads();
  const int e = threadIdx.x;
  int c = 0;
  if (e < E) {
    for (int w = 0; w < kGroupSegments; ++w) {
      const int v = s_seg[w * E + e];
      s_seg[w * E + e] = c;
      c += v;
    }
  }
  int pairs_total = 0, active_total = 0;
  const int off = BlockExclusiveScan(c, &pairs_total);
  const int slot = BlockExclusiveScan(c > 0 ? 1 : 0, &active_total);
  if (c > 0) {
    g.active[slot] = e;
    g.begin[slot] = off;
    g.count[slot] = c;
  }
  s_begin[e] = off;
  if (threadIdx.x == 0) *g.active_count = active_total;
  __syncthreads();
  for (int i0 = seg_lo; i0 < seg_hi; i0 += 32) {
    int id;
    unsigned same;
    step(i0, &id, &same);
    if (id >= 0) g.pairs[s_begin[id] + mine[id] + __popc(same & below)] = i0 + lane;
    __syncwarp();  // every lane has read mine[id] before the step's count moves it on
    if (id >= 0 && (same & below) == 0) mine[id] += __popc(same);
    __syncwarp();
  }
}
inline size_t MoeGroupSmem(int E) { return static_cast<size_t>(kGroupSegments) * E * sizeof(int32_t); }
// The lists for both grouped paths (the CUDA-core experts and the MMA experts' GEMM).
inline cudaError_t LaunchMoeGroup(const MoeParams& p, cudaStream_t s) {
  return LaunchDependentSmem(MoeGroupKernel, dim3(1), dim3(kGroupThreads), MoeGroupSmem(p.num_experts), s, p);
}

// The (token, slot) pairs of block row y: the shared expert's (every token, slot k) or the listed
// expert's; false when the row is past the list.
struct GroupRows {
  int expert = -1;  // -1: the shared expert
  int begin = 0, count = 0;
};
__device__ __forceinline__ bool GroupRowOf(const MoeParams& a, const MoeGroupWs& g, int y, GroupRows* r) {
  if (y == 0) {
    r->expert = -1, r->begin = 0, r->count = a.num_tokens;
    return true;
  }
  const int slot = y - 1;
  if (slot >= __ldcg(g.active_count)) return false;
  r->expert = __ldcg(&g.active[slot]);
  r->begin = __ldcg(&g.begin[slot]);
  r->count = __ldcg(&g.count[slot]);
  return true;
}
// Pair i of the row: token and slot.
__device__ __forceinline__ void PairOf(const MoeParams& a, const MoeGroupWs& g, const GroupRows& r, int i, int* t,
                                       int* j) {
  if (r.expert < 0) {
    *t = i, *j = a.top_k;
  } else {
    const int p = __ldcg(&g.pairs[r.begin + i]);
    *t = p / a.top_k, *j = p % a.top_k;
  }
}

// Copies the vectors of pairs [i0, i0 + nt) of the block into shared memory (every thread), between
// two barriers. vec(i) is pair i's vector ([n8] 16-byte chunks, written by an earlier kernel: read
// from L2).
template <typename Vec>
__device__ __forceinline__ void StageVectors(uint4* dst, int i0, int nt, int n8, Vec&& vec) {
  __syncthreads();  // the previous tile is consumed
  for (int idx = threadIdx.x; idx < nt * n8; idx += blockDim.x) {
    const int tt = idx / n8, c = idx % n8;
    dst[idx] = __ldcg(vec(i0 + tt) + c);
  }
  __syncthreads();
}

// The block's share of its expert's (token, slot) pairs, staged in shared memory: false when the block
// has none (a row past the list, or a token split past the expert's count).
struct BlockPairs {
  int expert = -1;  // -1: the shared expert
  int n = 0;
  int tok[kGroupSplit];
  int slot[kGroupSplit];
};
__device__ __forceinline__ bool StageBlockPairs(const MoeParams& a, const MoeGroupWs& g, BlockPairs* bp) {
  GroupRows gr;
  const bool any = GroupRowOf(a, g, blockIdx.y, &gr);  // the same answer in every thread
  const int first = blockIdx.z * kGroupSplit;
  if (!any || first >= gr.count) return false;
  const int n = min(kGroupSplit, gr.count - first);
  for (int i = threadIdx.x; i < n; i += blockDim.x) PairOf(a, g, gr, first + i, &bp->tok[i], &bp->slot[i]);
  if (threadIdx.x == 0) bp->expert = gr.expert, bp->n = n;
  __syncthreads();
  return true;
}

// Dynamic shared memory: [tile][d / 8] 16-byte chunks, the x rows of `tile` <= kGuTokens tokens.
__global__ void __launch_bounds__(kMoeWarps * 32) MoeGroupGateUpKernel(MoeParams a, int tile) {
  DL_TIMELINE_SCOPE(kMoeGateUp);
  AllowDependents();
  WaitForPrerequisites();
  const MoeGroupWs g = MoeGroupWorkspace(a);
  __shared__ BlockPairs bp;
  if (!StageBlockPairs(a, g, &bp)) return;
  extern __shared__ uint4 s_vec[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool shared = bp.expert < 0;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int n8 = a.d / 8;
  const bf16* gate = shared ? a.shared_gate_w : a.gate_w[bp.expert];
  const bf16* up = shared ? a.shared_up_w : a.up_w[bp.expert];
  for (int i0 = 0; i0 < bp.n; i0 += tile) {
    const int nt = min(tile, bp.n - i0);
    StageVectors(s_vec, i0, nt, n8, [&](int i) { return reinterpret_cast<const uint4*>(a.x + static_cast<size_t>(bp.tok[i]) * a.d); });
    for (int f = blockIdx.x * kGroupRows + warp; f < min(F, (blockIdx.x + 1) * kGroupRows); f += kMoeWarps) {
      const bf16* rows[2] = {gate + static_cast<size_t>(f) * a.d, up + static_cast<size_t>(f) * a.d};
      float acc[2][kGuTokens];
      SmemLaneDots<2, kGuTokens, kGateUpChunks>(rows, s_vec, nt, n8, lane, acc);
#pragma unroll
      for (int tt = 0; tt < kGuTokens; ++tt) {
        if (tt >= nt) break;
        const float gv = RoundBf16(WarpSum(acc[0][tt]));
        const float uv = RoundBf16(WarpSum(acc[1][tt]));
        if (lane == 0) {
          const float act = RoundBf16(gv / (1.0f + expf(-gv)));
          const MoeWs ws = MoeWorkspace(a, bp.tok[i0 + tt]);
          ws.h[static_cast<size_t>(bp.slot[i0 + tt]) * ws.h_stride + f] = FloatToBf16Bits(act * uv);
        }
      }
    }
  }
}

// Dynamic shared memory: [tile][F / 8] 16-byte chunks, the h vectors of `tile` <= kDownTokens pairs.
__global__ void __launch_bounds__(kMoeWarps * 32, 2) MoeGroupDownKernel(MoeParams a, int tile) {
  DL_TIMELINE_SCOPE(kMoeDown);
  AllowDependents();
  WaitForPrerequisites();
  const MoeGroupWs g = MoeGroupWorkspace(a);
  __shared__ BlockPairs bp;
  if (!StageBlockPairs(a, g, &bp)) return;
  extern __shared__ uint4 s_vec[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool shared = bp.expert < 0;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int n8 = F / 8;
  const bf16* down = shared ? a.shared_down_w : a.down_w[bp.expert];
  for (int i0_pair = 0; i0_pair < bp.n; i0_pair += tile) {
    const int nt = min(tile, bp.n - i0_pair);
    StageVectors(s_vec, i0_pair, nt, n8, [&](int i) {
      const MoeWs ws = MoeWorkspace(a, bp.tok[i]);
      return reinterpret_cast<const uint4*>(ws.h + static_cast<size_t>(bp.slot[i]) * ws.h_stride);
    });
    // kDownRows rows per warp at once (i, i + 8, ...): each row is only F * 2 bytes, so one at a time
    // would leave too few loads in flight.
    const int end = min(a.d, (blockIdx.x + 1) * kGroupRows);
    for (int i0 = blockIdx.x * kGroupRows + warp; i0 < end; i0 += kDownRows * kMoeWarps) {
      const bf16* rows[kDownRows];
#pragma unroll
      for (int r = 0; r < kDownRows; ++r) {
        const int i = i0 + r * kMoeWarps;
        rows[r] = i < end ? down + static_cast<size_t>(i) * F : nullptr;
      }
      float acc[kDownRows][kDownTokens];
      SmemLaneDots<kDownRows, kDownTokens, 2>(rows, s_vec, nt, n8, lane, acc);
#pragma unroll
      for (int r = 0; r < kDownRows; ++r) {
        const int i = i0 + r * kMoeWarps;
#pragma unroll
        for (int tt = 0; tt < kDownTokens; ++tt) {
          if (tt >= nt) break;
          const float o = RoundBf16(WarpSum(acc[r][tt]));
          if (lane == 0 && i < end) {
            const int t = bp.tok[i0_pair + tt], j = bp.slot[i0_pair + tt];
            if (shared) {
              g.shared[static_cast<size_t>(t) * a.d + i] = FloatToBf16Bits(o);
            } else {
              const float w = __ldcg(&MoeWorkspace(a, t).weights[j]);
              g.routed[(static_cast<size_t>(t) * a.top_k + j) * a.d + i] = FloatToBf16Bits(RoundBf16(o * w));
            }
          }
        }
      }
    }
  }
}

// Grid (ceil(d / 256), T).
__global__ void __launch_bounds__(256) MoeCombineKernel(MoeParams a) {
  DL_TIMELINE_SCOPE(kMoeDown);
  const bool late = a.down_release_after_wait;
  AllowDependentsAtStart(late);
  WaitReleasing(late);
  const MoeGroupWs g = MoeGroupWorkspace(a);
  const int t = blockIdx.y, i = blockIdx.x * 256 + threadIdx.x;
  if (i >= a.d) return;
  float routed = 0.0f;
  for (int j = 0; j < a.top_k; ++j) routed += Bf16BitsToFloat(g.routed[(static_cast<size_t>(t) * a.top_k + j) * a.d + i]);
  const float y = RoundBf16(RoundBf16(RoundBf16(routed) * a.alpha) + Bf16BitsToFloat(g.shared[static_cast<size_t>(t) * a.d + i]));
  a.y[static_cast<size_t>(t) * a.d + i] = FloatToBf16Bits(y);
}


// ---- FP8-capable expert kernels (MoeParams::gate_fp8 ... shared_down_fp8). Used when any expert group
// is FP8; the router, the grouping kernel and the combine are the ones above. Each is the BF16 kernel
// above with every weight row described by a MoeWeightRow: BF16 rows run LaneDots' / SmemLaneDots'
// exact code (so a BF16 group keeps its bits), FP8 rows the FP8 rule (kernels/ops.h): 16 codes per
// 16-byte chunk, p = the FMAs of float(code) and x[16c .. 16c + 15] in order from zero, then
// acc = fmaf(p, scale, acc) (Fp8ChunkFma). The batch-1 gate/up is the register kernel's layout (the
// TMA-ring gate/up has no FP8 twin yet).

// The scale maps of the six expert matrices (routed ones without the per-expert scales pointer, which
// comes from MoeParams::*_fp8.scales[expert]).
struct MoeFp8Maps {
  Fp8ScaleMap gate, up, down, shared_gate, shared_up, shared_down;
};
// One weight row of a dot: BF16 (n chunks of 8 elements) or FP8 (scales set: n chunks of 16 codes).
struct MoeWeightRow {
  const uint4* p = nullptr;       // nullptr: skipped
  const float* scales = nullptr;  // FP8: the row's scales (column c >> shift); nullptr: BF16
  int n = 0;                      // 16-byte chunks
  int shift = 0;
};
__device__ __forceinline__ MoeWeightRow Bf16Row(const bf16* base, size_t row, int width) {
  return {reinterpret_cast<const uint4*>(base + row * width), nullptr, width / 8, 0};
}
__device__ __forceinline__ MoeWeightRow Fp8Row(const uint8_t* codes, const float* scales, const Fp8ScaleMap& m,
                                               int row, int width) {
  return {reinterpret_cast<const uint4*>(codes + static_cast<size_t>(row) * width),
          scales + static_cast<size_t>(row / m.block_rows) * m.cols, width / 16, m.shift};
}

// LaneDots over MoeWeightRows: row r with vector xs[r] ([width] BF16); the same load batching and
// before_use contract (the trip count depends on the rows' chunk counts only).
template <int NR, int U, typename BeforeUse>
__device__ __forceinline__ void LaneDotsW(const MoeWeightRow (&rows)[NR], const bf16* const (&xs)[NR], int lane,
                                          float (&acc)[NR], BeforeUse&& before_use) {
  int nmax = 0;
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    acc[r] = 0.0f;
    nmax = max(nmax, rows[r].n);
  }
  bool used = false;
  for (int base = 0; base < nmax; base += 32 * U) {
    const int c0 = base + lane;
    uint4 rv[NR][U];
    float sv[NR][U];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (rows[r].p && c0 + 32 * u < rows[r].n) {
          rv[r][u] = LoadStreaming(rows[r].p + c0 + 32 * u);
          if (rows[r].scales) sv[r][u] = __ldg(rows[r].scales + ((c0 + 32 * u) >> rows[r].shift));
        }
    if (!used) {
      before_use();
      used = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (!rows[r].p || c >= rows[r].n) continue;
        const uint4* x = reinterpret_cast<const uint4*>(xs[r]);
        if (rows[r].scales) {
          float v[16];
          Fp8ChunkValues(rv[r][u], v);
          Fp8ChunkFma(v, sv[r][u], x[2 * c], x[2 * c + 1], acc[r]);
        } else {
          float rf[8], xf[8];
          Bf16x8ToFloat(rv[r][u], rf);
          Bf16x8ToFloat(x[c], xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] = fmaf(rf[e], xf[e], acc[r]);
        }
      }
    }
  }
  if (!used) before_use();
}

// The gate and up rows f of slot j (k = the shared expert) of token t's selection; routed rows need the
// router's output (call after the wait).
__device__ __forceinline__ void GateUpRows(const MoeParams& a, const MoeFp8Maps& m, const MoeWs& ws, int j, int f,
                                           MoeWeightRow (&rows)[2]) {
  if (j == a.top_k) {
    rows[0] = a.shared_gate_fp8.on() ? Fp8Row(a.shared_gate_fp8.codes, a.shared_gate_fp8.scales, m.shared_gate, f, a.d)
                                     : Bf16Row(a.shared_gate_w, f, a.d);
    rows[1] = a.shared_up_fp8.on() ? Fp8Row(a.shared_up_fp8.codes, a.shared_up_fp8.scales, m.shared_up, f, a.d)
                                   : Bf16Row(a.shared_up_w, f, a.d);
    return;
  }
  const bf16* g = LoadPointerFromL2(&ws.rows[j]);
  const bf16* u = LoadPointerFromL2(&ws.rows[a.top_k + j]);
  if (a.gate_fp8.on()) {
    const int e = __ldcg(&ws.ids[j]);
    rows[0] = Fp8Row(reinterpret_cast<const uint8_t*>(g), a.gate_fp8.scales[e], m.gate, f, a.d);
    rows[1] = Fp8Row(reinterpret_cast<const uint8_t*>(u), a.up_fp8.scales[e], m.up, f, a.d);
  } else {
    rows[0] = Bf16Row(g, f, a.d);
    rows[1] = Bf16Row(u, f, a.d);
  }
}

// MoeGateUpKernel with MoeWeightRows: grid (ceil(Fmax / 8), k + 1, T), block row 0 the shared expert.
template <int kMinBlocks, int kU>
__global__ void __launch_bounds__(kMoeWarps * 32, kMinBlocks) MoeGateUpKernelW(MoeParams a, MoeFp8Maps m) {
  DL_TIMELINE_SCOPE(kMoeGateUp);
  const bool shared = blockIdx.y == 0;
  const bool late = !shared;
  AllowDependentsAtStart(late);
  const int t = blockIdx.z;
  const MoeWs ws = MoeWorkspace(a, t);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = shared ? a.top_k : static_cast<int>(blockIdx.y) - 1;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int f = blockIdx.x * kMoeWarps + warp;
  if (f >= F) {
    if (late) WaitReleasing(late);
    return;
  }
  const bf16* x = a.x + static_cast<size_t>(t) * a.d;
  const bf16* xs[2] = {x, x};
  float acc[2];
  MoeWeightRow rows[2];
  if (shared) {
    GateUpRows(a, m, ws, j, f, rows);
    LaneDotsW<2, kU>(rows, xs, lane, acc, WaitForEarlierKernels{});
  } else {
    WaitReleasing(late);
    GateUpRows(a, m, ws, j, f, rows);
    LaneDotsW<2, kU>(rows, xs, lane, acc, NothingToWaitFor{});
  }
  const float g = RoundBf16(WarpSum(acc[0]));
  const float u = RoundBf16(WarpSum(acc[1]));
  if (lane == 0) {
    const float act = RoundBf16(g / (1.0f + expf(-g)));
    ws.h[static_cast<size_t>(j) * ws.h_stride + f] = FloatToBf16Bits(act * u);
  }
}

// MoeDownKernel with MoeWeightRows: grid (ceil(d / rows per block), T).
template <int kMinBlocks, int kU>
__global__ void __launch_bounds__(kMoeWarps * 32, kMinBlocks) MoeDownKernelW(MoeParams a, MoeFp8Maps m) {
  DL_TIMELINE_SCOPE(kMoeDown);
  const bool late = a.down_release_after_wait;
  AllowDependentsAtStart(late);
  const int t = blockIdx.y;
  const MoeWs ws = MoeWorkspace(a, t);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per_row = MoeDownWarpsPerRow(a.top_k);
  const int rows_per_block = kMoeWarps / per_row;
  const int local_row = warp / per_row, group = warp % per_row;
  const int i = blockIdx.x * rows_per_block + local_row;
  const bool live = local_row < rows_per_block && i < a.d;
  if (!live) WaitReleasing(late);
  auto wait_after_loads = [late] { WaitReleasing(late); };
  __shared__ float s_routed[kMoeWarps][kDownGroup];
  __shared__ float s_shared[kMoeWarps];
  const bf16* h = reinterpret_cast<const bf16*>(ws.h);
  if (live) {
    const int j0 = group * kDownGroup;
    MoeWeightRow rows[kDownGroup + 1];
    const bf16* xs[kDownGroup + 1];
#pragma unroll
    for (int r = 0; r < kDownGroup; ++r) {
      const int j = j0 + r;
      xs[r] = h + static_cast<size_t>(j < a.top_k ? j : 0) * ws.h_stride;
      if (j >= a.top_k) continue;
      const bf16* base = LoadPointerFromL2(&ws.rows[2 * a.top_k + j]);
      rows[r] = a.down_fp8.on()
                    ? Fp8Row(reinterpret_cast<const uint8_t*>(base), a.down_fp8.scales[__ldcg(&ws.ids[j])], m.down, i, a.ffn)
                    : Bf16Row(base, i, a.ffn);
    }
    if (group == 0) {
      rows[kDownGroup] = a.shared_down_fp8.on()
                             ? Fp8Row(a.shared_down_fp8.codes, a.shared_down_fp8.scales, m.shared_down, i, a.shared_ffn)
                             : Bf16Row(a.shared_down_w, i, a.shared_ffn);
    }
    xs[kDownGroup] = h + static_cast<size_t>(a.top_k) * ws.h_stride;
    float o[kDownGroup + 1];
    LaneDotsW<kDownGroup + 1, kU>(rows, xs, lane, o, wait_after_loads);
#pragma unroll
    for (int r = 0; r < kDownGroup; ++r) {
      const float v = j0 + r < a.top_k ? RoundBf16(RoundBf16(WarpSum(o[r])) * ws.weights[j0 + r]) : 0.0f;
      if (lane == 0) s_routed[warp][r] = v;
    }
    if (group == 0) {
      const float sh = RoundBf16(WarpSum(o[kDownGroup]));
      if (lane == 0) s_shared[warp] = sh;
    }
  }
  __syncthreads();
  if (live && group == 0 && lane == 0) {
    float routed = 0.0f;
    for (int j = 0; j < a.top_k; ++j) routed += s_routed[warp + j / kDownGroup][j % kDownGroup];
    const float y = RoundBf16(RoundBf16(RoundBf16(routed) * a.alpha) + s_shared[warp]);
    a.y[static_cast<size_t>(t) * a.d + i] = FloatToBf16Bits(y);
  }
}

// SmemLaneDots for NR FP8 rows (nullptr codes: skipped) of n16 chunks each, scale rows s_rows, against
// nt <= TT vectors staged in shared memory (xs: [nt][2 n16] 16-byte BF16 chunks).
template <int NR, int TT, int U>
__device__ __forceinline__ void SmemLaneDotsFp8(const uint4* const (&rows)[NR], const float* const (&s_rows)[NR],
                                                int shift, const uint4* xs, int nt, int n16, int lane,
                                                float (&acc)[NR][TT]) {
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) acc[r][tt] = 0.0f;
  const int n8 = 2 * n16;
  for (int base = 0; base < n16; base += 32 * U) {
    const int c0 = base + lane;
    uint4 rv[NR][U];
    float sv[NR][U];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (rows[r] && c0 + 32 * u < n16) {
          rv[r][u] = LoadStreaming(rows[r] + c0 + 32 * u);
          sv[r][u] = __ldg(s_rows[r] + ((c0 + 32 * u) >> shift));
        }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= n16) break;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (!rows[r]) continue;
        float v[16];
        Fp8ChunkValues(rv[r][u], v);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
          if (tt >= nt) break;
          Fp8ChunkFma(v, sv[r][u], xs[tt * n8 + 2 * c], xs[tt * n8 + 2 * c + 1], acc[r][tt]);
        }
      }
    }
  }
}

// MoeGroupGateUpKernel with FP8 or BF16 rows per block (the block's expert: shared or routed).
// kAllFp8: both groups FP8 (the BF16 branch compiled out: fewer registers).
template <bool kAllFp8>
__global__ void __launch_bounds__(kMoeWarps * 32) MoeGroupGateUpKernelW(MoeParams a, MoeFp8Maps m, int tile) {
  DL_TIMELINE_SCOPE(kMoeGateUp);
  AllowDependents();
  WaitForPrerequisites();
  const MoeGroupWs g = MoeGroupWorkspace(a);
  __shared__ BlockPairs bp;
  if (!StageBlockPairs(a, g, &bp)) return;
  extern __shared__ uint4 s_vec[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool shared = bp.expert < 0;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int n8 = a.d / 8;
  const bool fp8 = kAllFp8 || (shared ? a.shared_gate_fp8.on() : a.gate_fp8.on());
  const bf16* gate = nullptr;
  const bf16* up = nullptr;
  const uint8_t* gate_c = nullptr;
  const uint8_t* up_c = nullptr;
  const float* gate_s = nullptr;
  const float* up_s = nullptr;
  const Fp8ScaleMap& gm = shared ? m.shared_gate : m.gate;
  const Fp8ScaleMap& um = shared ? m.shared_up : m.up;
  if (fp8) {
    gate_c = shared ? a.shared_gate_fp8.codes : a.gate_fp8.codes[bp.expert];
    up_c = shared ? a.shared_up_fp8.codes : a.up_fp8.codes[bp.expert];
    gate_s = shared ? a.shared_gate_fp8.scales : a.gate_fp8.scales[bp.expert];
    up_s = shared ? a.shared_up_fp8.scales : a.up_fp8.scales[bp.expert];
  } else {
    gate = shared ? a.shared_gate_w : a.gate_w[bp.expert];
    up = shared ? a.shared_up_w : a.up_w[bp.expert];
  }
  for (int i0 = 0; i0 < bp.n; i0 += tile) {
    const int nt = min(tile, bp.n - i0);
    StageVectors(s_vec, i0, nt, n8, [&](int i) { return reinterpret_cast<const uint4*>(a.x + static_cast<size_t>(bp.tok[i]) * a.d); });
    for (int f = blockIdx.x * kGroupRows + warp; f < min(F, (blockIdx.x + 1) * kGroupRows); f += kMoeWarps) {
      float acc[2][kGuTokens];
      if (fp8) {
        const uint4* rows[2] = {reinterpret_cast<const uint4*>(gate_c + static_cast<size_t>(f) * a.d),
                                reinterpret_cast<const uint4*>(up_c + static_cast<size_t>(f) * a.d)};
        const float* s_rows[2] = {gate_s + static_cast<size_t>(f / gm.block_rows) * gm.cols,
                                  up_s + static_cast<size_t>(f / um.block_rows) * um.cols};
        // gate and up share a shift only when their block columns agree; the launcher checks that.
        SmemLaneDotsFp8<2, kGuTokens, kGateUpChunks>(rows, s_rows, gm.shift, s_vec, nt, a.d / 16, lane, acc);
      } else {
        const bf16* rows[2] = {gate + static_cast<size_t>(f) * a.d, up + static_cast<size_t>(f) * a.d};
        SmemLaneDots<2, kGuTokens, kGateUpChunks>(rows, s_vec, nt, n8, lane, acc);
      }
#pragma unroll
      for (int tt = 0; tt < kGuTokens; ++tt) {
        if (tt >= nt) break;
        const float gv = RoundBf16(WarpSum(acc[0][tt]));
        const float uv = RoundBf16(WarpSum(acc[1][tt]));
        if (lane == 0) {
          const float act = RoundBf16(gv / (1.0f + expf(-gv)));
          const MoeWs ws = MoeWorkspace(a, bp.tok[i0 + tt]);
          ws.h[static_cast<size_t>(bp.slot[i0 + tt]) * ws.h_stride + f] = FloatToBf16Bits(act * uv);
        }
      }
    }
  }
}

// MoeGroupDownKernel with FP8 or BF16 rows per block (kAllFp8 as above).
template <bool kAllFp8>
__global__ void __launch_bounds__(kMoeWarps * 32, 2) MoeGroupDownKernelW(MoeParams a, MoeFp8Maps m, int tile) {
  DL_TIMELINE_SCOPE(kMoeDown);
  AllowDependents();
  WaitForPrerequisites();
  const MoeGroupWs g = MoeGroupWorkspace(a);
  __shared__ BlockPairs bp;
  if (!StageBlockPairs(a, g, &bp)) return;
  extern __shared__ uint4 s_vec[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool shared = bp.expert < 0;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int n8 = F / 8;
  const bool fp8 = kAllFp8 || (shared ? a.shared_down_fp8.on() : a.down_fp8.on());
  const Fp8ScaleMap& dm = shared ? m.shared_down : m.down;
  const bf16* down = nullptr;
  const uint8_t* down_c = nullptr;
  const float* down_s = nullptr;
  if (fp8) {
    down_c = shared ? a.shared_down_fp8.codes : a.down_fp8.codes[bp.expert];
    down_s = shared ? a.shared_down_fp8.scales : a.down_fp8.scales[bp.expert];
  } else {
    down = shared ? a.shared_down_w : a.down_w[bp.expert];
  }
  for (int i0_pair = 0; i0_pair < bp.n; i0_pair += tile) {
    const int nt = min(tile, bp.n - i0_pair);
    StageVectors(s_vec, i0_pair, nt, n8, [&](int i) {
      const MoeWs ws = MoeWorkspace(a, bp.tok[i]);
      return reinterpret_cast<const uint4*>(ws.h + static_cast<size_t>(bp.slot[i]) * ws.h_stride);
    });
    const int end = min(a.d, (blockIdx.x + 1) * kGroupRows);
    for (int i0 = blockIdx.x * kGroupRows + warp; i0 < end; i0 += kDownRows * kMoeWarps) {
      float acc[kDownRows][kDownTokens];
      if (fp8) {
        const uint4* rows[kDownRows];
        const float* s_rows[kDownRows];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          const int i = i0 + r * kMoeWarps;
          rows[r] = i < end ? reinterpret_cast<const uint4*>(down_c + static_cast<size_t>(i) * F) : nullptr;
          s_rows[r] = down_s + static_cast<size_t>((i < end ? i : 0) / dm.block_rows) * dm.cols;
        }
        SmemLaneDotsFp8<kDownRows, kDownTokens, 2>(rows, s_rows, dm.shift, s_vec, nt, F / 16, lane, acc);
      } else {
        const bf16* rows[kDownRows];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          const int i = i0 + r * kMoeWarps;
          rows[r] = i < end ? down + static_cast<size_t>(i) * F : nullptr;
        }
        SmemLaneDots<kDownRows, kDownTokens, 2>(rows, s_vec, nt, n8, lane, acc);
      }
#pragma unroll
      for (int r = 0; r < kDownRows; ++r) {
        const int i = i0 + r * kMoeWarps;
#pragma unroll
        for (int tt = 0; tt < kDownTokens; ++tt) {
          if (tt >= nt) break;
          const float o = RoundBf16(WarpSum(acc[r][tt]));
          if (lane == 0 && i < end) {
            const int t = bp.tok[i0_pair + tt], j = bp.slot[i0_pair + tt];
            if (shared) {
              g.shared[static_cast<size_t>(t) * a.d + i] = FloatToBf16Bits(o);
            } else {
              const float w = __ldcg(&MoeWorkspace(a, t).weights[j]);
              g.routed[(static_cast<size_t>(t) * a.top_k + j) * a.d + i] = FloatToBf16Bits(RoundBf16(o * w));
            }
          }
        }
      }
    }
  }
}

// Host: the FP8 groups' checks and scale maps (routed: all three matrices FP8 or none; shared likewise).
inline Status MoeFp8Setup(const MoeParams& p, MoeFp8Maps* m) {
  const bool routed = p.gate_fp8.on(), shared = p.shared_gate_fp8.on();
  if (p.up_fp8.on() != routed || p.down_fp8.on() != routed) {
    return InvalidArgument("moe: routed experts' gate, up and down must all be FP8 or all BF16");
  }
  if (p.shared_up_fp8.on() != shared || p.shared_down_fp8.on() != shared) {
    return InvalidArgument("moe: the shared expert's gate, up and down must all be FP8 or all BF16");
  }
  auto table = [&](const MoeParams::Fp8Experts& x, int in, const char* what, Fp8ScaleMap* sm) -> Status {
    if (x.scales == nullptr) return InvalidArgument("moe: FP8 {} experts need their scale pointer array", what);
    if (in % 16 != 0) return InvalidArgument("moe: FP8 {} rows of width {} (must be a multiple of 16)", what, in);
    Fp8Weight w{nullptr, reinterpret_cast<const float*>(x.scales), x.block_rows, x.block_cols};
    if (!MakeFp8ScaleMap(w, in, sm)) {
      return InvalidArgument("moe: FP8 {} block shape {} x {} unsupported (block_cols a power of two multiple of 16 "
                             "or >= {})", what, x.block_rows, x.block_cols, in);
    }
    return Status::Ok();
  };
  if (routed) {
    if (p.gate_w || p.up_w || p.down_w) return InvalidArgument("moe: set the routed experts' BF16 or FP8 arrays, not both");
    DL_RETURN_IF_ERROR(table(p.gate_fp8, p.d, "gate", &m->gate));
    DL_RETURN_IF_ERROR(table(p.up_fp8, p.d, "up", &m->up));
    DL_RETURN_IF_ERROR(table(p.down_fp8, p.ffn, "down", &m->down));
    if (m->gate.shift != m->up.shift) return InvalidArgument("moe: FP8 gate and up need the same block_cols");
  } else if (!p.gate_w || !p.up_w || !p.down_w) {
    return InvalidArgument("moe: the routed experts' weight arrays must be set");
  }
  if (shared) {
    if (p.shared_gate_w || p.shared_up_w || p.shared_down_w) {
      return InvalidArgument("moe: set the shared expert's BF16 or FP8 weights, not both");
    }
    DL_RETURN_IF_ERROR(CheckFp8Weight(p.shared_gate_fp8, p.d, "moe shared gate", &m->shared_gate));
    DL_RETURN_IF_ERROR(CheckFp8Weight(p.shared_up_fp8, p.d, "moe shared up", &m->shared_up));
    DL_RETURN_IF_ERROR(CheckFp8Weight(p.shared_down_fp8, p.shared_ffn, "moe shared down", &m->shared_down));
    if (m->shared_gate.shift != m->shared_up.shift) {
      return InvalidArgument("moe: FP8 shared gate and up need the same block_cols");
    }
  } else if (!p.shared_gate_w || !p.shared_up_w || !p.shared_down_w) {
    return InvalidArgument("moe: the shared expert's weights must be set");
  }
  return Status::Ok();
}

// ---- The MMA experts (MoeParams::mma): the grouped path above (router, lists, combine) with each
// expert product on the tensor-core product's arithmetic (ops.h 5b, mma_product.cuh). T > 1 (and
// mma_batch1_lists) run the expert products as a grouped GEMM over the lists (MoeMmaGemmBody below);
// batch 1 runs the same products over the router's selection without the lists
// (MoeMmaDirectGateUpKernel, MoeMmaDownCombineKernel), so a token's bits do not depend on which tokens
// share its experts. Splits: gate and up use MmaKSplitFor(ffn, d) for the routed and the shared
// expert alike; down uses MmaKSplitFor(d, ffn), halved until it divides the shared expert's chunks
// too: functions of the shapes only. The h, routed and shared buffers and every rounding are the
// CUDA-core grouped path's.
constexpr int kMoeMmaWarps = 8;

inline int MoeMmaGateUpSplit(int d, int ffn) { return MmaKSplitFor(ffn, d); }
inline int MoeMmaDownSplit(int d, int ffn, int shared_ffn) {
  int ks = MmaKSplitFor(d, ffn);
  while (ks > 1 && ((shared_ffn + kMmaChunk - 1) / kMmaChunk) % ks != 0) ks /= 2;
  return ks;
}

// Adds the ks slices' partial sums (warp w's in registers) in ascending order into the slice-0 warp's
// registers; false for the other warps. Every warp of the block calls it (a barrier).
template <int NM, int NT>
__device__ __forceinline__ bool MoeMmaAddSlices(float (&acc)[NM][NT][4], float (*s_part)[NM * NT * 4][32], int ks,
                                                int warp, int lane) {
  if (ks == 1) return true;
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_part[warp][(m * NT + j) * 4 + e][lane] = acc[m][j][e];
  __syncthreads();
  if (warp % ks != 0) return false;
  for (int k = 1; k < ks; ++k)
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][j][e] += s_part[warp + k][(m * NT + j) * 4 + e][lane];
  return true;
}

// The lists' grid: blockIdx.z < shared_segments is the shared expert over tokens [z L, z L + L), the
// others listed expert z - shared_segments (GroupRowOf row 1 + that); blockIdx.x = p takes the passes
// p, p + P, ... (cols pairs each) of its list, P = gridDim.x. P and L come from 1.5 times the
// expected pairs per routed expert (T k / E): under random routing about half the lists are longer
// than the mean, and a list one pass past P costs its block a second pass in series (the kernel's
// tail) where another block could take it; blocks past their list's end return at once. A grid sized
// for the longest possible list, T passes per expert, was mostly empty blocks. The grid never
// changes a product's bits (each pair's column runs the same chain in any block).
struct MoeMmaLists {
  int shared_segments = 1, segment_tokens = 1;
};
inline MoeMmaLists MoeMmaListsFor(const MoeParams& p, int cols, int* passes) {
  const int64_t pairs = static_cast<int64_t>(p.num_tokens) * p.top_k;
  const int expected = static_cast<int>((3 * pairs + 2 * p.num_experts - 1) / (2 * p.num_experts));
  *passes = std::max(1, (expected + cols - 1) / cols);
  MoeMmaLists l;
  l.segment_tokens = *passes * cols;
  l.shared_segments = (p.num_tokens + l.segment_tokens - 1) / l.segment_tokens;
  return l;
}
// Block row z's list (false past the listed experts) and, for a shared segment, its first token.
__device__ __forceinline__ bool MoeMmaListOf(const MoeParams& a, const MoeGroupWs& g, const MoeMmaLists& l, int z,
                                             GroupRows* gr, int* token0) {
  *token0 = 0;
  if (z < l.shared_segments) {
    gr->expert = -1;
    *token0 = z * l.segment_tokens;
    gr->begin = 0;
    gr->count = min(l.segment_tokens, a.num_tokens - *token0);
    return true;
  }
  return GroupRowOf(a, g, 1 + z - l.shared_segments, gr);
}

// Batch 1 (T = 1), no lists. Grid (1, ceil(ceil(Fmax / 16) / (8 / ks)), k + 1): block row z is slot
// z - 1 of the router's selection (its expert pointers from the router's workspace) or the shared
// expert (z = 0), whose weights are loaded before the wait. Warp w: the 16-row tile
// blockIdx.y * (8 / ks) + w / ks of both gate and up (the two products of a row land in the same
// lane, so SiLU * up needs no exchange), slice w % ks; the token is column 0 of the B tile.
// h(slot)[f] = bf16(bf16(silu(bf16(g))) * bf16(u)), into token 0's workspace: per element the grouped
// GEMM's chunks, slices and roundings, so its bits.
__global__ void __launch_bounds__(kMoeMmaWarps * 32) MoeMmaDirectGateUpKernel(MoeParams a, int ks) {
  DL_TIMELINE_SCOPE(kMoeGateUp);
  AllowDependents();
  const MoeWs ws = MoeWorkspace(a, 0);
  __shared__ float s_part[kMoeMmaWarps][2 * 4][32];
  const bool shared = blockIdx.z == 0;
  const int slot = shared ? a.top_k : static_cast<int>(blockIdx.z) - 1;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int tiles_per_block = kMoeMmaWarps / ks;
  if (static_cast<int>(blockIdx.y) * tiles_per_block * 16 >= F) {  // block-uniform
    WaitForPrerequisites();
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, c = lane & 3;
  const int slice = warp % ks;
  const int r0 = (blockIdx.y * tiles_per_block + warp / ks) * 16;
  const int n8 = a.d / 8, per = (a.d + kMmaChunk - 1) / kMmaChunk / ks;
  const bf16 *gate_w, *up_w;
  if (shared) {
    gate_w = a.shared_gate_w, up_w = a.shared_up_w;
  } else {
    WaitForPrerequisites();  // the router's selection
    gate_w = LoadPointerFromL2(&ws.rows[slot]), up_w = LoadPointerFromL2(&ws.rows[a.top_k + slot]);
  }
  const uint4* gate = reinterpret_cast<const uint4*>(gate_w);
  const uint4* up = reinterpret_cast<const uint4*>(up_w);
  const bool la = r0 + gq < F, lb = r0 + gq + 8 < F;
  const size_t ra = static_cast<size_t>(la ? r0 + gq : 0) * n8 + c, rb = static_cast<size_t>(lb ? r0 + gq + 8 : 0) * n8 + c;
  const uint4* wa[2] = {gate + ra, up + ra};
  const uint4* wb[2] = {gate + rb, up + rb};
  const bool live_a[2] = {la, la}, live_b[2] = {lb, lb};
  const uint4* xr[1] = {reinterpret_cast<const uint4*>(a.x) + c};
  const bool tok_live[1] = {gq == 0};  // column 0: the token; the other columns are zeros
  float acc[2][1][4] = {{{0.0f, 0.0f, 0.0f, 0.0f}}, {{0.0f, 0.0f, 0.0f, 0.0f}}};
  // The shared expert's first weights go out before the wait (they need no router).
  MmaSliceDots<2, 1, 8>(wa, wb, live_a, live_b, xr, tok_live, n8, slice * per, (slice + 1) * per, c, acc, [&] {
    if (shared) WaitForPrerequisites();
  });
  if (MoeMmaAddSlices<2, 1>(acc, s_part, ks, warp, lane) && c == 0) {  // column 0: elements 0 and 2 of lane (gq, 0)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int f = r0 + gq + (e >= 2 ? 8 : 0);
      if (f >= F) continue;
      const float gv = RoundBf16(acc[0][0][e]), uv = RoundBf16(acc[1][0][e]);
      const float act = RoundBf16(gv / (1.0f + expf(-gv)));
      ws.h[static_cast<size_t>(slot) * ws.h_stride + f] = FloatToBf16Bits(act * uv);
    }
  }
}

// Batch 1 (T = 1): down and the combine in one kernel, no lists. Grid ceil(d / 16): block b owns
// output rows 16b .. 16b + 15; its 8 warps take the (k + 1) ks tasks (product, slice; product 0 the
// shared expert, whose weights need no router and go out before the wait, product p > 0 slot p - 1)
// in turn, w, w + 8, ...; each task's 16 sums go to shared memory, then thread r adds
// row r's slices in order (MoeMmaAddSlices' order: the grouped GEMM's o, bit for bit) and
// combines the slots in order with MoeCombineKernel's roundings.
constexpr int kMoeMmaMaxTasks = (kMoeMaxTopK + 1) * 8;
__global__ void __launch_bounds__(kMoeMmaWarps * 32) MoeMmaDownCombineKernel(MoeParams a, int ks) {
  DL_TIMELINE_SCOPE(kMoeDown);
  const bool late = a.down_release_after_wait;
  AllowDependentsAtStart(late);
  __shared__ float s_sum[kMoeMmaMaxTasks][16];
  const MoeWs ws = MoeWorkspace(a, 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, c = lane & 3;
  const int r0 = blockIdx.x * 16;
  const int tasks = (a.top_k + 1) * ks;
  const bool live_a[1] = {r0 + gq < a.d}, live_b[1] = {r0 + gq + 8 < a.d};
  bool waited = false;
  for (int task = warp; task < tasks; task += kMoeMmaWarps) {
    const int product = task / ks, slice = task % ks;
    const bool shared = product == 0;
    const int p = shared ? a.top_k : product - 1;  // the slot of h
    const int F = shared ? a.shared_ffn : a.ffn;
    const int n8 = F / 8, per = (F + kMmaChunk - 1) / kMmaChunk / ks;
    if (!shared && !waited) {  // the expert pointers come from the router, h from gate/up
      WaitReleasing(late);
      waited = true;
    }
    const bf16* down_w = shared ? a.shared_down_w : LoadPointerFromL2(&ws.rows[2 * a.top_k + p]);
    const uint4* down = reinterpret_cast<const uint4*>(down_w);
    const uint4* wa[1] = {down + static_cast<size_t>(live_a[0] ? r0 + gq : 0) * n8 + c};
    const uint4* wb[1] = {down + static_cast<size_t>(live_b[0] ? r0 + gq + 8 : 0) * n8 + c};
    const uint4* xr[1] = {reinterpret_cast<const uint4*>(ws.h + static_cast<size_t>(p) * ws.h_stride) + c};
    const bool tok_live[1] = {gq == 0};
    float acc[1][1][4] = {{{0.0f, 0.0f, 0.0f, 0.0f}}};
    MmaSliceDots<1, 1, 8>(wa, wb, live_a, live_b, xr, tok_live, n8, slice * per, (slice + 1) * per, c, acc, [&] {
      if (!waited) {  // the shared expert's first weights are in flight; h is gate/up's
        WaitReleasing(late);
        waited = true;
      }
    });
    if (c == 0) {  // column 0 (the token): rows gq and gq + 8
      s_sum[task][gq] = acc[0][0][0];
      s_sum[task][gq + 8] = acc[0][0][2];
    }
  }
  if (!waited) WaitReleasing(late);
  __syncthreads();
  const int row = r0 + static_cast<int>(threadIdx.x);
  if (threadIdx.x >= 16 || row >= a.d) return;
  auto o_of = [&](int slot) {  // slices in ascending order, then the rounding
    const int product = slot == a.top_k ? 0 : slot + 1;
    float v = s_sum[product * ks][threadIdx.x];
    for (int k = 1; k < ks; ++k) v += s_sum[product * ks + k][threadIdx.x];
    return RoundBf16(v);
  };
  float routed = 0.0f;
  for (int j = 0; j < a.top_k; ++j) routed += RoundBf16(o_of(j) * __ldcg(&ws.weights[j]));
  const float y = RoundBf16(RoundBf16(RoundBf16(routed) * a.alpha) + o_of(a.top_k));
  a.y[row] = FloatToBf16Bits(y);
}

// Batch 1: router (already launched), direct gate/up, down + combine: three launches, as the
// CUDA-core batch-1 path.
inline void LaunchMoeMmaDirect(const MoeParams& p, cudaStream_t s) {
  const int gu_ks = MoeMmaGateUpSplit(p.d, p.ffn), dn_ks = MoeMmaDownSplit(p.d, p.ffn, p.shared_ffn);
  const int fmax = std::max(p.ffn, p.shared_ffn);
  const int tiles_per_block = kMoeMmaWarps / gu_ks;
  const dim3 block(kMoeMmaWarps * 32);
  LaunchDependent(MoeMmaDirectGateUpKernel, dim3(1, ((fmax + 15) / 16 + tiles_per_block - 1) / tiles_per_block, p.top_k + 1),
                  block, s, p, gu_ks);
  LaunchDependent(MoeMmaDownCombineKernel, dim3((p.d + 15) / 16), block, s, p, dn_ks);
}

// ---- The MMA experts as a grouped GEMM (T > 1, or mma_batch1_lists): the lists of the grouped
// path, and per block one expert (or a shared-expert segment, MoeMmaLists), a tile of its output
// rows and kGemmTokens of its (token, slot) pairs per pass. Both the weight tile and the pairs' vectors go
// through a ring of kGemmStages shared-memory stages (cp.async, kGemmStageChunks chunks of 32 per
// stage): every weight row is read once per pass of kGemmTokens pairs and every x row (h vector) once
// per block. Warp (wm, wn) of the 4 x 2 warps: two A tiles of 16 rows (gate and up rows 16 wm .. + 16
// of the block's 64 F rows, or down rows 32 wm .. + 32 of its 128 d rows) x kGemmTokens / 2 pair
// columns. The arithmetic per output element is MmaSliceDots' exactly (ops.h 5b): lane (g, c) takes
// the same 16-byte pieces (chunk q: piece 4q + c of rows g and g + 8 and of column g) into MmaChunk,
// chunks in ascending order from a zero accumulator per slice of chunks / ks, the slices' sums added
// in ascending order (as MoeMmaAddSlices), the same roundings: the batch-1 kernels' bits, so a token
// alone equals the token in any batch (the tests check it). The K loop is the shape's (chunks, ks),
// never the pair count's; row f sits at f % 16 of its A tile and pair i at column i % 8 of its B tile.
constexpr int kGemmThreads = 256;
constexpr int kGemmTokens = 64;      // (token, slot) pairs per block pass
constexpr int kGemmRows = 128;       // A rows per block: 64 gate + 64 up rows (gate/up), 128 down rows
constexpr int kGemmStageChunks = 2;  // 128 bytes of each row per stage
constexpr int kGemmStages = 4;
constexpr int kGemmPieces = kGemmStageChunks * 4;  // 16-byte pieces of a row per stage
constexpr size_t kGemmSmem = static_cast<size_t>(kGemmStages) * kGemmStageChunks * (kGemmRows + kGemmTokens) * 64;

// Shared memory: kGemmStages stages of [kGemmStageChunks][kGemmRows][4] A pieces then
// [kGemmStageChunks][kTok][4] B pieces (a warp's fragment load, 8 rows x 64 bytes, is 512 contiguous
// bytes: no bank conflicts); after the K loop the ring holds the pass's BF16 outputs, which leave as
// 16-byte stores. Grid (P, ceil(Fmax / 64) or ceil(d / 128), shared_segments + min(E, T k)).
// Gate/up: h(t, slot)[f] = bf16(bf16(silu(bf16(g))) * bf16(u)); down: bf16(bf16(o) * w(t, slot)) into
// routed, the shared expert's bf16(o) into shared.
// kFp8 (ops.h 5d, prompt rows): an FP8 group's blocks stage their codes in the upper half of the
// stage's A area (cp.async), the block converts them to BF16 in place (exact) once the stage has
// landed, and the MMAs run as for BF16; each block column's sum folds into the total with its row's
// scale (the block columns are the slices). A BF16 group's blocks in the same launch run the BF16
// arithmetic (their slices folded the same way: the same bits as kFp8 off).
template <bool kGateUp, bool kSplit, bool kFp8>
__device__ __forceinline__ void MoeMmaGemmBody(const MoeParams& a, int ks, const MoeMmaLists& lists,
                                               const MoeFp8Maps& maps) {
  constexpr int kTok = kGemmTokens;
  constexpr int NT = kTok / 16;           // 8-column B tiles per warp
  constexpr int kBCopies = kTok / 32;     // B rows a thread copies per stage
  constexpr int kACopies = kGemmRows / 32;
  constexpr int kStageA = kGemmStageChunks * kGemmRows * 4, kStageB = kGemmStageChunks * kTok * 4;  // uint4s
  extern __shared__ __align__(128) uint4 s_ring[];
  __shared__ const uint4* s_src[kTok];  // pair column's vector (x row or h vector), nullptr past the count
  __shared__ uint16_t* s_dst[kTok];     // its output row (h vector, routed or shared row)
  __shared__ float s_w[kTok];           // down, routed: the slot's weight
  AllowDependents();
  WaitForPrerequisites();
  GroupRows gr;
  int token0 = 0;
  const int first0 = blockIdx.x * kTok, step = gridDim.x * kTok;
  if (!MoeMmaListOf(a, MoeGroupWorkspace(a), lists, blockIdx.z, &gr, &token0) || first0 >= gr.count) return;  // block-uniform
  const bool shared = gr.expert < 0;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int out = kGateUp ? F : a.d, in = kGateUp ? a.d : F;
  const int m0 = blockIdx.y * (kGateUp ? kGemmRows / 2 : kGemmRows);  // first output row
  if (m0 >= out) return;
  // FP8 (block-uniform): this group's maps; a block column spans 2^(shift - 1) chunks of 32 (shift
  // counts 16-code chunks; 30: one block column).
  const bool fp8 = kFp8 && (shared ? a.shared_gate_fp8.on() : a.gate_fp8.on());
  const Fp8ScaleMap& map0 = kGateUp ? (shared ? maps.shared_gate : maps.gate) : (shared ? maps.shared_down : maps.down);
  const Fp8ScaleMap& map1 = kGateUp ? (shared ? maps.shared_up : maps.up) : map0;
  const int n8 = in / 8, n16 = in / 16, chunks = (in + kMmaChunk - 1) / kMmaChunk;
  const int per = fp8 ? (map0.shift >= 30 ? chunks : 1 << (map0.shift - 1)) : chunks / ks;
  const int steps = (chunks + kGemmStageChunks - 1) / kGemmStageChunks;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, c = lane & 3;
  const int wm = warp & 3, wn = warp >> 2;
  // The copies of a stage: piece idx = tid + 256 i of [kGemmStageChunks][rows][4] (chunk, row, piece:
  // a quarter-warp writes 128 contiguous bytes of shared memory). A: thread tid takes piece tid % 4 of
  // row tid / 4 and of row tid / 4 + 64 (i odd) in both chunks (i / 2): gate/up's gate and up rows
  // m0 + tid / 4, down's rows m0 + tid / 4 and + 64. Offsets in 16-byte pieces from the matrix base.
  static_assert(kACopies == 4 && kGemmStageChunks == 2, "the A copy map below");
  const int cp_piece = tid & 3, cp_row = tid >> 2;
  const uint4* a_base[2];
  const float* a_scales[2] = {nullptr, nullptr};  // FP8: the matrices' scales
  if (fp8) {
    if constexpr (kGateUp) {
      a_base[0] = reinterpret_cast<const uint4*>(shared ? a.shared_gate_fp8.codes : a.gate_fp8.codes[gr.expert]);
      a_base[1] = reinterpret_cast<const uint4*>(shared ? a.shared_up_fp8.codes : a.up_fp8.codes[gr.expert]);
      a_scales[0] = shared ? a.shared_gate_fp8.scales : a.gate_fp8.scales[gr.expert];
      a_scales[1] = shared ? a.shared_up_fp8.scales : a.up_fp8.scales[gr.expert];
    } else {
      a_base[0] = a_base[1] = reinterpret_cast<const uint4*>(shared ? a.shared_down_fp8.codes : a.down_fp8.codes[gr.expert]);
      a_scales[0] = a_scales[1] = shared ? a.shared_down_fp8.scales : a.down_fp8.scales[gr.expert];
    }
  } else if constexpr (kGateUp) {
    a_base[0] = reinterpret_cast<const uint4*>(shared ? a.shared_gate_w : a.gate_w[gr.expert]);
    a_base[1] = reinterpret_cast<const uint4*>(shared ? a.shared_up_w : a.up_w[gr.expert]);
  } else {
    a_base[0] = a_base[1] = reinterpret_cast<const uint4*>(shared ? a.shared_down_w : a.down_w[gr.expert]);
  }
  // This thread's A sources (dead rows: the matrix base, never read: their copies fill zeros). FP8:
  // piece cp_piece of the stage's 4 pieces of 16 codes of the same rows.
  bool a_alive[2];
  const uint4* a_src[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + cp_row + (kGateUp ? 0 : 64 * h);
    a_alive[h] = row < out;
    a_src[h] = a_base[kGateUp ? h : 0] + (a_alive[h] ? row * (fp8 ? n16 : n8) + cp_piece : 0);
  }
  // Warp (wm, wn)'s A tiles (first rows in the stage) and B columns.
  const int a_tile0 = kGateUp ? 16 * wm : 32 * wm, a_tile1 = kGateUp ? kGemmRows / 2 + 16 * wm : 32 * wm + 16;
  const int col0 = wn * (kTok / 2);
  for (int first = first0; first < gr.count; first += step) {  // block-uniform trip count
    __syncthreads();  // the previous pass is done with the tables and the ring
    const MoeGroupWs gp = MoeGroupWorkspace(a);  // recomputed per pass: fewer registers live across the K loop
    for (int col = tid; col < kTok; col += kGemmThreads) {
      const int i = first + col;
      const uint4* src = nullptr;
      uint16_t* dst = nullptr;
      float w = 0.0f;
      if (i < gr.count) {
        int t, slot;
        if (shared) {
          t = token0 + i, slot = a.top_k;
        } else {
          PairOf(a, gp, gr, i, &t, &slot);
        }
        const MoeWs ws = MoeWorkspace(a, t);
        uint16_t* h = ws.h + static_cast<size_t>(slot) * ws.h_stride;
        if constexpr (kGateUp) {
          src = reinterpret_cast<const uint4*>(a.x + static_cast<size_t>(t) * a.d);
          dst = h;
        } else {
          src = reinterpret_cast<const uint4*>(h);
          if (shared) {
            dst = gp.shared + static_cast<size_t>(t) * a.d;
          } else {
            dst = gp.routed + (static_cast<size_t>(t) * a.top_k + slot) * a.d;
            w = __ldcg(&ws.weights[slot]);
          }
        }
      }
      s_src[col] = src, s_dst[col] = dst, s_w[col] = w;
    }
    __syncthreads();
    // Stage s <- chunks [2 st, 2 st + 2) of the A rows and the B columns (zeros past `in` and for
    // dead rows and columns). B: thread tid copies piece tid % 4 of pair column tid / 4 in both chunks
    // (idx = tid + 256 i: chunk i, column tid / 4), from a pointer taken once per pass.
    static_assert(kTok * 4 == kGemmThreads && kBCopies == kGemmStageChunks, "the B copy map below");
    const uint4* const b_src = s_src[cp_row] ? s_src[cp_row] + cp_piece : nullptr;
    auto load = [&](int s, int st) {
      uint4* sa = s_ring + s * (kStageA + kStageB);
      uint4* sb = sa + kStageA;
      const int lim = n8 - kGemmPieces * st - cp_piece;  // chunk c of the stage has this piece iff 4 c < lim
      if (fp8) {  // [128 stage rows][4 pieces of 16 codes] in the upper half of the A area
        const bool in16 = 4 * st + cp_piece < n16;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool v = a_alive[h] && in16;
          CpAsync16(sa + kStageA / 2 + (cp_row + 64 * h) * 4 + cp_piece, v ? a_src[h] + 4 * st : a_base[0], v);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kACopies; ++i) {
          const int h = i & 1, chunk = i >> 1;
          const bool v = a_alive[h] && 4 * chunk < lim;
          CpAsync16(sa + tid + kGemmThreads * i, v ? a_src[h] + kGemmPieces * st + 4 * chunk : a_base[0], v);
        }
      }
#pragma unroll
      for (int i = 0; i < kBCopies; ++i) {
        const bool v = b_src != nullptr && 4 * i < lim;
        CpAsync16(sb + tid + kGemmThreads * i, v ? b_src + kGemmPieces * st + 4 * i : a_base[0], v);  // dead: zeros
      }
    };
#pragma unroll
    for (int s = 0; s < kGemmStages - 1; ++s) {
      if (s < steps) load(s, s);
      CpAsyncCommit();
    }
    // Columns of this warp with a pair; a warp with none skips the products (warp-uniform). A live
    // warp multiplies all its NT column tiles: a dead column's B rows are zeros and its sums are
    // never stored, and an MMA's column does not depend on the others (no branch per tile).
    const int live_cols = min(kTok / 2, gr.count - first - col0);
    constexpr bool kTotal = kSplit || kFp8;
    float acc[2][NT][4];
    float total[kTotal ? 2 : 1][kTotal ? NT : 1][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.0f;
    int slice_end = per, slice = 0;
    for (int st = 0; st < steps; ++st) {
      CpAsyncWait<kGemmStages - 2>();  // stage st has landed (this thread's copies)
      __syncthreads();                 // everyone's, and everyone is done with stage st - 1
      {
        const int next = st + kGemmStages - 1;
        if (next < steps) load(next % kGemmStages, next);
        CpAsyncCommit();
      }
      if (fp8) {  // the stage's codes -> BF16 over its A area: piece j of a row is chunk j / 2, half j % 2
        uint4* sa = s_ring + (st % kGemmStages) * (kStageA + kStageB);
        const uint4 c0 = sa[kStageA / 2 + cp_row * 4 + cp_piece], c1 = sa[kStageA / 2 + (cp_row + 64) * 4 + cp_piece];
        __syncthreads();  // every code read before any BF16 lands over them
        const int at = (cp_piece >> 1) * kGemmRows * 4 + 2 * (cp_piece & 1);
        Fp8x16ToBf16(c0, sa[at + cp_row * 4], sa[at + cp_row * 4 + 1]);
        Fp8x16ToBf16(c1, sa[at + (cp_row + 64) * 4], sa[at + (cp_row + 64) * 4 + 1]);
        __syncthreads();
      }
      if (live_cols <= 0) continue;
      const uint4* sa = s_ring + (st % kGemmStages) * (kStageA + kStageB);
      const uint4* sb = sa + kStageA;
#pragma unroll
      for (int cc = 0; cc < kGemmStageChunks; ++cc) {
        const int q = st * kGemmStageChunks + cc;
        if (q >= chunks) break;
        const uint4* ca = sa + cc * kGemmRows * 4;
        const uint4* cb = sb + cc * kTok * 4;
        // The chunk's fragments first (A rows g, g + 8 of both tiles, B column g of each tile), then
        // MmaChunk's two MMAs per (tile, column tile): the first halves of every pair, then the second
        // halves, so each accumulator still sees MMA 0 then MMA 1 of chunk q (ops.h 5b).
        const uint4 a00 = ca[(a_tile0 + gq) * 4 + c], a01 = ca[(a_tile0 + gq + 8) * 4 + c];
        const uint4 a10 = ca[(a_tile1 + gq) * 4 + c], a11 = ca[(a_tile1 + gq + 8) * 4 + c];
        uint4 b[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) b[j] = cb[(col0 + 8 * j + gq) * 4 + c];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          MmaChunkHalf<0>(acc[0][j], a00, a01, b[j]);
          MmaChunkHalf<0>(acc[1][j], a10, a11, b[j]);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          MmaChunkHalf<1>(acc[0][j], a00, a01, b[j]);
          MmaChunkHalf<1>(acc[1][j], a10, a11, b[j]);
        }
        if constexpr (kTotal) {
          // The slice's sum joins the total: p0, then + p1, + p2, ... (BF16); FP8: block column b's
          // sum times its row's scale, total = p0 s0, then fmaf(p_b, s_b, total) (ops.h 5d).
          if (q + 1 == slice_end || q + 1 == chunks) {
            float sv[2][2] = {{1.0f, 1.0f}, {1.0f, 1.0f}};
            if (fp8) {
#pragma unroll
              for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  const int row = min(m0 + (kGateUp ? 16 * wm : 32 * wm + 16 * m) + gq + 8 * h, out - 1);
                  const Fp8ScaleMap& mp = m == 0 ? map0 : map1;
                  sv[m][h] = __ldg(a_scales[m] + static_cast<size_t>(row / mp.block_rows) * mp.cols + slice);
                }
            }
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
              for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  const float p = acc[m][j][e], sc = sv[m][e >> 1];
                  total[m][j][e] = fp8 ? (slice == 0 ? p * sc : fmaf(p, sc, total[m][j][e]))
                                       : (slice == 0 ? p : total[m][j][e] + p);
                  acc[m][j][e] = 0.0f;
                }
            slice_end += per;
            ++slice;
          }
        }
      }
    }
    CpAsyncWait<0>();
    __syncthreads();  // every warp is done with the ring: it holds the output tile now
    // The outputs go through shared memory, [kTok][kOutRows + 8] BF16 (the pad puts a warp's four
    // column pairs on different banks), and leave as 16-byte stores along each pair's output row.
    constexpr int kOutRows = kGateUp ? kGemmRows / 2 : kGemmRows, kOutStride = kOutRows + 8;
    static_assert(static_cast<size_t>(kTok) * kOutStride * 2 <= kGemmSmem, "output tile fits the ring");
    uint16_t* s_out = reinterpret_cast<uint16_t*>(s_ring);
    auto sum = [&](int m, int j, int e) {
      if constexpr (kTotal) {
        return total[m][j][e];
      } else {
        return acc[m][j][e];
      }
    };
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (8 * j >= live_cols) break;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = col0 + 8 * j + 2 * c + (e & 1), r = gq + (e >= 2 ? 8 : 0);
        if constexpr (kGateUp) {
          const float gv = RoundBf16(sum(0, j, e)), uv = RoundBf16(sum(1, j, e));
          const float act = RoundBf16(gv / (1.0f + expf(-gv)));
          s_out[col * kOutStride + 16 * wm + r] = FloatToBf16Bits(act * uv);
        } else {
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            const float o = RoundBf16(sum(m, j, e));
            s_out[col * kOutStride + 32 * wm + 16 * m + r] =
                shared ? FloatToBf16Bits(o) : FloatToBf16Bits(RoundBf16(o * s_w[col]));
          }
        }
      }
    }
    __syncthreads();
    // Rows past `out` and columns past the count are not stored (out % 8 == 0: a piece is all in or out).
    constexpr int kOutPieces = kOutRows / 8;
    for (int idx = tid; idx < kTok * kOutPieces; idx += kGemmThreads) {
      const int col = idx / kOutPieces, piece = idx % kOutPieces, row = m0 + 8 * piece;
      if (first + col >= gr.count || row >= out) continue;
      *reinterpret_cast<uint4*>(s_dst[col] + row) = *reinterpret_cast<const uint4*>(s_out + col * kOutStride + 8 * piece);
    }
  }
}

template <bool kSplit, bool kFp8>
__global__ void __launch_bounds__(kGemmThreads, 2) MoeMmaGemmGateUpKernel(MoeParams a, int ks, MoeMmaLists lists,
                                                                         MoeFp8Maps maps) {
  DL_TIMELINE_SCOPE(kMoeGateUp);
  MoeMmaGemmBody<true, kSplit, kFp8>(a, ks, lists, maps);
}
template <bool kSplit, bool kFp8>
__global__ void __launch_bounds__(kGemmThreads, 2) MoeMmaGemmDownKernel(MoeParams a, int ks, MoeMmaLists lists,
                                                                       MoeFp8Maps maps) {
  DL_TIMELINE_SCOPE(kMoeDown);
  MoeMmaGemmBody<false, kSplit, kFp8>(a, ks, lists, maps);
}

// Gate/up then down of the grouped GEMM (the lists already launched), kGemmTokens pairs per block pass.
// fp8: some expert group is FP8 (maps: the groups' scale maps; ops.h 5d).
inline Status LaunchMoeMmaGemm(const MoeParams& p, bool fp8, const MoeFp8Maps& maps, cudaStream_t s) {
  const int gu_ks = MoeMmaGateUpSplit(p.d, p.ffn), dn_ks = MoeMmaDownSplit(p.d, p.ffn, p.shared_ffn);
  const int fmax = std::max(p.ffn, p.shared_ffn);
  int passes = 1;
  const MoeMmaLists lists = MoeMmaListsFor(p, kGemmTokens, &passes);
  const int rows_z = lists.shared_segments + std::min(p.num_experts, p.num_tokens * p.top_k);
  if (rows_z > 65535) return InvalidArgument("moe: {} expert lists and shared segments exceed the grid", rows_z);
  const dim3 block(kGemmThreads);
  const dim3 gu_grid(passes, (fmax + kGemmRows / 2 - 1) / (kGemmRows / 2), rows_z);
  const dim3 dn_grid(passes, (p.d + kGemmRows - 1) / kGemmRows, rows_z);
  constexpr size_t smem = kGemmSmem;
  if (fp8) {
    LaunchDependentSmem(MoeMmaGemmGateUpKernel<false, true>, gu_grid, block, smem, s, p, gu_ks, lists, maps);
  } else if (gu_ks > 1) {
    LaunchDependentSmem(MoeMmaGemmGateUpKernel<true, false>, gu_grid, block, smem, s, p, gu_ks, lists, maps);
  } else {
    LaunchDependentSmem(MoeMmaGemmGateUpKernel<false, false>, gu_grid, block, smem, s, p, gu_ks, lists, maps);
  }
  DL_KERNEL_LAUNCH_CHECK("moe_mma_gemm_gate_up");
  if (fp8) {
    LaunchDependentSmem(MoeMmaGemmDownKernel<false, true>, dn_grid, block, smem, s, p, dn_ks, lists, maps);
  } else if (dn_ks > 1) {
    LaunchDependentSmem(MoeMmaGemmDownKernel<true, false>, dn_grid, block, smem, s, p, dn_ks, lists, maps);
  } else {
    LaunchDependentSmem(MoeMmaGemmDownKernel<false, false>, dn_grid, block, smem, s, p, dn_ks, lists, maps);
  }
  DL_KERNEL_LAUNCH_CHECK("moe_mma_gemm_down");
  return Status::Ok();
}

// The checks every Moe and MoeRouter call makes; *fp8: whether any expert group is FP8 (its maps in
// *fp8_maps).
inline Status CheckMoe(const MoeParams& p, bool* fp8, MoeFp8Maps* fp8_maps) {
  // Any FP8 expert group: the FP8-capable expert kernels (MoeFp8Setup checks both groups' weights).
  *fp8 = p.gate_fp8.on() || p.up_fp8.on() || p.down_fp8.on() || p.shared_gate_fp8.on() || p.shared_up_fp8.on() ||
         p.shared_down_fp8.on();
  if (*fp8) DL_RETURN_IF_ERROR(MoeFp8Setup(p, fp8_maps));
  if (*fp8 && p.mma && !MoeFp8MmaSupported(p)) {  // ops.h 5d: block shapes that suit the chunks of 32
    return InvalidArgument("moe: the MMA experts take FP8 blocks whose columns are a power of two >= 32 or the "
                           "whole row (ops.h 5d)");
  }
  if (!p.x || !p.router_w || !p.router_bias ||
      (!*fp8 && (!p.gate_w || !p.up_w || !p.down_w || !p.shared_gate_w || !p.shared_up_w || !p.shared_down_w)) ||
      !p.y || !p.workspace || !p.counter) {
    return InvalidArgument("moe: every weight, x, y, workspace and counter must be set");
  }
  if (p.d < 8 || p.d % 8 || p.ffn < 8 || p.ffn % 8 || p.shared_ffn < 8 || p.shared_ffn % 8) {
    return InvalidArgument("moe: d {}, ffn {}, shared_ffn {} must be positive multiples of 8", p.d,
                           p.ffn, p.shared_ffn);
  }
  if (p.num_experts < 1 || p.num_experts > kMoeMaxExperts || p.top_k < 1 ||
      p.top_k > std::min(p.num_experts, kMoeMaxTopK)) {
    return InvalidArgument("moe: {} experts / top-{} unsupported (E <= {}, k <= min(E, {}))",
                           p.num_experts, p.top_k, kMoeMaxExperts, kMoeMaxTopK);
  }
  if (p.norm.residual) {
    DL_RETURN_IF_ERROR(CheckFusedInputNorm(p.norm, p.d, "moe"));
    if (p.norm.u_out == nullptr || p.norm.u_out != p.x) {
      return InvalidArgument("moe: with a fused input norm the router writes u2 for the expert kernels: norm.u_out must be x");
    }
  }
  if (p.num_tokens < 1 || p.num_tokens > 65535) {
    return InvalidArgument("moe: {} tokens (1..65535)", p.num_tokens);
  }
  if (p.router_logits != nullptr && p.norm.residual != nullptr) {
    return InvalidArgument("moe: precomputed router logits take no fused input norm (x must be u2 already)");
  }
  if (p.router_rows_min_tokens < 0) {
    return InvalidArgument("moe: router_rows_min_tokens {} (0 = never, else the token count from which the router "
                           "takes {} rows per block)", p.router_rows_min_tokens, kRouterRows);
  }
  return Status::Ok();
}

// The router for p.num_tokens tokens: the multi-row kernel (kRouterRows token rows per block) from
// router_rows_min_tokens tokens on (0: never), the one-row kernel below; the same bits either way. A
// shape whose multi-row shared memory exceeds a block's (x rows wider than ~14,000 without a fused
// norm) keeps the one-row kernel.
inline Status LaunchMoeRouter(const MoeParams& p, cudaStream_t s) {
  const int T = p.num_tokens;
  if (p.router_logits != nullptr) {
    if (RouterSharedBytes(p, kRouterRows) > kMaxBlockSmem - 1024) {
      return InvalidArgument("moe: the selection over precomputed logits of {} experts needs more shared memory than "
                             "a block has", p.num_experts);
    }
    LaunchDependentSmem(MoeSelectKernel, dim3((T + kRouterRows - 1) / kRouterRows), dim3(kMoeWarps * 32),
                        RouterSharedBytes(p, kRouterRows), s, p);
    DL_KERNEL_LAUNCH_CHECK("moe_select");
    return Status::Ok();
  }
  const int x_blocks = (p.num_experts + kMoeWarps - 1) / kMoeWarps;
  const int x_blocks_rows = (p.num_experts + kMoeWarps * kRouterRowExperts - 1) / (kMoeWarps * kRouterRowExperts);
  const bool multi = p.router_rows_min_tokens > 0 && T >= p.router_rows_min_tokens &&
                     RouterSharedBytes(p, kRouterRows) <= kMaxBlockSmem - 1024;  // room for its static arrays
  if (multi) {
    LaunchDependentSmem(MoeRouterKernel<kRouterRows>, dim3(x_blocks_rows, (T + kRouterRows - 1) / kRouterRows),
                        dim3(kMoeWarps * 32), RouterSharedBytes(p, kRouterRows), s, p);
    DL_KERNEL_LAUNCH_CHECK("moe_router_topk_rows");
  } else {
    LaunchDependentSmem(MoeRouterKernel<1>, dim3(x_blocks, T), dim3(kMoeWarps * 32), RouterSharedBytes(p, 1), s, p);
    DL_KERNEL_LAUNCH_CHECK("moe_router_topk");
  }
  return Status::Ok();
}

}  // namespace dev

size_t MoeWorkspaceBytes(int d, int num_experts, int top_k, int ffn, int shared_ffn, int num_tokens) {
  // The grouped path's lists are part of it at every T: the MMA experts (MoeParams::mma) can use them
  // at batch 1 too (mma_batch1_lists).
  const int T = std::max(num_tokens, 1);
  const size_t per_token = dev::MoeWorkspaceLayout(num_experts, top_k, ffn, shared_ffn).bytes * static_cast<size_t>(T);
  return per_token + dev::MoeGroupLayout(num_experts, top_k, d, T).bytes;
}

Status MoeRouter(const MoeParams& p, Stream stream) {
  bool fp8 = false;
  dev::MoeFp8Maps fp8_maps;
  DL_RETURN_IF_ERROR(dev::CheckMoe(p, &fp8, &fp8_maps));
  return dev::LaunchMoeRouter(p, reinterpret_cast<cudaStream_t>(stream));
}

Status Moe(const MoeParams& p, Stream stream) {
  bool fp8 = false;
  dev::MoeFp8Maps fp8_maps;
  DL_RETURN_IF_ERROR(dev::CheckMoe(p, &fp8, &fp8_maps));
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int threads = dev::kMoeWarps * 32;
  const int T = p.num_tokens;
  DL_RETURN_IF_ERROR(dev::LaunchMoeRouter(p, s));
  const int fmax = std::max(p.ffn, p.shared_ffn);
  if (p.mma && T == 1 && !p.mma_batch1_lists && !fp8) {  // the experts on the tensor-core product, no lists
    dev::LaunchMoeMmaDirect(p, s);
    DL_KERNEL_LAUNCH_CHECK("moe_mma_direct");
    return Status::Ok();
  }
  if (p.mma) {  // every T through the lists, the experts on the tensor-core product (FP8: batch 1 too)
    if (!p.topk_ids) return InvalidArgument("moe: the MMA experts (mma) need topk_ids");
    if (p.num_experts > dev::kGroupThreads) {
      return InvalidArgument("moe: the MMA experts take at most {} experts", dev::kGroupThreads);
    }
    dev::LaunchMoeGroup(p, s);
    DL_KERNEL_LAUNCH_CHECK("moe_group");
    DL_RETURN_IF_ERROR(dev::LaunchMoeMmaGemm(p, fp8, fp8_maps, s));
    dev::LaunchDependent(dev::MoeCombineKernel, dim3((p.d + 255) / 256, T), dim3(256), s, p);
    DL_KERNEL_LAUNCH_CHECK("moe_combine");
    return Status::Ok();
  }
  if (T > 1) {
    if (!p.topk_ids) return InvalidArgument("moe: the grouped path (T > 1) needs topk_ids");
    if (p.num_experts > dev::kGroupThreads) {
      return InvalidArgument("moe: the grouped path takes at most {} experts", dev::kGroupThreads);
    }
    const int listed = std::min(p.num_experts, T * p.top_k) + 1;  // + the shared expert
    if (listed > 65535) return InvalidArgument("moe: {} expert lists exceed the grid", listed);
    dev::LaunchMoeGroup(p, s);
    DL_KERNEL_LAUNCH_CHECK("moe_group");
    const int splits = (T + dev::kGroupSplit - 1) / dev::kGroupSplit;
    // Tokens staged per pass: as many as fit the budget, at most the kernel's register tile.
    auto tile_for = [](int width, int most) {
      return std::max(1, std::min<int>(most, static_cast<int>(dev::kGroupSmemBudget / (static_cast<size_t>(width) * 2))));
    };
    const int gu_tile = tile_for(p.d, dev::kGuTokens), dn_tile = tile_for(fmax, dev::kDownTokens);
    if (fp8) {
      const bool all = p.gate_fp8.on() && p.shared_gate_fp8.on();
      const dim3 gu_grid((fmax + dev::kGroupRows - 1) / dev::kGroupRows, listed, splits);
      const dim3 dn_grid((p.d + dev::kGroupRows - 1) / dev::kGroupRows, listed, splits);
      const size_t gu_smem = static_cast<size_t>(gu_tile) * p.d * 2, dn_smem = static_cast<size_t>(dn_tile) * fmax * 2;
      if (all) {
        dev::LaunchDependentSmem(dev::MoeGroupGateUpKernelW<true>, gu_grid, dim3(threads), gu_smem, s, p, fp8_maps, gu_tile);
      } else {
        dev::LaunchDependentSmem(dev::MoeGroupGateUpKernelW<false>, gu_grid, dim3(threads), gu_smem, s, p, fp8_maps, gu_tile);
      }
      DL_KERNEL_LAUNCH_CHECK("moe_group_gate_up_fp8");
      if (all) {
        dev::LaunchDependentSmem(dev::MoeGroupDownKernelW<true>, dn_grid, dim3(threads), dn_smem, s, p, fp8_maps, dn_tile);
      } else {
        dev::LaunchDependentSmem(dev::MoeGroupDownKernelW<false>, dn_grid, dim3(threads), dn_smem, s, p, fp8_maps, dn_tile);
      }
      DL_KERNEL_LAUNCH_CHECK("moe_group_down_fp8");
      dev::LaunchDependent(dev::MoeCombineKernel, dim3((p.d + 255) / 256, T), dim3(256), s, p);
      DL_KERNEL_LAUNCH_CHECK("moe_combine");
      return Status::Ok();
    }
    dev::LaunchDependentSmem(dev::MoeGroupGateUpKernel, dim3((fmax + dev::kGroupRows - 1) / dev::kGroupRows, listed, splits),
                             dim3(threads), static_cast<size_t>(gu_tile) * p.d * 2, s, p, gu_tile);
    DL_KERNEL_LAUNCH_CHECK("moe_group_gate_up");
    dev::LaunchDependentSmem(dev::MoeGroupDownKernel, dim3((p.d + dev::kGroupRows - 1) / dev::kGroupRows, listed, splits),
                             dim3(threads), static_cast<size_t>(dn_tile) * fmax * 2, s, p, dn_tile);
    DL_KERNEL_LAUNCH_CHECK("moe_group_down");
    dev::LaunchDependent(dev::MoeCombineKernel, dim3((p.d + 255) / 256, T), dim3(256), s, p);
    DL_KERNEL_LAUNCH_CHECK("moe_combine");
    return Status::Ok();
  }
  if (fp8) {
    dev::LaunchDependent(dev::MoeGateUpKernelW<dev::kGateUpMinBlocks, dev::kGateUpChunks>,
                         dim3((fmax + dev::kMoeWarps - 1) / dev::kMoeWarps, p.top_k + 1, 1), dim3(threads), s, p, fp8_maps);
    DL_KERNEL_LAUNCH_CHECK("moe_gate_up_fp8");
    const int down_rows = dev::kMoeWarps / dev::MoeDownWarpsPerRow(p.top_k);
    dev::LaunchDependent(dev::MoeDownKernelW<dev::kDownMinBlocks, dev::kDownChunks>,
                         dim3((p.d + down_rows - 1) / down_rows, 1), dim3(threads), s, p, fp8_maps);
    DL_KERNEL_LAUNCH_CHECK("moe_down_combine_fp8");
    return Status::Ok();
  }
  const dev::MoeGateUpStreamGeometry gu =
      p.gate_up_stream_ring_kb > 0 && dev::DeviceHasBulkCopy()
          ? dev::GateUpStreamGeometry(p.d, p.ffn, p.shared_ffn, p.top_k, p.gate_up_stream_ring_kb, dev::SmCount())
          : dev::MoeGateUpStreamGeometry{};
  if (gu.slots > 0) {
    dev::LaunchDependentSmem(dev::MoeGateUpStreamKernel, dim3(gu.grid), dim3((dev::kMoeWarps + 1) * 32), gu.smem, s, p, gu);
  } else {
    dev::LaunchDependent(dev::MoeGateUpKernel<dev::kGateUpMinBlocks, dev::kGateUpChunks>,
                         dim3((fmax + dev::kMoeWarps - 1) / dev::kMoeWarps, p.top_k + 1, 1), dim3(threads), s, p);
  }
  DL_KERNEL_LAUNCH_CHECK("moe_gate_up");
  const int down_rows = dev::kMoeWarps / dev::MoeDownWarpsPerRow(p.top_k);
  dev::LaunchDependent(dev::MoeDownKernel<dev::kDownMinBlocks, dev::kDownChunks>,
                       dim3((p.d + down_rows - 1) / down_rows, 1), dim3(threads), s, p);
  DL_KERNEL_LAUNCH_CHECK("moe_down_combine");
  return Status::Ok();
}

}  // namespace dl::kernels
