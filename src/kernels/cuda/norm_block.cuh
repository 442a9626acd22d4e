// The residual add + RMSNorm of one row by one block of kNormThreads threads, shared by the
// AddRmsNorm kernel and the kernels that fold it into their prologue (FusedInputNorm): the same
// thread-to-chunk map and the same reduction order everywhere, so every caller gets the same bits.
#pragma once

#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/device_utils.cuh"

namespace dl::kernels::dev {

constexpr int kNormThreads = 256;
constexpr int kNormMaxChunks = 4;  // n <= 256 * 8 * 4 = 8192

// The norm weight's chunks a thread of BlockAddRmsNorm uses. The weight is constant during a step,
// so callers load it before their PDL wait: one dependent L2 round trip fewer after it.
struct NormWeights {
  uint4 w[kNormMaxChunks];
};
__device__ __forceinline__ NormWeights LoadNormWeights(const bf16* weight, int n) {
  NormWeights r;
#pragma unroll
  for (int c = 0; c < kNormMaxChunks; ++c) {
    const int i = threadIdx.x + c * kNormThreads;
    r.w[c] = i < n / 8 ? reinterpret_cast<const uint4*>(weight)[i] : make_uint4(0, 0, 0, 0);
  }
  return r;
}

// h = bf16(h_in + delta) (delta null: h = h_in), u = bf16(bf16(h * inv_rms) * w), inv_rms from the
// FP32 sum of squares of h: per thread over its chunks threadIdx.x + 256 c (16 bytes each) in order,
// then the warp's xor butterfly, then the 8 warp sums in order. Outputs, each optional: h_out and
// u_out (global, may alias h_in: a thread reads its chunks before it writes them) and u_smem
// (shared). Every thread of the block must call it (it synchronises the block).
// kStageInSmem (needs u_smem): h waits in u_smem between the two passes instead of in registers (h is
// BF16 already, so the bits are the same), for callers with weight loads in flight in registers.
// kConsumerBarrier: the 256 threads are a block's consumer warps with a producer warp after them (the
// streaming kernels), so the block synchronises on their named barrier instead of __syncthreads.
template <bool kStageInSmem = false, bool kConsumerBarrier = false>
__device__ __forceinline__ void BlockAddRmsNorm(const bf16* h_in, const bf16* delta, const NormWeights& weight, int n,
                                                float eps, bf16* h_out, bf16* u_out, uint16_t* u_smem) {
  constexpr int kHeld = kStageInSmem ? 1 : kNormMaxChunks;  // chunks of h kept in registers
  const int n8 = n / 8;
  const uint4* h_row = reinterpret_cast<const uint4*>(h_in);
  const uint4* d_row = reinterpret_cast<const uint4*>(delta);
  uint4* stage = reinterpret_cast<uint4*>(u_smem);
  float x[kHeld][8];
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < kNormMaxChunks; ++c) {
    const int i = threadIdx.x + c * kNormThreads;
    if (i >= n8) break;
    float* xc = x[kStageInSmem ? 0 : c];
    Bf16x8ToFloat(h_row[i], xc);
    if (d_row) {
      float dl[8];
      Bf16x8ToFloat(d_row[i], dl);
#pragma unroll
      for (int e = 0; e < 8; ++e) xc[e] = RoundBf16(xc[e] + dl[e]);
    }
    if (h_out || kStageInSmem) {
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        packed[e] = static_cast<uint32_t>(FloatToBf16Bits(xc[2 * e])) |
                    (static_cast<uint32_t>(FloatToBf16Bits(xc[2 * e + 1])) << 16);
      }
      const uint4 v = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      if (h_out) reinterpret_cast<uint4*>(h_out)[i] = v;
      if (kStageInSmem) stage[i] = v;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(xc[e], xc[e], ss);
  }
  __shared__ float s_warp[kNormThreads / 32];
  auto sync = [] {
    if constexpr (kConsumerBarrier) {
      ConsumerSync<kNormThreads / 32>();
    } else {
      __syncthreads();
    }
  };
  ss = WarpSum(ss);
  sync();  // s_warp may still be read by a previous call
  if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = ss;
  sync();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += s_warp[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(n) + eps);
#pragma unroll
  for (int c = 0; c < kNormMaxChunks; ++c) {
    const int i = threadIdx.x + c * kNormThreads;
    if (i >= n8) break;
    float* xc = x[kStageInSmem ? 0 : c];
    if (kStageInSmem) Bf16x8ToFloat(stage[i], xc);  // this thread's own chunk: no barrier needed
    float w[8];
    Bf16x8ToFloat(weight.w[c], w);
    uint32_t packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float y0 = RoundBf16(xc[2 * e] * inv) * w[2 * e];
      const float y1 = RoundBf16(xc[2 * e + 1] * inv) * w[2 * e + 1];
      packed[e] = static_cast<uint32_t>(FloatToBf16Bits(y0)) |
                  (static_cast<uint32_t>(FloatToBf16Bits(y1)) << 16);
    }
    const uint4 v = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    if (u_out) reinterpret_cast<uint4*>(u_out)[i] = v;
    if (u_smem) reinterpret_cast<uint4*>(u_smem)[i] = v;
  }
  sync();  // u_smem complete for every thread
}

