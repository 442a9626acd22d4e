// The prompt-row attention kernel (AttnKind::kPrompt), instantiated per preset beside the split-KV
// kernel: flash-style attention on BF16 tensor cores (mma.sync m16n8k16, FP32 accumulation) for the
// rows of a prompt chunk, over the paged KV cache.
//
// Grid (tile of kPromptRows = 16 query rows, KV head), G warps: warp g owns query head kvh*G + g for
// the tile's 16 rows, and all G warps share every K/V tile of kPromptKeys = 64 keys staged in shared
// memory (BF16; FP8 codes are widened to BF16 exactly on the way in, the scales applied to the scores
// and the output). Per key tile: S = Q K^T (MMA), scores scaled and masked per row, the online softmax
// (row max, rescale, p = exp2(s - m)), O += bf16(P) V (MMA).
//
// Exactness class (docs/exactness.md, "Prompt rows and generated rows"): a row's output depends only
// on its own query, its position, its visible keys and the preset, never on the tile it shares, the
// chunking of its prompt, the page size or the other rows of the launch, because
//   - key tiles are ABSOLUTE (keys [64 j, 64 j + 64)) and a row walks them in ascending order;
//   - an MMA output element depends only on its own row of A and column of B (and its accumulator);
//   - the row max and sum are reduced in one fixed order (the lane's 16 values, then the quad);
//   - tiles a row does not see change nothing: before its first visible key a row's state stays
//     exactly (m = -inf, l = 0, O = 0) (the -inf guard below), and after its last one p = 0 and the
//     rescale factor is exp2(0) = 1, so l and O keep their bits (keys past a row's position are
//     finite or zero-filled, never NaN).
// It does NOT equal the split-KV kernel (decode rows) bit for bit: P is rounded to BF16 for the MMA.
#pragma once

#include <cmath>

#include "kernels/attention/attention_kernel.cuh"
#include "kernels/cuda/mma_product.cuh"

