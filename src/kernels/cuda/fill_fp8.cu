// Synthetic FP8 weights on the device (FillAffineFp8): the FP8 weight contract's quantisation of the
// synthetic formula, so shape-only checkpoints (`bench --shape`) and benchmarks get FP8 weights of
// any size without a file.
#include <cmath>

#include "base/rng.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/elementwise.h"

namespace dl::kernels {
namespace dev {

constexpr int kFillFp8Threads = 256;

// One block per scale block (grid: [ceil(rows / br) * ceil(cols / bc)]): amax over the block's FP32
// values v = offset + scale * NormalAt(key, o * cols + i) (a max: the same for any order), s = amax / 448
// (1 when amax == 0), then code = round_fp8_e4m3_satfinite(v / s) (IEEE division).
__global__ void __launch_bounds__(kFillFp8Threads) FillAffineFp8Kernel(uint8_t* codes, float* scales, int64_t rows,
                                                                       int64_t cols, int64_t br, int64_t bc,
                                                                       uint64_t key, float scale, float offset) {
  const int64_t scale_cols = (cols + bc - 1) / bc;
  const int64_t b = blockIdx.x;
  const int64_t o0 = (b / scale_cols) * br, i0 = (b % scale_cols) * bc;
  const int64_t nr = min(br, rows - o0), nc = min(bc, cols - i0);
  const int64_t n = nr * nc;
  auto value = [&](int64_t k) {
    const int64_t o = o0 + k / nc, i = i0 + k % nc;
    // No FMA: FillAffineBf16's (and the host's) two rounded operations.
    return __fadd_rn(offset, __fmul_rn(scale, NormalAt(key, static_cast<uint64_t>(o * cols + i))));
  };
  float amax = 0.0f;
  for (int64_t k = threadIdx.x; k < n; k += kFillFp8Threads) amax = fmaxf(amax, fabsf(value(k)));
  amax = WarpMax(amax);
  __shared__ float s_max[kFillFp8Threads / 32];
  __shared__ float s_scale;
  if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.0f;
    for (int w = 0; w < kFillFp8Threads / 32; ++w) m = fmaxf(m, s_max[w]);
    s_scale = m == 0.0f ? 1.0f : m / 448.0f;
    scales[b] = s_scale;
  }
  __syncthreads();
  const float s = s_scale;
  for (int64_t k = threadIdx.x; k < n; k += kFillFp8Threads) {
    const int64_t o = o0 + k / nc, i = i0 + k % nc;
    codes[o * cols + i] = FloatToFp8(__fdiv_rn(value(k), s));
  }
}

}  // namespace dev

Status FillAffineFp8(uint8_t* codes, float* scales, int64_t rows, int64_t cols, int block_rows, int block_cols,
                     uint64_t key, float scale, float offset, Stream stream) {
  if (rows <= 0 || cols <= 0) return Status::Ok();
  if (!codes || !scales || block_rows < 1 || block_cols < 1) {
    return InvalidArgument("FillAffineFp8: codes, scales and a block shape of at least 1 x 1 must be set");
  }
  const int64_t blocks = ((rows + block_rows - 1) / block_rows) * ((cols + block_cols - 1) / block_cols);
  if (blocks > 0x7fffffff) return InvalidArgument("FillAffineFp8: {} scale blocks exceed the grid", blocks);
  dev::FillAffineFp8Kernel<<<static_cast<unsigned>(blocks), dev::kFillFp8Threads, 0, stream>>>(
      codes, scales, rows, cols, block_rows, block_cols, key, scale, offset);
  DL_KERNEL_LAUNCH_CHECK("FillAffineFp8");
  return Status::Ok();
}

}  // namespace dl::kernels
