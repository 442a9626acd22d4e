// What a backend can run, checked once when a model is loaded so an unsupported shape is a clear
// error naming the config key, not a kernel's failure at the first forward.
#pragma once

#include <cstdint>
#include <string_view>

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

// An FP8 weight (the FP8 weight contract) the CUDA kernels run: rows of `cols` codes read 16 per
// 16-byte load (cols % 16 == 0), and scale blocks that never split such a load (block_cols a power of
// two multiple of 16, or the whole row). Which weights may be FP8 is the contract's (linears; never
// the embedding, norms, router or correction bias: CudaWeights refuses those). InvalidArgument names
// the tensor; the CPU backend runs any FP8 shape.
Status CheckCudaFp8WeightSupport(std::string_view tensor, int64_t cols, int64_t block_cols);
// Every FP8 tensor of `checkpoint` passes CheckCudaFp8WeightSupport (called before upload, so a
// checkpoint the kernels cannot run fails by name before anything large is built).
Status CheckCudaWeightSupport(const Checkpoint& checkpoint);

}  // namespace dl
