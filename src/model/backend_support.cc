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

Status CheckCudaWeightSupport(const Checkpoint& checkpoint) {
  for (const TensorView& t : checkpoint.tensors()) {
    if (t.dtype == DType::kF8E4M3) {
      return Unimplemented(
          "the CUDA backend cannot run FP8 weights yet (tensor '{}' is F8_E4M3; quant_method '{}'): its FP8 "
          "kernels are not in this build. --backend cpu runs FP8 checkpoints (the exact FP32 reference)",
          t.name, checkpoint.config().quant_method);
    }
  }
  return Status::Ok();
}

}  // namespace dl
