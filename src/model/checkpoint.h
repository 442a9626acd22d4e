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
// BF16 weights). Data pointers are only as aligned as the file makes them (PyTorch-written files
// align every tensor to its element size).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "model/config.h"

namespace dl {

struct TensorView {
  std::string name;  // checkpoint name; for fused slices "…gate_up_proj[e].gate" etc.
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  bool empty() const { return data == nullptr; }
  // Element i as float (any dtype).
  float at(int64_t i) const { return LoadAsFloat(data, dtype, static_cast<size_t>(i)); }
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
  friend Result<Checkpoint> MakeSyntheticCheckpoint(const ModelConfig&, uint64_t, DType);
  friend Result<Checkpoint> MakeShapeOnlyCheckpoint(const ModelConfig&);
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

// The weights make-model would write for (config, seed, dtype), built in memory (per-expert layout),
// with the same values. dtype: BF16, F16 or F32.
Result<Checkpoint> MakeSyntheticCheckpoint(const ModelConfig& config, uint64_t seed, DType dtype);

// Names and shapes only (every view's data is null): for backends that generate the synthetic
// weights themselves, on the device (the CUDA `--shape` path), so a 67 GB model needs no host copy.
Result<Checkpoint> MakeShapeOnlyCheckpoint(const ModelConfig& config);

}  // namespace dl
