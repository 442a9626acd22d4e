#include "model/backend_support.h"

namespace dl {

Status CheckCudaShapeSupport(const ModelConfig& c) {
  bool any_dense = false, any_sparse = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    (c.is_sparse(l) ? any_sparse : any_dense) = true;
  }
  struct Width {
    const char* key;
    int64_t value;
    bool used;
  };
  const Width widths[] = {
      {"hidden_size", c.hidden_size, true},
      {"head_dim", c.head_dim, true},
      {"intermediate_size", c.intermediate_size, any_dense},
      {"moe_intermediate_size", c.moe_intermediate_size, any_sparse},
      {"shared_expert_intermediate_size", c.shared_expert_intermediate_size, any_sparse},
  };
  for (const Width& w : widths) {
    if (w.used && w.value % 8 != 0) {
      return InvalidArgument(
          "the CUDA backend cannot run this model: {} is {}, not a multiple of 8. Its kernels read "
          "BF16 rows with 16-byte vector loads (8 values per load), so every row width must be a "
          "multiple of 8; --backend cpu runs any width",
          w.key, w.value);
    }
  }
  return Status::Ok();
}

Status CheckCudaFp8WeightSupport(std::string_view tensor, int64_t cols, int64_t block_cols) {
  if (cols % 16 != 0) {
    return InvalidArgument(
        "the CUDA backend cannot run FP8 weight {}: its rows hold {} codes, not a multiple of 16. Its kernels "
        "read 16 FP8 codes per 16-byte load; --backend cpu runs any width",
        tensor, cols);
  }
  const bool pow2 = block_cols > 0 && (block_cols & (block_cols - 1)) == 0;
  if (block_cols < cols && !(pow2 && block_cols % 16 == 0)) {
    return InvalidArgument(
        "the CUDA backend cannot run FP8 weight {}: scale blocks of {} columns split its 16-code loads (they must "
        "be a power of two multiple of 16, e.g. 128, or the whole row of {}); --backend cpu runs any block shape",
        tensor, block_cols, cols);
  }
  return Status::Ok();
}

Status CheckCudaWeightSupport(const Checkpoint& checkpoint) {
  for (const TensorView& t : checkpoint.tensors()) {
    if (t.dtype != DType::kF8E4M3) continue;
    // Shape-only FP8 views without a block shape are generated in 128 x 128 blocks (CudaWeights).
    const int64_t cols = t.shape.size() > 1 ? t.shape[1] : 1;
    DL_RETURN_IF_ERROR(CheckCudaFp8WeightSupport(t.name, cols, t.block_cols > 0 ? t.block_cols : 128));
  }
  return Status::Ok();
}

}  // namespace dl
