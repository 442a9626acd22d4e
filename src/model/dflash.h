// DFlash drafter checkpoints (shared/design/dflash.md §1-2): config.json and safetensors of a block
// drafter that borrows the target's embedding and LM head, reads the target's hidden states after
// the layers `target_layer_ids`, fuses them (per-slice norms for Laguna drafters, fc, hidden_norm)
// and injects them as extra keys/values into every draft layer.
//
// Two families, told apart by `architectures`:
//   kZlab   "DFlashDraftModel" (z-lab Qwen3/LLaMA drafters): split q/k/v projections, no attention
//           gate, the context enters each layer without its input norm.
//   kLaguna "DFlashLagunaForCausalLM" (Poolside): fused qkv_proj, per-head softplus gate (g_proj),
//           aux_hidden_norms.i before fc, each layer's input_layernorm applied to the context (as
//           vLLM and SGLang do).
// Tensor names: an optional "model." prefix, layers numbered from 0 or from num_target_layers
// (newest vLLM exports), split or fused projections (never both in one layer), `midlayer.` as an
// alias of `layers.0.`. Every config key is either used, checked to a supported value or named in
// an error; DFlash2 checkpoints are refused.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "model/checkpoint.h"
#include "model/config.h"

namespace dl {

enum class DflashFamily : uint8_t { kZlab, kLaguna };
const char* DflashFamilyName(DflashFamily f);

struct DflashConfig {
  DflashFamily family = DflashFamily::kLaguna;
  std::string model_type = "laguna";
  int64_t hidden_size = 0;  // must equal the target's
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;  // draft layers
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  // The drafter's own RoPE (never the target's, §1.7): default (neox, half split) over the first
  // int(head_dim * partial_rotary_factor) dims.
  double rope_theta = 1e6;
  double partial_rotary_factor = 1.0;
  int64_t max_position_embeddings = 0;
  int64_t vocab_size = 0;  // draft_vocab_size for Laguna; must equal the target's vocabulary
  std::vector<LayerType> layer_types;  // per draft layer
  int64_t sliding_window = 0;          // keys visible including the query's own position
  std::vector<bool> block_causal;      // per draft layer: in-block causal (else bidirectional)
  bool per_head_gate = false;          // Laguna "gating": "per-head"
  bool context_input_norm = false;     // Laguna: input_layernorm_i(c) feeds K/V of the context
  bool aux_hidden_norms = false;       // Laguna: per-slice RMSNorm of the taps before fc
  int64_t block_size = 0;              // B
  int64_t mask_token_id = -1;
  int64_t num_target_layers = 0;        // 0 when the config does not say
  std::vector<int64_t> target_layer_ids;  // ascending; concatenated in this order
  // Keys accepted without effect at inference (initializer_range, token ids, ...), for `inspect`.
  std::vector<std::string> notes;

  int64_t num_taps() const { return static_cast<int64_t>(target_layer_ids.size()); }
  int64_t q_width() const { return num_attention_heads * head_dim; }
  int64_t kv_width() const { return num_key_value_heads * head_dim; }
  int64_t gate_width() const { return per_head_gate ? num_attention_heads : 0; }
  // q [H*D], k and v [K*D] each, then the gate [H] (Laguna).
  int64_t qkvg_width() const { return q_width() + 2 * kv_width() + gate_width(); }
  int64_t rotary_dim() const;

  static Result<DflashConfig> FromJson(const nlohmann::json& j);
  static Result<DflashConfig> FromFile(const std::string& path);
  // The config.json this drafter's family ships (transformers layout: dflash_config nested).
  nlohmann::json ToJson() const;
  // The pairing with a target: hidden size, vocabulary, tap ids within its layers, mask id.
  Status CheckTarget(const ModelConfig& target) const;
};

// z-lab's default tap rule when target_layer_ids is absent: one draft layer -> the middle target
// layer; n layers -> round(1 + i * (L - 4) / (n - 1)), i.e. spread over [1, L - 3].
std::vector<int64_t> DefaultTargetLayerIds(int64_t num_draft_layers, int64_t num_target_layers);

struct DflashLayerWeights {
  TensorView input_norm, post_attn_norm;  // [d]
  TensorView q, k, v;                     // [H*D, d], [K*D, d], [K*D, d] (slices of qkv_proj when fused)
  TensorView g;                           // [H, d] Laguna per-head gate; empty otherwise
  TensorView o;                           // [d, H*D]
  TensorView q_norm, k_norm;              // [D]
  TensorView gate, up;                    // [F, d] (slices of gate_up_proj when fused)
  TensorView down;                        // [d, F]
};

struct DflashWeights {
  TensorView fc;                         // [d, taps * d]
  TensorView hidden_norm;                // [d]
  TensorView norm;                       // [d] final norm before the target's LM head
  std::vector<TensorView> aux_norms;     // [taps] x [d] (Laguna)
  std::vector<DflashLayerWeights> layers;
};

// The tensor layout a drafter's safetensors uses (both load; make-model writes either).
enum class DflashLayout : uint8_t {
  kZlab,     // split q/k/v and gate/up, layers.i
  kPoolside  // fused qkv_proj and gate_up_proj, layers.i
};

class DflashCheckpoint {
 public:
  // Reads DIR/config.json and DIR/model.safetensors; every tensor checked against the config.
  static Result<DflashCheckpoint> Open(const std::string& dir);

  DflashCheckpoint(DflashCheckpoint&&) noexcept;
  DflashCheckpoint& operator=(DflashCheckpoint&&) noexcept;
  ~DflashCheckpoint();

  const DflashConfig& config() const { return config_; }
  const DflashWeights& weights() const { return weights_; }
  // How the file named its tensors (fused projections, layer numbering base, "model." prefix).
  bool fused_qkv() const { return fused_qkv_; }
  int64_t layer_base() const { return layer_base_; }
  std::string dir;

 private:
  DflashCheckpoint();
  struct Storage;
  std::unique_ptr<Storage> storage_;
  DflashConfig config_;
  DflashWeights weights_;
  bool fused_qkv_ = false;
  int64_t layer_base_ = 0;
};

// A random drafter matching `target` (hidden size, vocabulary, tap ids spread over its layers) for
// tests and `make-model --shape tiny-dflash` / `--dflash-for DIR`. Laguna family: the config Poolside
// ships (gating per head, all layers sliding with the target's window, causal blocks); z-lab family:
// no gate, the context without its layer norm, bidirectional full-attention blocks.
DflashConfig DflashConfigFor(const ModelConfig& target, int64_t num_draft_layers = 2, int64_t block_size = 8,
                             DflashFamily family = DflashFamily::kLaguna);

struct WriteDflashOptions {
  DflashConfig config;
  DflashLayout layout = DflashLayout::kPoolside;
  uint64_t seed = 0;
  std::string out_dir;  // must not exist or be empty
  // Tensor names start with "model." and layers count from num_target_layers (vLLM's export).
  bool vllm_names = false;
};
// Writes config.json and model.safetensors (BF16, values by the synthetic rule of model/synthetic.h
// under each tensor's name).
Status WriteSyntheticDflash(const WriteDflashOptions& options);

}  // namespace dl