namespace dl::kernels {

inline constexpr int kPromptRows = 16;  // query rows per block (one m16 MMA tile per warp)
inline constexpr int kPromptKeys = 64;  // keys per K/V tile (8 n8 tiles of scores)

namespace dev {

// Shared memory of the prompt kernel: BF16 tiles [kPromptKeys][D] of K and V, two stages for BF16 KV
// (loaded in place by cp.async), one stage plus two raw stages of FP8 codes for FP8 KV.
template <int D, KvDtype KV>
constexpr size_t PromptSmemBytes() {
  constexpr size_t tile = static_cast<size_t>(kPromptKeys) * D * 2;  // one BF16 tile
  return KV == KvDtype::kFp8 ? 2 * tile + 2 * 2 * (tile / 2) : 2 * 2 * tile;
}

// Byte offset of 16-byte piece j of key row r in a BF16 [kPromptKeys][D] tile: pieces XOR-swizzled by
// the row, so the 8 rows an ldmatrix reads at one logical piece sit in different banks.
template <int D>
__device__ __forceinline__ uint32_t PromptTileOffset(int r, int j) {
  constexpr int kPieces = D / 8;
  constexpr int kSwz = kPieces >= 8 ? 7 : kPieces - 1;
  return static_cast<uint32_t>(r * (D * 2) + ((j ^ (r & kSwz)) << 4));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  return static_cast<uint32_t>(FloatToBf16Bits(lo)) | (static_cast<uint32_t>(FloatToBf16Bits(hi)) << 16);
}

// One (tile of 16 rows, KV head) block. a.num_tokens rows; row t's query is q[t, h, :], its position
// positions[t] (or first_position + t), its table RowBlockTable(t).
template <int D, int G, int P, KvDtype KV, bool SLIDING>
__global__ void __launch_bounds__(G * 32, 1) PromptAttentionKernel(const AttentionParams a) {
  DL_TIMELINE_SCOPE(kAttention);
  constexpr int R = kPromptRows, BK = kPromptKeys;
  constexpr int kThreads = G * 32;
  constexpr int kElemBytes = KV == KvDtype::kFp8 ? 1 : 2;
  constexpr int kRowPieces = D * kElemBytes / 16;  // 16-byte pieces of one key's row in the pool
  constexpr int kTileBytes = BK * D * 2;          // one BF16 tile
  constexpr int KS = D / 16;                      // k16 steps of Q K^T
  constexpr int DN = D / 8;                       // n8 tiles of the output
  static_assert(D % 16 == 0 && DN % 2 == 0, "head dim: whole k16 steps and pairs of n8 tiles");
  static_assert((D * kElemBytes) % 16 == 0, "a key row is whole 16-byte pieces");

  extern __shared__ __align__(128) unsigned char dl_prompt_smem[];
  __shared__ int s_pos[R], s_start[R];
  __shared__ const int32_t* s_table[R];

  AllowDependentsAtStart(a.release_after_wait);
  const int kvh = blockIdx.y;
  // Tiles in reverse order: the last rows see the most keys, so they start first.
  const int t0 = (gridDim.x - 1 - blockIdx.x) * R;
  const int nr = min(R, a.num_tokens - t0);
  const int H = a.num_q_heads, K = a.num_kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, c = lane & 3;
  const int h = kvh * G + warp;
  const float scale_log2 = a.softmax_scale * (KV == KvDtype::kFp8 ? a.k_scale : 1.0f) * 1.4426950408889634f;
  const float v_scale = KV == KvDtype::kFp8 ? a.v_scale : 1.0f;
  const char* k_base = static_cast<const char*>(a.k_pool);
  const char* v_base = static_cast<const char*>(a.v_pool);
  unsigned char* s_k = dl_prompt_smem;  // BF16 tiles: K stage 0, V stage 0 (BF16 KV: then K/V stage 1)
  const uint32_t smem0 = SmemAddr(dl_prompt_smem);

  WaitReleasing(a.release_after_wait);
  StageBlockRows<SLIDING>(a, t0, nr, s_pos, s_start, s_table);
  __syncthreads();

  // Row sets: consecutive rows with one block table (a tile holds rows of one sequence, except where
  // a sequence's rows end inside it). Every thread walks them alike.
  for (int r0 = 0; r0 < nr;) {
    int r1 = r0 + 1;
    while (r1 < nr && s_table[r1] == s_table[r0]) ++r1;
    const int32_t* table = s_table[r0];
    int lo = INT_MAX, hi = -1;  // the union of the set's visible key ranges
    for (int r = r0; r < r1; ++r) lo = min(lo, s_start[r]), hi = max(hi, s_pos[r]);
    // This lane's two rows (gq and gq + 8 of the tile): in the set or not, and their visible ranges.
    const int ra = gq, rb = gq + 8;
    const bool in_a = ra >= r0 && ra < r1, in_b = rb >= r0 && rb < r1;
    const int lo_a = in_a ? s_start[ra] : INT_MAX, hi_a = in_a ? s_pos[ra] : -1;
    const int lo_b = in_b ? s_start[rb] : INT_MAX, hi_b = in_b ? s_pos[rb] : -1;
    const int set_lo = r0, set_hi = r1;
    r0 = r1;

    // Q fragments of the warp's head (A operand, rows gq and gq + 8; zeros for rows outside the set).
    uint32_t qa[KS][4];
    {
      const uint32_t* qrow_a = reinterpret_cast<const uint32_t*>(a.q + (static_cast<size_t>(t0 + ra) * H + h) * D);
      const uint32_t* qrow_b = reinterpret_cast<const uint32_t*>(a.q + (static_cast<size_t>(t0 + rb) * H + h) * D);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        qa[ks][0] = in_a ? qrow_a[ks * 8 + c] : 0u;
        qa[ks][1] = in_b ? qrow_b[ks * 8 + c] : 0u;
        qa[ks][2] = in_a ? qrow_a[ks * 8 + 4 + c] : 0u;
        qa[ks][3] = in_b ? qrow_b[ks * 8 + 4 + c] : 0u;
      }
    }

    // Tile j's keys [64 j, 64 j + 64) ∩ [lo, hi] into stage `st` (zeros elsewhere: never a table entry
    // outside the set's range, which the sliding window may have dropped).
    auto issue = [&](int j, int st) {
      unsigned char* kdst;
      unsigned char* vdst;
      if constexpr (KV == KvDtype::kFp8) {
        kdst = s_k + 2 * kTileBytes + st * kTileBytes;  // raw stage: K codes then V codes
        vdst = kdst + kTileBytes / 2;
      } else {
        kdst = s_k + st * 2 * kTileBytes;
        vdst = kdst + kTileBytes;
      }
      for (int i = threadIdx.x; i < BK * kRowPieces; i += kThreads) {
        const int r = i / kRowPieces, piece = i % kRowPieces;
        const int s = j * BK + r;
        const bool v = s >= lo && s <= hi;
        const size_t off = v ? ((static_cast<size_t>(table[s / P]) * P + s % P) * K + kvh) * (D * kElemBytes) + 16 * piece
                             : 0;
        const uint32_t dst = KV == KvDtype::kFp8 ? static_cast<uint32_t>(r * D + 16 * piece) : PromptTileOffset<D>(r, piece);
        CpAsync16(kdst + dst, k_base + off, v);
        CpAsync16(vdst + dst, v_base + off, v);
      }
      CpAsyncCommit();
    };
    // FP8: stage `st`'s codes -> the BF16 tiles (exact: every E4M3 value is a BF16 value).
    auto widen = [&](int st) {
      const unsigned char* raw = s_k + 2 * kTileBytes + st * kTileBytes;
      for (int i = threadIdx.x; i < 2 * BK * kRowPieces; i += kThreads) {
        const int m = i / (BK * kRowPieces), rem = i % (BK * kRowPieces);
        const int r = rem / kRowPieces, piece = rem % kRowPieces;  // 16 codes: dims 16 piece .. + 16
        const uint4 w = *reinterpret_cast<const uint4*>(raw + m * (kTileBytes / 2) + r * D + 16 * piece);
        float f[16];
        Fp8x8ToFloat(make_uint2(w.x, w.y), f);
        Fp8x8ToFloat(make_uint2(w.z, w.w), f + 8);
        unsigned char* dst = s_k + m * kTileBytes;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint4 o;
          o.x = PackBf16x2(f[8 * half + 0], f[8 * half + 1]);
          o.y = PackBf16x2(f[8 * half + 2], f[8 * half + 3]);
          o.z = PackBf16x2(f[8 * half + 4], f[8 * half + 5]);
          o.w = PackBf16x2(f[8 * half + 6], f[8 * half + 7]);
          *reinterpret_cast<uint4*>(dst + PromptTileOffset<D>(r, 2 * piece + half)) = o;
        }
      }
    };

    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;
    float acc[DN][4];
#pragma unroll
    for (int n = 0; n < DN; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    const int j_lo = lo / BK, j_hi = hi / BK;
    issue(j_lo, 0);
    for (int j = j_lo; j <= j_hi; ++j) {
      const int st = (j - j_lo) & 1;
      CpAsyncWait<0>();
      __syncthreads();  // tile j landed; every warp is done with the stage tile j + 1 goes to
      uint32_t k_tile, v_tile;
      if constexpr (KV == KvDtype::kFp8) {
        widen(st);
        if (j < j_hi) issue(j + 1, st ^ 1);
        __syncthreads();  // the BF16 tiles
        k_tile = smem0, v_tile = smem0 + kTileBytes;
      } else {
        if (j < j_hi) issue(j + 1, st ^ 1);
        k_tile = smem0 + st * 2 * kTileBytes, v_tile = k_tile + kTileBytes;
      }

      // ---- S = Q K^T: 8 n8 tiles of keys; ldmatrix.x4 gives B for key tiles n and n + 1 at k16 step ks.
      float sc[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        const int key = (n + (lane >> 4)) * 8 + (lane & 7);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          uint32_t b0, b1, b2, b3;
          LdMatrixX4(k_tile + PromptTileOffset<D>(key, 2 * ks + ((lane >> 3) & 1)), b0, b1, b2, b3);
          Mma16816(sc[n], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
          Mma16816(sc[n + 1], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b2, b3);
        }
      }

      // ---- Scale, mask, online softmax per row (lane's 16 values in order, then the quad).
      float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int s = j * BK + n * 8 + 2 * c + (e & 1);
          const bool row_b = e >= 2;
          const bool vis = row_b ? (s >= lo_b && s <= hi_b) : (s >= lo_a && s <= hi_a);
          sc[n][e] = vis ? sc[n][e] * scale_log2 : -INFINITY;
          if (row_b) {
            mx_b = fmaxf(mx_b, sc[n][e]);
          } else {
            mx_a = fmaxf(mx_a, sc[n][e]);
          }
        }
      }
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
      const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
      // Nothing visible yet: subtract 0, so p = 0 and the state stays (-inf, 0, 0) exactly.
      const float mu_a = mn_a == -INFINITY ? 0.0f : mn_a, mu_b = mn_b == -INFINITY ? 0.0f : mn_b;
      const float alpha_a = exp2f(m_a - mu_a), alpha_b = exp2f(m_b - mu_b);
      m_a = mn_a, m_b = mn_b;
      float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        sc[n][0] = exp2f(sc[n][0] - mu_a), sc[n][1] = exp2f(sc[n][1] - mu_a);
        sc[n][2] = exp2f(sc[n][2] - mu_b), sc[n][3] = exp2f(sc[n][3] - mu_b);
        sum_a += sc[n][0], sum_a += sc[n][1];
        sum_b += sc[n][2], sum_b += sc[n][3];
      }
      l_a = fmaf(l_a, alpha_a, sum_a), l_b = fmaf(l_b, alpha_b, sum_b);
#pragma unroll
      for (int n = 0; n < DN; ++n) {
        acc[n][0] *= alpha_a, acc[n][1] *= alpha_a;
        acc[n][2] *= alpha_b, acc[n][3] *= alpha_b;
      }

