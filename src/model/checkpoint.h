// A loaded Laguna checkpoint: config.json plus every weight as a typed view into memory-mapped
// safetensors shards (or into in-memory buffers for synthetic `--shape` weights). Open() validates
// everything -- each tensor's name, dtype and shape against the config -- so the forward pass can
// index the views without further checks.
//
// Layouts accepted (spec §4): the per-expert on-disk layout transformers' save_pretrained writes, and
// the fused in-memory layout (mlp.experts.gate_up_proj [E, 2F, d] gate rows first,
// mlp.experts.down_proj [E, d, F], mlp.gate.e_score_correction_bias, mlp.shared_experts.*). For the
// fused layout each ExpertWeights holds views into slices of the fused tensors, so consumers never
// see the difference.
//
// Dtypes: each view carries its own dtype (BF16, F16 or F32; e.g. an F32 correction bias next to
// BF16 weights), read from the safetensors header. Data pointers are only as aligned as the file
// makes them (PyTorch-written files align every tensor to its element size).
//
// FP8 weights (config.json quantization_config, model/quantization.h, docs/fp8.md): a linear weight
// stored as F8_E4M3 comes with its F32 scale tensor (`<weight>_scale_inv` native, `<weight>_scale`
// compressed-tensors); its view carries the scales (copied into FP32 memory the checkpoint owns) and
// their block shape. Missing, misshapen, non-F32 or non-finite scales are errors naming the tensor.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "model/config.h"
#include "model/fp8_layout.h"

namespace dl {

struct TensorView {
  // (A constructor rather than an aggregate, so TensorView{name, dtype, shape, data} leaves the FP8
  // fields at their defaults without missing-initializer warnings.)
  TensorView() = default;
  TensorView(std::string name_, DType dtype_, std::vector<int64_t> shape_, const void* data_ = nullptr)
      : name(std::move(name_)), dtype(dtype_), shape(std::move(shape_)), data(data_) {}

  std::string name;  // checkpoint name; for fused slices "…gate_up_proj[e].gate" etc.
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  // FP8 weights only: FP32 scales, one per block of block_rows x block_cols elements, row-major over
  // the blocks ([ceil(out / block_rows), ceil(in / block_cols)]; per-channel (1, in), per-tensor
  // (out, in)); null in a shape-only checkpoint. scale_name is the scale tensor's checkpoint name.
  const float* scales = nullptr;
  int64_t block_rows = 0, block_cols = 0;
  std::string scale_name;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  bool empty() const { return data == nullptr; }
  // Element i as float (any dtype).
  float at(int64_t i) const { return LoadAsFloat(data, dtype, static_cast<size_t>(i)); }
  bool quantized() const { return block_rows > 0; }
  // Scale blocks of a quantised weight (0 otherwise).
  int64_t num_scales() const {
    if (!quantized()) return 0;
    const int64_t out = shape.empty() ? 0 : shape[0], in = shape.size() > 1 ? shape[1] : 1;
    return ((out + block_rows - 1) / block_rows) * ((in + block_cols - 1) / block_cols);
  }
};

struct ExpertWeights {
  TensorView gate, up;  // [F, d]
  TensorView down;      // [d, F]
};

struct LayerWeights {
  TensorView input_norm, post_attn_norm;  // [d]
  TensorView q;                           // [H_l*D, d]
  TensorView k, v;                        // [K*D, d]
  TensorView o;                           // [d, H_l*D]
  TensorView g;                           // [H_l, d] per-head, [H_l*D, d] per-element
  TensorView q_norm, k_norm;              // [D]
  // Dense layers only:
  TensorView mlp_gate, mlp_up;  // [F_d, d]
  TensorView mlp_down;          // [d, F_d]
  // Sparse layers only:
  TensorView router;           // [E, d]
  TensorView correction_bias;  // [E]
  std::vector<ExpertWeights> experts;  // E entries
  ExpertWeights shared;                // gate/up [F_s, d], down [d, F_s]
  // Static FP8 KV-cache scales (self_attn.k_scale / v_scale), when the checkpoint ships them.
  std::optional<float> k_scale, v_scale;
};

struct ModelWeights {
  TensorView embed;       // [V, d]
  TensorView final_norm;  // [d]
  TensorView lm_head;     // [V, d]; the embedding when tie_word_embeddings
  std::vector<LayerWeights> layers;
};

class Checkpoint {
 public:
  // Reads DIR/config.json and DIR/model.safetensors or DIR/model.safetensors.index.json (+ shards).
  static Result<Checkpoint> Open(const std::string& dir);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  // Every tensor as stored (per-expert or fused names), in file order.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // The shard files (empty for a synthetic checkpoint).
  const std::vector<std::string>& files() const { return files_; }
  bool fused_experts() const { return fused_experts_; }
  // Total bytes of weight data.
  uint64_t weight_bytes() const;

  std::string dir;  // empty for a synthetic checkpoint

 private:
  friend Result<Checkpoint> MakeSyntheticCheckpoint(const ModelConfig&, uint64_t, DType, const Fp8Options*);
  friend Result<Checkpoint> MakeShapeOnlyCheckpoint(const ModelConfig&, const Fp8Options*);
  friend class CheckpointBuilder;
  Checkpoint();

  struct Storage;
  std::unique_ptr<Storage> storage_;  // mapped files or in-memory buffers the views point into
  ModelConfig config_;
  ModelWeights weights_;
  std::vector<TensorView> tensors_;
  std::vector<std::string> files_;
  bool fused_experts_ = false;
};

// The weights make-model would write for (config, seed, dtype[, fp8]), built in memory (per-expert
// layout), with the same values. dtype: BF16, F16 or F32 (the unquantised tensors). With `fp8`, the
// tensors its layout picks are FP8 codes + FP32 scales by the synthetic rule (model/synthetic.h) and
// the config carries the matching quantization_config.
Result<Checkpoint> MakeSyntheticCheckpoint(const ModelConfig& config, uint64_t seed, DType dtype,
                                           const Fp8Options* fp8 = nullptr);

// Names and shapes only (every view's data is null): for backends that generate the synthetic
// weights themselves, on the device (the CUDA `--shape` path), so a 67 GB model needs no host copy.
// With `fp8`, the views its layout picks say dtype kF8E4M3 with their block shape (scales null):
// the device generates codes and scales by the synthetic rule.
Result<Checkpoint> MakeShapeOnlyCheckpoint(const ModelConfig& config, const Fp8Options* fp8 = nullptr);

}  // namespace dl