// A consumer's FusedInputNorm for the row at element offset `row`: u into u_smem (every block), and
// from the writer block the updated residual and u where the norm names them.
template <bool kConsumerBarrier = false>
__device__ __forceinline__ void FusedNormRow(const FusedInputNorm& nm, size_t row, const NormWeights& weight, int n,
                                             bool writer, uint16_t* u_smem) {
  BlockAddRmsNorm<true, kConsumerBarrier>(nm.residual + row, nm.delta ? nm.delta + row : nullptr, weight, n, nm.eps,
                        writer && nm.residual_out ? nm.residual_out + row : nullptr,
                        writer && nm.u_out ? nm.u_out + row : nullptr, u_smem);
}

// BlockAddRmsNorm<true> (h staged in u_smem) of `rows` <= kRows consecutive rows at once, for a consumer
// that needs several normalised rows (the multi-row MoE router): row v's chunks, sum of squares, warp
// butterfly, 8-warp sum in order and roundings are exactly BlockAddRmsNorm's, so each row gets the bits
// of a call of its own; only the rows' loads are in flight together and the block synchronises three
// times instead of three times per row. Row v: element offset v * n of h_in, delta, h_out and u_out,
// and u_smem + v * n. Every thread of the block must call it (rows the same in every thread).
template <int kRows>
__device__ __forceinline__ void BlockAddRmsNormRows(const bf16* h_in, const bf16* delta, const NormWeights& weight,
                                                    int n, int rows, float eps, bf16* h_out, bf16* u_out,
                                                    uint16_t* u_smem) {
  const int n8 = n / 8;
  const uint4* h_rows = reinterpret_cast<const uint4*>(h_in);
  const uint4* d_rows = reinterpret_cast<const uint4*>(delta);
  uint4* stage = reinterpret_cast<uint4*>(u_smem);
  float ss[kRows];
#pragma unroll
  for (int v = 0; v < kRows; ++v) {
    ss[v] = 0.0f;
    if (v >= rows) continue;
#pragma unroll
    for (int c = 0; c < kNormMaxChunks; ++c) {
      const int i = threadIdx.x + c * kNormThreads;
      if (i >= n8) break;
      const size_t at = static_cast<size_t>(v) * n8 + i;
      float xc[8];
      Bf16x8ToFloat(h_rows[at], xc);
      if (d_rows) {
        float dl[8];
        Bf16x8ToFloat(d_rows[at], dl);
#pragma unroll
        for (int e = 0; e < 8; ++e) xc[e] = RoundBf16(xc[e] + dl[e]);
      }
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        packed[e] = static_cast<uint32_t>(FloatToBf16Bits(xc[2 * e])) |
                    (static_cast<uint32_t>(FloatToBf16Bits(xc[2 * e + 1])) << 16);
      }
      const uint4 hb = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      if (h_out) reinterpret_cast<uint4*>(h_out)[at] = hb;
      stage[at] = hb;
#pragma unroll
      for (int e = 0; e < 8; ++e) ss[v] = fmaf(xc[e], xc[e], ss[v]);
    }
  }
  __shared__ float s_warp[kRows][kNormThreads / 32];