      // ---- O += bf16(P) V: k16 step kk covers keys 16 kk .. + 16 (score tiles 2 kk, 2 kk + 1);
      // ldmatrix.x4.trans gives B for output tiles n and n + 1.
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t pa0 = PackBf16x2(sc[2 * kk][0], sc[2 * kk][1]);
        const uint32_t pa1 = PackBf16x2(sc[2 * kk][2], sc[2 * kk][3]);
        const uint32_t pa2 = PackBf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        const uint32_t pa3 = PackBf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int n = 0; n < DN; n += 2) {
          uint32_t b0, b1, b2, b3;
          LdMatrixX4Trans(v_tile + PromptTileOffset<D>(key, n + (lane >> 4)), b0, b1, b2, b3);
          Mma16816(acc[n], pa0, pa1, pa2, pa3, b0, b1);
          Mma16816(acc[n + 1], pa0, pa1, pa2, pa3, b2, b3);
        }
      }
    }

    // ---- out = gate(bf16(O v_scale / l)) for the set's rows; l summed over the quad in one order.
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = rr == 0 ? ra : rb;
      if (r < set_lo || r >= set_hi) continue;
      const int t = t0 + r;
      const float l = rr == 0 ? l_a : l_b;
      uint32_t* orow = reinterpret_cast<uint32_t*>(a.out + (static_cast<size_t>(t) * H + h) * D);
