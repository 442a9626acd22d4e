// Fused residual add + RMSNorm: one block of 256 threads per row, each thread keeps up to 4 chunks of
// 8 elements (16-byte loads) in registers, so the row is read once and written twice (h and out).
#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kNormThreads = 256;
constexpr int kNormMaxChunks = 4;  // n <= 256 * 8 * 4 = 8192

__global__ void __launch_bounds__(kNormThreads) AddRmsNormKernel(AddRmsNormParams a) {
  AllowDependents();
  WaitForPrerequisites();
  const int row = blockIdx.x;
  const int n8 = a.n / 8;
  uint4* h_row = reinterpret_cast<uint4*>(a.residual + static_cast<size_t>(row) * a.n);
  const uint4* d_row =
      a.delta ? reinterpret_cast<const uint4*>(a.delta + static_cast<size_t>(row) * a.n) : nullptr;
  float x[kNormMaxChunks][8];
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < kNormMaxChunks; ++c) {
    const int i = threadIdx.x + c * kNormThreads;
    if (i >= n8) break;
    Bf16x8ToFloat(h_row[i], x[c]);
    if (d_row) {
      float dl[8];
      Bf16x8ToFloat(d_row[i], dl);
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 8; ++e) x[c][e] = RoundBf16(x[c][e] + dl[e]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        packed[e] = static_cast<uint32_t>(FloatToBf16Bits(x[c][2 * e])) |
                    (static_cast<uint32_t>(FloatToBf16Bits(x[c][2 * e + 1])) << 16);
      }
      h_row[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(x[c][e], x[c][e], ss);
  }
  __shared__ float s_warp[kNormThreads / 32];
  ss = WarpSum(ss);
  if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += s_warp[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(a.n) + a.eps);
  const uint4* w_row = reinterpret_cast<const uint4*>(a.weight);
  uint4* o_row = reinterpret_cast<uint4*>(a.out + static_cast<size_t>(row) * a.n);
#pragma unroll
  for (int c = 0; c < kNormMaxChunks; ++c) {
    const int i = threadIdx.x + c * kNormThreads;
    if (i >= n8) break;
    float w[8];
    Bf16x8ToFloat(w_row[i], w);
    uint32_t packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float y0 = RoundBf16(x[c][2 * e] * inv) * w[2 * e];
      const float y1 = RoundBf16(x[c][2 * e + 1] * inv) * w[2 * e + 1];
      packed[e] = static_cast<uint32_t>(FloatToBf16Bits(y0)) |
                  (static_cast<uint32_t>(FloatToBf16Bits(y1)) << 16);
    }
    o_row[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

}  // namespace dev

Status AddRmsNorm(const AddRmsNormParams& p, Stream stream) {
  if (!p.residual || !p.weight || !p.out) {
    return InvalidArgument("add_rmsnorm: residual, weight and out must be set");
  }
  if (p.n <= 0 || p.n % 8 != 0 || p.n > dev::kNormThreads * 8 * dev::kNormMaxChunks) {
    return InvalidArgument("add_rmsnorm: width {} must be a positive multiple of 8, at most {}", p.n,
                           dev::kNormThreads * 8 * dev::kNormMaxChunks);
  }
  if (p.rows < 1) return InvalidArgument("add_rmsnorm: {} rows", p.rows);
  dev::LaunchDependent(dev::AddRmsNormKernel, dim3(p.rows), dim3(dev::kNormThreads),
                       reinterpret_cast<cudaStream_t>(stream), p);
  DL_KERNEL_LAUNCH_CHECK("add_rmsnorm");
  return Status::Ok();
}

}  // namespace dl::kernels
