// What a backend can run, checked once when a model is loaded so an unsupported shape is a clear
// error naming the config key, not a kernel's failure at the first forward.
#pragma once

#include "base/status.h"
#include "model/checkpoint.h"
#include "model/config.h"

namespace dl {

// The CUDA kernels read BF16 weight rows and activations with 16-byte vector loads (8 values), so
// every width a row spans must be a multiple of 8: hidden_size, head_dim, and the FFN widths of the
// layer types present (intermediate_size for dense layers; moe_intermediate_size and
// shared_expert_intermediate_size for sparse ones). InvalidArgument names the first key that is
// not, its value, and why; the CPU backend runs any width.
Status CheckCudaShapeSupport(const ModelConfig& config);

// Weight dtypes the CUDA backend uploads: BF16, F16, F32. FP8 weights (issue 18) are refused with an
// Unimplemented naming the first FP8 tensor until the FP8 kernels and upload land (branch fp8k):
// never converted silently, never a crash at upload.
Status CheckCudaWeightSupport(const Checkpoint& checkpoint);

}  // namespace dl
