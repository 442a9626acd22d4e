// Error checks for CUDA runtime calls: a failing call becomes a Status naming the call, file and line.
#pragma once

#include "base/status.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#define DL_CUDA_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                         \
    cudaError_t dl_cuda_err_ = (expr);                                                         \
    if (dl_cuda_err_ != cudaSuccess) {                                                         \
      return ::dl::Status(::dl::StatusCode::kInternal,                                         \
                          fmt::format("{} failed at {}:{}: {}", #expr, __FILE__, __LINE__,     \
                                      cudaGetErrorString(dl_cuda_err_)));                      \
    }                                                                                          \
  } while (0)
#endif
