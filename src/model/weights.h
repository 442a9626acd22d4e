// Weight descriptors: how the Laguna forward (model/laguna_forward.h) names the weights it runs over,
// whatever backend holds them. A WeightRef is a value: where the elements are (host memory for the
// CPU reference, device memory for CUDA), their dtype and shape, and for quantised dtypes the scales
// and their block shape. FP8 checkpoints and tensor-parallel shards change what a backend puts into
// these values, never the layer code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "model/checkpoint.h"

namespace dl {

struct WeightRef {
  std::string name;             // checkpoint tensor name (errors, logs)
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;   // [out, in] for matrices, [n] for vectors
  const void* data = nullptr;   // host or device memory, as the owning backend keeps it
  // Quantised dtypes: FP32 scales, one per block of block_rows x block_cols elements, row-major over
  // the blocks ([ceil(out / block_rows), ceil(in / block_cols)]); nullptr for unquantised weights.
  const float* scales = nullptr;
  int64_t block_rows = 0, block_cols = 0;

  WeightRef() = default;
  // The checkpoint's own tensor (host memory; an FP8 weight keeps its scales and block shape).
  WeightRef(const TensorView& t)  // NOLINT
      : name(t.name), dtype(t.dtype), shape(t.shape), data(t.data), scales(t.scales), block_rows(t.block_rows),
        block_cols(t.block_cols) {}
  int64_t rows() const { return shape.empty() ? 0 : shape[0]; }
  int64_t cols() const { return shape.size() > 1 ? shape[1] : 1; }
  int64_t numel() const { return rows() * cols(); }
  bool empty() const { return data == nullptr && shape.empty(); }
};

// A linear layer y = x W^T whose weight may be stored as several matrices stacked along the output
// dimension (q, k, v and g of one layer; a dense MLP's gate and up): y = [x W_0^T | x W_1^T | ...].
struct LinearWeights {
  std::vector<WeightRef> parts;
  int64_t out() const {
    int64_t n = 0;
    for (const WeightRef& p : parts) n += p.rows();
    return n;
  }
  int64_t in() const { return parts.empty() ? 0 : parts[0].cols(); }
};

// One MoE layer: router, per-expert SwiGLU matrices, the always-on shared expert.
struct MoeWeights {
  WeightRef router;           // [E, d]
  WeightRef correction_bias;  // [E] (selection only)
  std::vector<WeightRef> gate, up, down;  // per expert: [F, d], [F, d], [d, F]
  WeightRef shared_gate, shared_up, shared_down;  // [Fs, d], [Fs, d], [d, Fs]
};

struct LagunaLayerWeights {
  WeightRef input_norm, post_attn_norm;  // [d]
  LinearWeights qkvg;                    // q [H*D], k [K*D], v [K*D], g [gate width] rows, stacked
  LinearWeights o;                       // [d, H*D]
  WeightRef q_norm, k_norm;              // [D]
  LinearWeights mlp_gate_up;             // dense layers: gate [F_d] rows then up [F_d] rows
  LinearWeights mlp_down;                // [d, F_d]
  MoeWeights moe;                        // sparse layers
};

struct LagunaWeights {
  WeightRef embed;       // [V, d]
  WeightRef final_norm;  // [d]
  LinearWeights lm_head; // [V, d]
  std::vector<LagunaLayerWeights> layers;
  // Tensor parallelism (model/weight_shard.h): the first vocabulary id of the rows `embed` and
  // `lm_head` hold (0: the whole table), and whether the embedding is a vocab-parallel slice whose
  // result the forward all-reduces.
  int64_t embed_vocab_begin = 0;
  int64_t lm_head_vocab_begin = 0;
  bool embed_vocab_parallel = false;
};

// The checkpoint's weights as host references (the CPU reference reads them in place).
LagunaWeights HostLagunaWeights(const ModelWeights& w);

}  // namespace dl
