#pragma once

#include "base/status.h"

namespace dl::cuda {

// The dense BF16 tensor-core peak of `device` as a well-kept library reaches it: cuBLASLt's
// heuristic choice for an n x n x n BF16 product (FP32 accumulation, BF16 out) on pseudo-random data
// (constant data draws less power and would clock higher), the median of `repeats` timed products
// after a warm-up, in TFLOP/s (2 n^3 per product). The prefill's achieved TFLOP/s are reported as a
// share of this. cuBLASLt is opened at run time (libcublasLt.so.13 from the CUDA toolkit), so the
// binary does not need it; without it this is Unavailable, naming the libraries tried.
Result<double> MeasureBf16PeakTflops(int device, int n = 8192, int repeats = 10);

}  // namespace dl::cuda