#pragma unroll
      for (int n = 0; n < DN; ++n) {
        const int d = n * 8 + 2 * c;
        const uint16_t lo16 = GateAndRound(a, t, h, d, acc[n][2 * rr] * v_scale / l);
        const uint16_t hi16 = GateAndRound(a, t, h, d + 1, acc[n][2 * rr + 1] * v_scale / l);
        orow[d / 2] = static_cast<uint32_t>(lo16) | (static_cast<uint32_t>(hi16) << 16);
      }
    }
    __syncthreads();  // the stages are free for the next set
  }
}

}  // namespace dev

// The prompt kernel for p (softmax_scale resolved here): grid (ceil(T / 16), K), G warps.
template <int D, int G, int P, KvDtype KV, bool SLIDING>
Status LaunchPromptAttention(const AttentionParams& params, Stream stream) {
  AttentionParams p = params;
  if (p.softmax_scale <= 0.0f) p.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  const dim3 grid((p.num_tokens + kPromptRows - 1) / kPromptRows, p.num_kv_heads);
  const cudaError_t e = dev::LaunchDependentSmem(dev::PromptAttentionKernel<D, G, P, KV, SLIDING>, grid, dim3(G * 32),
                                                 dev::PromptSmemBytes<D, KV>(), reinterpret_cast<cudaStream_t>(stream), p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Internal("launching {} (prompt) failed: {}", CanonicalName(PresetKeyOf(p)), cudaGetErrorString(e));
  }
  DL_KERNEL_LAUNCH_CHECK(CanonicalName(PresetKeyOf(p)) + " (prompt)");
  return Status::Ok();
}

}  // namespace dl::kernels
