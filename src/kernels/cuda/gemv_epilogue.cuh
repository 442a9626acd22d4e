// The ends of the CUDA-core GEMV kernels, shared by the BF16 (gemv.cu) and FP8 (gemv_fp8.cu) kernels:
// each lane holds its slice's partial dots; warp sums (xor butterfly), then the KS slices of a row
// added in ascending order, one BF16 rounding. Both weight formats reduce with exactly these steps,
// so the order the FP8 rule and the BF16 kernels promise (kernels/ops.h) is written once.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels::dev {

// One row per warp group (KS warps: slices 0 .. KS-1 of `row`), TT token columns, nt of them live:
// y[(t0 + t) * y_stride + row] = bf16(sum over slices of WarpSum(acc[t])). Every warp of the block
// calls it (KS > 1 synchronises the block); kWarps is the block's warp count. Ends the kernel's work.
template <int KS, int TT, int kWarps>
__device__ __forceinline__ void GemvStoreRow(const float (&acc)[TT], bool live, int nt, int warp, int slice,
                                             int lane, bf16* y, int64_t y_stride, int t0, int row) {
  if constexpr (KS == 1) {
    if (!live) return;
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t >= nt) break;
      const float s = WarpSum(acc[t]);
      if (lane == 0) y[(t0 + t) * y_stride + row] = FloatToBf16Bits(s);
    }
  } else {
    __shared__ float s_part[kWarps][TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      const float s = WarpSum(acc[t]);
      if (lane == 0) s_part[warp][t] = s;
    }
    __syncthreads();
    if (slice != 0 || !live || lane >= nt) return;
    const int t = lane;  // lane t writes token t
    float s = s_part[warp][t];
#pragma unroll
    for (int k = 1; k < KS; ++k) s += s_part[warp + k][t];
    y[(t0 + t) * y_stride + row] = FloatToBf16Bits(s);
  }
}

// R consecutive rows row0 .. row0+R-1 per warp group (live[r]), TT token columns: the same sums.
template <int KS, int R, int TT, int kWarps>
__device__ __forceinline__ void GemvStoreRows(const float (&acc)[R][TT], const bool (&live)[R], int nt, int warp,
                                              int slice, int lane, bf16* y, int64_t y_stride, int t0, int row0) {
  if constexpr (KS == 1) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        const float v = WarpSum(acc[r][t]);
        if (lane == 0 && live[r] && t < nt) y[(t0 + t) * y_stride + row0 + r] = FloatToBf16Bits(v);
      }
  } else {
    __shared__ float s_part[kWarps][R * TT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        const float v = WarpSum(acc[r][t]);
        if (lane == 0) s_part[warp][r * TT + t] = v;
      }
    __syncthreads();
    if (slice != 0) return;
    for (int i = lane; i < R * TT; i += 32) {
      const int r = i / TT, t = i % TT;
      if (!live[r] || t >= nt) continue;
      float v = s_part[warp][i];
#pragma unroll
      for (int k = 1; k < KS; ++k) v += s_part[warp + k][i];
      y[(t0 + t) * y_stride + row0 + r] = FloatToBf16Bits(v);
    }
  }
}

// The streaming kernels' end: rows r0 .. r0+rows-1 from s_part[row * ks + slice] (each slice's warp
// sum), slices added in ascending order; block-strided over kThreads threads.
template <int kThreads>
__device__ __forceinline__ void GemvStoreStreamed(const float* s_part, int rows, int ks, bf16* y, int r0) {
  for (int i = threadIdx.x; i < rows; i += kThreads) {
    float sum = s_part[i * ks];
    for (int k = 1; k < ks; ++k) sum += s_part[i * ks + k];
    y[r0 + i] = FloatToBf16Bits(sum);
  }
}

}  // namespace dl::kernels::dev
