// The Laguna configuration, read from a Hugging Face config.json with every key of the spec
// (shared/design/laguna-architecture.md §2). Values are never defaulted silently where the reference's
// defaults are traps (§9.15): what the file does not say, we take from transformers 5.17.0's
// LagunaConfig defaults, and unknown strings are rejected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "model/generation_config.h"
#include "model/quantization.h"

namespace dl {

enum class LayerType : uint8_t { kFull, kSliding };
enum class MlpType : uint8_t { kDense, kSparse };
enum class GatingKind : uint8_t { kPerHead, kPerElement };

// RoPE parameters of one layer type (the nested `rope_parameters[type]` entry).
struct RopeParams {
  std::string rope_type = "default";  // "default" or "yarn"
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;
  // YaRN only:
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // The cos/sin multiplier m; for YaRN without an explicit value, 0.1 ln(factor) + 1.
  double attention_factor = 1.0;
};

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // d
  int64_t intermediate_size = 0;  // F_d, dense SwiGLU width
  int64_t num_hidden_layers = 0;  // L
  int64_t num_attention_heads = 0;
  std::vector<int64_t> num_attention_heads_per_layer;  // H_l, size L
  int64_t num_key_value_heads = 0;                     // K
  int64_t head_dim = 0;                                // D
  std::string hidden_act = "silu";
  double rms_norm_eps = 1e-6;
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  std::vector<LayerType> layer_types;  // size L
  int64_t sliding_window = 0;          // W: keys visible including the current one
  RopeParams rope_full;
  RopeParams rope_sliding;
  GatingKind gating = GatingKind::kPerHead;
  std::vector<MlpType> mlp_layer_types;  // size L
  int64_t num_experts = 0;               // E
  int64_t num_experts_per_tok = 0;       // k
  int64_t moe_intermediate_size = 0;     // F_e
  int64_t shared_expert_intermediate_size = 0;  // F_s
  double moe_routed_scaling_factor = 1.0;       // alpha
  double moe_router_logit_softcapping = 0.0;    // c (0 = off)
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  int64_t pad_token_id = -1;
  std::string dtype = "bfloat16";  // `dtype` or legacy `torch_dtype`

  // `quantization_config` (model/quantization.h): every key checked when read, the object kept as
  // read so ToJson writes it back unchanged.
  bool has_quantization_config = false;
  std::string quant_method;
  // True unless the quantization_config only describes the KV cache (compressed-tensors with a
  // kv_cache_scheme and no weight config_groups).
  bool quantizes_weights = false;
  WeightQuantization weight_quant;     // format kNone unless the weights are FP8
  nlohmann::json quantization_config;  // null when absent

  // Trap keys that were absent and took the transformers default (§9.15), unknown keys, and
  // generation_config.json keys not used; shown by `inspect` and logged when an engine loads.
  std::vector<std::string> warnings;
  // generation_config.json beside config.json (FromFile only); its eos ids are already merged into
  // eos_token_ids.
  GenerationConfig generation;

  // Derived helpers.
  int64_t heads(int64_t layer) const { return num_attention_heads_per_layer[layer]; }
  bool is_sliding(int64_t layer) const { return layer_types[layer] == LayerType::kSliding; }
  bool is_sparse(int64_t layer) const { return mlp_layer_types[layer] == MlpType::kSparse; }
  const RopeParams& rope(int64_t layer) const { return is_sliding(layer) ? rope_sliding : rope_full; }
  // Rotated dims per head, R = int(D * partial_rotary_factor).
  int64_t rotary_dim(int64_t layer) const;
  // Gate outputs per layer: H (per-head) or H*D (per-element).
  int64_t gate_width(int64_t layer) const {
    return gating == GatingKind::kPerHead ? heads(layer) : heads(layer) * head_dim;
  }
  // Width of the fused q/k/v/g projection's output: q [H*D], k and v [K*D] each, the gate.
  int64_t qkvg_width(int64_t layer) const {
    return (heads(layer) + 2 * num_key_value_heads) * head_dim + gate_width(layer);
  }

  static Result<ModelConfig> FromJson(const nlohmann::json& j);
  static Result<ModelConfig> FromFile(const std::string& path);
  // The config.json transformers' save_pretrained would write for this config.
  nlohmann::json ToJson() const;
};

// RoPE inverse frequencies f_j (j < R/2) of one layer type, computed in FP32 as transformers does
// (YaRN ramp with floor/ceil truncation, §3.4), plus the attention factor m.
struct RopeTable {
  int64_t rotary_dim = 0;
  std::vector<float> inv_freq;  // [R/2]
  float attention_factor = 1.0f;
  // YaRN correction range after floor/ceil and clamping (0 for default RoPE).
  double yarn_low = 0.0, yarn_high = 0.0;
};
RopeTable ComputeRopeTable(const RopeParams& p, int64_t head_dim);

}  // namespace dl
