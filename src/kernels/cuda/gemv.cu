// BF16 GEMV (and small-T GEMM with the same per-element order): one warp per output row, lanes walk
// the row in 16-byte chunks (lane, lane+32, ...), 4 loads in flight per lane, FP32 FMAs in a fixed
// sequence, xor-butterfly warp sum. The per-token arithmetic is identical for every tile width, so
// y for token t does not depend on how many tokens share the launch.
#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kGemvWarps = 8;
constexpr int kGemvTile = 8;  // tokens per pass over W

template <int TT>
__global__ void __launch_bounds__(kGemvWarps * 32) GemvKernel(GemvParams a, int t0, int nt) {
  constexpr int U = 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * kGemvWarps + warp;
  if (row >= a.out) return;
  const int n8 = a.in / 8;
  const uint4* w_row = reinterpret_cast<const uint4*>(a.w + static_cast<size_t>(row) * a.in);
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  for (int c0 = lane; c0 < n8; c0 += 32 * U) {
    uint4 wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < n8) wv[u] = w_row[c];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= n8) break;
      float wf[8];
      Bf16x8ToFloat(wv[u], wf);
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t >= nt) break;
        float xf[8];
        Bf16x8ToFloat(reinterpret_cast<const uint4*>(a.x + (t0 + t) * a.x_stride)[c], xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[t] = fmaf(wf[e], xf[e], acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= nt) break;
    const float s = WarpSum(acc[t]);
    if (lane == 0) a.y[(t0 + t) * a.y_stride + row] = FloatToBf16Bits(s);
  }
}

}  // namespace dev

Status Gemv(const GemvParams& params, Stream stream) {
  GemvParams p = params;
  if (!p.w || !p.x || !p.y) return InvalidArgument("gemv: w, x and y must be set");
  if (p.out < 1 || p.in < 8 || p.in % 8 != 0 || p.num_tokens < 1) {
    return InvalidArgument("gemv: shape [{} x {}] x {} tokens unsupported (in must be a multiple "
                           "of 8)", p.out, p.in, p.num_tokens);
  }
  if (p.x_stride == 0) p.x_stride = p.in;
  if (p.y_stride == 0) p.y_stride = p.out;
  if (p.x_stride % 8 != 0) return InvalidArgument("gemv: x_stride {} not a multiple of 8", p.x_stride);
  const dim3 grid((p.out + dev::kGemvWarps - 1) / dev::kGemvWarps);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (p.num_tokens == 1) {
    dev::GemvKernel<1><<<grid, dev::kGemvWarps * 32, 0, s>>>(p, 0, 1);
  } else {
    for (int t0 = 0; t0 < p.num_tokens; t0 += dev::kGemvTile) {
      const int nt = std::min(dev::kGemvTile, p.num_tokens - t0);
      dev::GemvKernel<dev::kGemvTile><<<grid, dev::kGemvWarps * 32, 0, s>>>(p, t0, nt);
    }
  }
  DL_KERNEL_LAUNCH_CHECK("gemv");
  return Status::Ok();
}

}  // namespace dl::kernels