#pragma unroll
  for (int v = 0; v < kRows; ++v) ss[v] = WarpSum(ss[v]);
  __syncthreads();  // s_warp may still be read by a previous call
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int v = 0; v < kRows; ++v) s_warp[v][threadIdx.x >> 5] = ss[v];
  }
  __syncthreads();
  float inv[kRows];
#pragma unroll
  for (int v = 0; v < kRows; ++v) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kNormThreads / 32; ++w) total += s_warp[v][w];
    inv[v] = 1.0f / sqrtf(total / static_cast<float>(n) + eps);
  }
#pragma unroll
  for (int c = 0; c < kNormMaxChunks; ++c) {
    const int i = threadIdx.x + c * kNormThreads;
    if (i >= n8) break;
    float w[8];
    Bf16x8ToFloat(weight.w[c], w);
#pragma unroll
    for (int v = 0; v < kRows; ++v) {
      if (v >= rows) break;
      const size_t at = static_cast<size_t>(v) * n8 + i;
      float xc[8];
      Bf16x8ToFloat(stage[at], xc);  // this thread's own chunk: no barrier needed
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float y0 = RoundBf16(xc[2 * e] * inv[v]) * w[2 * e];
        const float y1 = RoundBf16(xc[2 * e + 1] * inv[v]) * w[2 * e + 1];
        packed[e] = static_cast<uint32_t>(FloatToBf16Bits(y0)) |
                    (static_cast<uint32_t>(FloatToBf16Bits(y1)) << 16);
      }
      const uint4 u = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      if (u_out) reinterpret_cast<uint4*>(u_out)[at] = u;
      stage[at] = u;
    }
  }
  __syncthreads();  // u_smem complete for every thread
}

// FusedNormRow for `rows` <= kRows consecutive rows from element offset `row` (BlockAddRmsNormRows):
// u into u_smem ([rows][n]), from the writer block the updated residual and u where the norm names
// them; each row's bits are FusedNormRow's.
template <int kRows>
__device__ __forceinline__ void FusedNormRows(const FusedInputNorm& nm, size_t row, int rows, const NormWeights& weight,
                                              int n, bool writer, uint16_t* u_smem) {
  BlockAddRmsNormRows<kRows>(nm.residual + row, nm.delta ? nm.delta + row : nullptr, weight, n, rows, nm.eps,
                             writer && nm.residual_out ? nm.residual_out + row : nullptr,
                             writer && nm.u_out ? nm.u_out + row : nullptr, u_smem);
}

// Before the PDL wait, in a consumer of a FusedInputNorm: warm L2 with the rows [row, row + n * rows)
// of the residual (FusedInputNorm::prefetch_residual), this block's threads in turn.
__device__ __forceinline__ void PrefetchNormResidual(const FusedInputNorm& nm, size_t row, int n, int rows,
                                                     int threads) {
  if (nm.prefetch_residual) PrefetchBytesL2(nm.residual + row, static_cast<size_t>(n) * rows * 2, threadIdx.x, threads);
}

// The launchers' check of a FusedInputNorm (set) for rows of width n; `op` names the consumer.
inline Status CheckFusedInputNorm(const FusedInputNorm& norm, int n, const char* op) {
  if (!norm.weight) return InvalidArgument("{}: a fused input norm needs its weight", op);
  if (n > kNormThreads * 8 * kNormMaxChunks) {
    return InvalidArgument("{}: a fused input norm takes rows of at most {} (width {})", op,
                           kNormThreads * 8 * kNormMaxChunks, n);
  }
  if (norm.residual_out == norm.residual) {
    return InvalidArgument("{}: a fused input norm cannot update the residual in place (other blocks read it)", op);
  }
  return Status::Ok();
}

}  // namespace dl::kernels::dev
