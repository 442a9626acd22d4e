// FP32 reference operations of the CPU backend: slow, plain loops whose only job is to be obviously
// right. Weights are read in their checkpoint dtype (BF16/F16/F32, or FP8 codes times their FP32
// block scale in FP32: the fp8 contract) and widened on the fly, so a checkpoint is never copied into
// a second, wider in-memory form.
#pragma once

#include <cstdint>

#include "model/weights.h"

namespace dl::cpu {

// y[out] = W[out, in] . x[in]. Rows are independent; parallel over rows for large matrices.
void MatVec(const WeightRef& w, const float* x, float* y);
// out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i]; out may alias x.
void RmsNorm(const float* x, const WeightRef& w, int64_t size, float eps, float* out);
float WeightAt(const WeightRef& w, int64_t i);
float Silu(float x);
float Sigmoid(float x);
// PyTorch's softplus (beta 1, threshold 20): x above 20 is returned as is.
float Softplus(float x);

}  // namespace dl::cpu
