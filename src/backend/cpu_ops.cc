#include "backend/cpu_ops.h"

#include <cmath>

namespace dl::cpu {
namespace {

template <typename Load>
void MatVecImpl(const uint8_t* base, int64_t rows, int64_t cols, const float* x, float* y, Load load) {
  // Parallel only when the matrix is big enough to pay for the fork/join.
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 18))
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
    for (int64_t c = 0; c < cols; ++c) acc += load(base, r * cols + c) * x[c];
    y[r] = acc;
  }
}

// The FP8 dequantisation of the fp8 contract: code widened exactly, times its block's FP32 scale in
// FP32. The product is rounded once, exactly as the element of an F32 checkpoint holding the
// dequantised values would be, so the same MatVec over it gives the same bits.
inline float DequantFp8(uint8_t code, float scale) { return Fp8E4M3ToFloat(code) * scale; }

float ScaleAt(const WeightRef& w, int64_t r, int64_t c) {
  const int64_t col_blocks = (w.cols() + w.block_cols - 1) / w.block_cols;
  return w.scales[(r / w.block_rows) * col_blocks + c / w.block_cols];
}

}  // namespace

float WeightAt(const WeightRef& w, int64_t i) {
  if (w.scales != nullptr) {
    return DequantFp8(static_cast<const uint8_t*>(w.data)[i], ScaleAt(w, i / w.cols(), i % w.cols()));
  }
  return LoadAsFloat(w.data, w.dtype, static_cast<size_t>(i));
}

void MatVec(const WeightRef& w, const float* x, float* y) {
  const int64_t rows = w.rows();
  const int64_t cols = w.cols();
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  switch (w.dtype) {
    case DType::kF32:
      MatVecImpl(base, rows, cols, x, y, [](const uint8_t* p, int64_t i) {
        return reinterpret_cast<const float*>(p)[i];
      });
      break;
    case DType::kBF16:
      MatVecImpl(base, rows, cols, x, y, [](const uint8_t* p, int64_t i) {
        return Bf16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
      });
      break;
    case DType::kF16:
      MatVecImpl(base, rows, cols, x, y, [](const uint8_t* p, int64_t i) {
        return F16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
      });
      break;
    case DType::kF8E4M3: {
      if (w.scales == nullptr) {
        MatVecImpl(base, rows, cols, x, y, [](const uint8_t* p, int64_t i) { return Fp8E4M3ToFloat(p[i]); });
        break;
      }
      // Same loop as MatVecImpl, with the element dequantised first (one FP32 rounding).
      const float* scales = w.scales;
      const int64_t br = w.block_rows, bc = w.block_cols, col_blocks = (cols + bc - 1) / bc;
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 18))
      for (int64_t r = 0; r < rows; ++r) {
        const float* row_scales = scales + (r / br) * col_blocks;
        const uint8_t* codes = base + r * cols;
        float acc = 0.0f;
        for (int64_t c = 0; c < cols; ++c) acc += DequantFp8(codes[c], row_scales[c / bc]) * x[c];
        y[r] = acc;
      }
      break;
    }
  }
}

void RmsNorm(const float* x, const WeightRef& w, int64_t size, float eps, float* out) {
  float sum_sq = 0.0f;
  for (int64_t i = 0; i < size; ++i) sum_sq += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(size) + eps);
  for (int64_t i = 0; i < size; ++i) out[i] = WeightAt(w, i) * (x[i] * inv);
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }
float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

}  // namespace dl::cpu
