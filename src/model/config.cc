#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/file_util.h"
#include "model/json_read.h"

namespace dl {
namespace {

using nlohmann::json;

// Typed readers: a missing key keeps *out (the transformers 5.17.0 default); a present key of the
// wrong type is an error naming the key. Integers are range-checked where they are read (JsonInt).
Status ReadInt(const json& j, const char* key, int64_t* out, int64_t lo = 0,
               int64_t hi = kJsonInt32Max) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  return JsonInt(*it, key, lo, hi, out);
}

Status ReadDouble(const json& j, const char* key, double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number()) return InvalidArgument("key '{}' must be a number, got {}", key, ShowJson(*it));
  *out = it->get<double>();
  return Status::Ok();
}

Status ReadBool(const json& j, const char* key, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return InvalidArgument("key '{}' must be true or false, got {}", key, ShowJson(*it));
  *out = it->get<bool>();
  return Status::Ok();
}

Status ReadString(const json& j, const char* key, std::string* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_string()) return InvalidArgument("key '{}' must be a string, got {}", key, ShowJson(*it));
  *out = it->get<std::string>();
  return Status::Ok();
}

const char* LayerTypeName(LayerType t) {
  return t == LayerType::kSliding ? "sliding_attention" : "full_attention";
}

// transformers' get_mscale: 0.1 * m * ln(s) + 1, or 1 when s <= 1.
double YarnMscale(double scale, double m) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * m * std::log(scale) + 1.0;
}

// Parses one nested rope_parameters entry. `top_partial` is the config's top-level
// partial_rotary_factor (copied into entries lacking one when any entry is YaRN; §2).
Status ParseRopeEntry(const json& e, const std::string& type, int64_t max_pos, RopeParams* p,
                      bool* has_partial) {
  auto ctx = [&](const Status& s) { return s.WithContext("rope_parameters." + type); };
  if (!e.is_object()) return InvalidArgument("rope_parameters.{} must be an object, got {}", type, ShowJson(e));
  std::string rope_type = "default";
  if (e.contains("rope_type")) {
    DL_RETURN_IF_ERROR(ctx(ReadString(e, "rope_type", &rope_type)));
  } else if (e.contains("type")) {
    DL_RETURN_IF_ERROR(ctx(ReadString(e, "type", &rope_type)));
  }
  if (rope_type != "default" && rope_type != "yarn") {
    return Unimplemented("rope_parameters.{}: rope_type '{}' is not supported (only 'default' and 'yarn')",
                         type, rope_type);
  }
  p->rope_type = rope_type;
  if (!e.contains("rope_theta")) return InvalidArgument("rope_parameters.{} has no 'rope_theta'", type);
  DL_RETURN_IF_ERROR(ctx(ReadDouble(e, "rope_theta", &p->theta)));
  if (!(p->theta > 1.0)) return InvalidArgument("rope_parameters.{}.rope_theta must be > 1, got {}", type, p->theta);
  *has_partial = e.contains("partial_rotary_factor") && !e["partial_rotary_factor"].is_null();
  p->partial_rotary_factor = 1.0;
  DL_RETURN_IF_ERROR(ctx(ReadDouble(e, "partial_rotary_factor", &p->partial_rotary_factor)));
  p->attention_factor = 1.0;
  p->factor = 1.0;
  if (rope_type == "yarn") {
    if (!e.contains("original_max_position_embeddings") || e["original_max_position_embeddings"].is_null()) {
      return InvalidArgument(
          "rope_parameters.{} is YaRN but has no 'original_max_position_embeddings' (transformers "
          "5.17.0 requires it inside the entry)",
          type);
    }
    DL_RETURN_IF_ERROR(ctx(ReadInt(e, "original_max_position_embeddings", &p->original_max_position_embeddings)));
    if (p->original_max_position_embeddings <= 0) {
      return InvalidArgument("rope_parameters.{}.original_max_position_embeddings must be > 0", type);
    }
    if (!e.contains("factor") || e["factor"].is_null()) {
      // 5.17.0: a null factor falls back to max_position_embeddings / original.
      p->factor = static_cast<double>(max_pos) / static_cast<double>(p->original_max_position_embeddings);
    } else {
      DL_RETURN_IF_ERROR(ctx(ReadDouble(e, "factor", &p->factor)));
    }
    if (!(p->factor > 0.0)) return InvalidArgument("rope_parameters.{}.factor must be > 0", type);
    // `beta_fast or 32`: absent, null and zero all mean the default.
    p->beta_fast = 0.0;
    p->beta_slow = 0.0;
    DL_RETURN_IF_ERROR(ctx(ReadDouble(e, "beta_fast", &p->beta_fast)));
    DL_RETURN_IF_ERROR(ctx(ReadDouble(e, "beta_slow", &p->beta_slow)));
    if (p->beta_fast == 0.0) p->beta_fast = 32.0;
    if (p->beta_slow == 0.0) p->beta_slow = 1.0;
    if (e.contains("attention_factor") && !e["attention_factor"].is_null()) {
      DL_RETURN_IF_ERROR(ctx(ReadDouble(e, "attention_factor", &p->attention_factor)));
    } else {
      double mscale = 0.0, mscale_all_dim = 0.0;
      DL_RETURN_IF_ERROR(ctx(ReadDouble(e, "mscale", &mscale)));
      DL_RETURN_IF_ERROR(ctx(ReadDouble(e, "mscale_all_dim", &mscale_all_dim)));
      if (mscale != 0.0 && mscale_all_dim != 0.0) {
        p->attention_factor = YarnMscale(p->factor, mscale) / YarnMscale(p->factor, mscale_all_dim);
      } else {
        p->attention_factor = YarnMscale(p->factor, 1.0);
      }
    }
  }
  return Status::Ok();
}

Status ValidateRotary(const RopeParams& p, const std::string& type, int64_t head_dim) {
  const int64_t r = static_cast<int64_t>(static_cast<double>(head_dim) * p.partial_rotary_factor);
  if (!(p.partial_rotary_factor > 0.0 && p.partial_rotary_factor <= 1.0) || r < 2 || r % 2 != 0) {
    return InvalidArgument(
        "rope_parameters.{}.partial_rotary_factor {} gives {} rotated dims of head_dim {}; need an even "
        "number in [2, head_dim]",
        type, p.partial_rotary_factor, r, head_dim);
  }
  return Status::Ok();
}

Status CheckPositive(const char* key, int64_t v) {
  if (v <= 0) return InvalidArgument("key '{}' must be > 0, got {}", key, v);
  return Status::Ok();
}

Status FromJsonImpl(const json& j, ModelConfig* c) {
  if (!j.is_object()) return InvalidArgument("config must be a JSON object");
  std::string model_type;
  DL_RETURN_IF_ERROR(ReadString(j, "model_type", &model_type));
  if (!model_type.empty() && model_type != "laguna") {
    return Unimplemented("model_type '{}' is not supported (only 'laguna')", model_type);
  }
  // transformers 5.17.0 LagunaConfig defaults for absent keys.
  c->vocab_size = 100352;
  c->hidden_size = 2048;
  c->intermediate_size = 8192;
  c->num_hidden_layers = 40;
  c->num_attention_heads = 48;
  c->num_key_value_heads = 8;
  c->head_dim = 128;
  c->sliding_window = 512;
  c->max_position_embeddings = 131072;
  c->num_experts = 256;
  c->num_experts_per_tok = 8;
  c->moe_intermediate_size = 512;
  c->shared_expert_intermediate_size = 512;
  c->moe_routed_scaling_factor = 1.0;
  c->moe_router_logit_softcapping = 0.0;
  DL_RETURN_IF_ERROR(ReadInt(j, "vocab_size", &c->vocab_size));
  DL_RETURN_IF_ERROR(ReadInt(j, "hidden_size", &c->hidden_size));
  DL_RETURN_IF_ERROR(ReadInt(j, "intermediate_size", &c->intermediate_size));
  DL_RETURN_IF_ERROR(ReadInt(j, "num_hidden_layers", &c->num_hidden_layers));
  DL_RETURN_IF_ERROR(ReadInt(j, "num_attention_heads", &c->num_attention_heads));
  DL_RETURN_IF_ERROR(ReadInt(j, "num_key_value_heads", &c->num_key_value_heads));
  DL_RETURN_IF_ERROR(ReadInt(j, "head_dim", &c->head_dim));
  DL_RETURN_IF_ERROR(ReadString(j, "hidden_act", &c->hidden_act));
  DL_RETURN_IF_ERROR(ReadDouble(j, "rms_norm_eps", &c->rms_norm_eps));
  DL_RETURN_IF_ERROR(ReadBool(j, "attention_bias", &c->attention_bias));
  DL_RETURN_IF_ERROR(ReadBool(j, "tie_word_embeddings", &c->tie_word_embeddings));
  DL_RETURN_IF_ERROR(ReadInt(j, "max_position_embeddings", &c->max_position_embeddings));
  DL_RETURN_IF_ERROR(ReadInt(j, "sliding_window", &c->sliding_window));
  DL_RETURN_IF_ERROR(ReadInt(j, "num_experts", &c->num_experts));
  DL_RETURN_IF_ERROR(ReadInt(j, "num_experts_per_tok", &c->num_experts_per_tok));
  DL_RETURN_IF_ERROR(ReadInt(j, "moe_intermediate_size", &c->moe_intermediate_size));
  DL_RETURN_IF_ERROR(ReadInt(j, "shared_expert_intermediate_size", &c->shared_expert_intermediate_size));
  DL_RETURN_IF_ERROR(ReadDouble(j, "moe_routed_scaling_factor", &c->moe_routed_scaling_factor));
  DL_RETURN_IF_ERROR(ReadDouble(j, "moe_router_logit_softcapping", &c->moe_router_logit_softcapping));
  DL_RETURN_IF_ERROR(ReadInt(j, "bos_token_id", &c->bos_token_id, -1));
  DL_RETURN_IF_ERROR(ReadInt(j, "pad_token_id", &c->pad_token_id, -1));
  if (!j.contains("moe_routed_scaling_factor")) {
    c->warnings.push_back("moe_routed_scaling_factor absent: using the transformers default 1.0");
  }

  DL_RETURN_IF_ERROR(CheckPositive("vocab_size", c->vocab_size));
  DL_RETURN_IF_ERROR(CheckPositive("hidden_size", c->hidden_size));
  DL_RETURN_IF_ERROR(CheckPositive("num_hidden_layers", c->num_hidden_layers));
  DL_RETURN_IF_ERROR(CheckPositive("num_attention_heads", c->num_attention_heads));
  DL_RETURN_IF_ERROR(CheckPositive("num_key_value_heads", c->num_key_value_heads));
  DL_RETURN_IF_ERROR(CheckPositive("head_dim", c->head_dim));
  DL_RETURN_IF_ERROR(CheckPositive("max_position_embeddings", c->max_position_embeddings));
  if (c->num_hidden_layers > 100000) return InvalidArgument("num_hidden_layers {} is absurd", c->num_hidden_layers);
  if (!(c->rms_norm_eps > 0.0)) return InvalidArgument("rms_norm_eps must be > 0, got {}", c->rms_norm_eps);
  if (c->hidden_act != "silu") {
    return Unimplemented("hidden_act '{}' is not supported (only 'silu')", c->hidden_act);
  }
  if (c->attention_bias) return Unimplemented("attention_bias = true is not supported");
  bool on_input = false;
  DL_RETURN_IF_ERROR(ReadBool(j, "moe_apply_router_weight_on_input", &on_input));
  if (on_input) {
    return Unimplemented("moe_apply_router_weight_on_input = true is not supported (transformers raises too)");
  }
  if (c->moe_router_logit_softcapping < 0.0) {
    return InvalidArgument("moe_router_logit_softcapping must be >= 0, got {}", c->moe_router_logit_softcapping);
  }

  // eos_token_id: an integer or a list of integers.
  c->eos_token_ids.clear();
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_number_integer()) {
      int64_t id = 0;
      DL_RETURN_IF_ERROR(JsonInt(*it, "eos_token_id", 0, kJsonInt32Max, &id));
      c->eos_token_ids.push_back(id);
    } else if (it->is_array()) {
      for (const auto& v : *it) {
        if (!v.is_number_integer()) return InvalidArgument("eos_token_id entries must be integers, got {}", ShowJson(v));
        int64_t id = 0;
        DL_RETURN_IF_ERROR(JsonInt(v, "eos_token_id", 0, kJsonInt32Max, &id));
        c->eos_token_ids.push_back(id);
      }
    } else {
      return InvalidArgument("eos_token_id must be an integer or a list, got {}", ShowJson(*it));
    }
  }

  // dtype (transformers 5) or legacy torch_dtype.
  c->dtype = "bfloat16";
  if (j.contains("dtype") && !j["dtype"].is_null()) {
    DL_RETURN_IF_ERROR(ReadString(j, "dtype", &c->dtype));
  } else if (j.contains("torch_dtype") && !j["torch_dtype"].is_null()) {
    DL_RETURN_IF_ERROR(ReadString(j, "torch_dtype", &c->dtype));
  }

  const int64_t L = c->num_hidden_layers;
  // Per-layer heads.
  c->num_attention_heads_per_layer.assign(L, c->num_attention_heads);
  if (auto it = j.find("num_attention_heads_per_layer"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidArgument("num_attention_heads_per_layer must be a list, got {}", ShowJson(*it));
    if (static_cast<int64_t>(it->size()) != L) {
      return InvalidArgument("num_attention_heads_per_layer has {} entries, num_hidden_layers is {}", it->size(), L);
    }
    for (int64_t l = 0; l < L; ++l) {
      const json& v = (*it)[l];
      if (!v.is_number_integer()) {
        return InvalidArgument("num_attention_heads_per_layer[{}] must be a positive integer, got {}", l, ShowJson(v));
      }
      DL_RETURN_IF_ERROR(JsonInt(v, fmt::format("num_attention_heads_per_layer[{}]", l), 1,
                                    kJsonInt32Max, &c->num_attention_heads_per_layer[l]));
    }
  } else {
    c->warnings.push_back(fmt::format(
        "num_attention_heads_per_layer absent: every layer gets num_attention_heads = {}", c->num_attention_heads));
  }
  for (int64_t l = 0; l < L; ++l) {
    if (c->num_attention_heads_per_layer[l] % c->num_key_value_heads != 0) {
      return InvalidArgument("layer {}: {} query heads is not a multiple of num_key_value_heads {}", l,
                             c->num_attention_heads_per_layer[l], c->num_key_value_heads);
    }
  }

  // Layer types.
  c->layer_types.assign(L, LayerType::kFull);
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidArgument("layer_types must be a list, got {}", ShowJson(*it));
    if (static_cast<int64_t>(it->size()) != L) {
      return InvalidArgument("layer_types has {} entries, num_hidden_layers is {}", it->size(), L);
    }
    for (int64_t l = 0; l < L; ++l) {
      const json& v = (*it)[l];
      if (v == "full_attention") {
        c->layer_types[l] = LayerType::kFull;
      } else if (v == "sliding_attention") {
        c->layer_types[l] = LayerType::kSliding;
      } else {
        return InvalidArgument(
            "layer_types[{}] is {}; only \"full_attention\" and \"sliding_attention\" are valid", l, ShowJson(v));
      }
    }
  } else {
    c->warnings.push_back("layer_types absent: every layer is full attention (transformers default)");
  }
  bool any_sliding = false, any_full = false;
  for (auto t : c->layer_types) (t == LayerType::kSliding ? any_sliding : any_full) = true;
  if (any_sliding) DL_RETURN_IF_ERROR(CheckPositive("sliding_window", c->sliding_window));

  // MLP types.
  c->mlp_layer_types.assign(L, MlpType::kSparse);
  c->mlp_layer_types[0] = MlpType::kDense;
  if (auto it = j.find("mlp_layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidArgument("mlp_layer_types must be a list, got {}", ShowJson(*it));
    if (static_cast<int64_t>(it->size()) != L) {
      return InvalidArgument("mlp_layer_types has {} entries, num_hidden_layers is {}", it->size(), L);
    }
    for (int64_t l = 0; l < L; ++l) {
      const json& v = (*it)[l];
      if (v == "dense") {
        c->mlp_layer_types[l] = MlpType::kDense;
      } else if (v == "sparse") {
        c->mlp_layer_types[l] = MlpType::kSparse;
      } else {
        return InvalidArgument("mlp_layer_types[{}] is {}; only \"dense\" and \"sparse\" are valid", l, ShowJson(v));
      }
    }
  } else {
    c->warnings.push_back("mlp_layer_types absent: layer 0 dense, the rest sparse (transformers default)");
  }
  bool any_dense = false, any_sparse = false;
  for (auto t : c->mlp_layer_types) (t == MlpType::kSparse ? any_sparse : any_dense) = true;
  if (any_dense) DL_RETURN_IF_ERROR(CheckPositive("intermediate_size", c->intermediate_size));
  if (any_sparse) {
    DL_RETURN_IF_ERROR(CheckPositive("num_experts", c->num_experts));
    DL_RETURN_IF_ERROR(CheckPositive("num_experts_per_tok", c->num_experts_per_tok));
    DL_RETURN_IF_ERROR(CheckPositive("moe_intermediate_size", c->moe_intermediate_size));
    DL_RETURN_IF_ERROR(CheckPositive("shared_expert_intermediate_size", c->shared_expert_intermediate_size));
    if (c->num_experts_per_tok > c->num_experts) {
      return InvalidArgument("num_experts_per_tok {} exceeds num_experts {}", c->num_experts_per_tok, c->num_experts);
    }
  }

  // Gating: true / "per-head" -> per head, "per-element" -> per element. transformers silently
  // turns every other value into per-element gating; we refuse it.
  if (auto it = j.find("gating"); it != j.end() && !it->is_null()) {
    if (*it == true || *it == "per-head") {
      c->gating = GatingKind::kPerHead;
    } else if (*it == "per-element") {
      c->gating = GatingKind::kPerElement;
    } else {
      return InvalidArgument(
          "gating is {}; valid values are true, \"per-head\" and \"per-element\" (transformers would "
          "silently use per-element gating for this value)",
          ShowJson(*it));
    }
  } else {
    c->gating = GatingKind::kPerHead;
  }

  // RoPE, nested by layer type.
  c->rope_full = RopeParams{};
  c->rope_full.theta = 500000.0;
  c->rope_full.partial_rotary_factor = 0.5;
  c->rope_sliding = RopeParams{};
  c->rope_sliding.theta = 10000.0;
  c->rope_sliding.partial_rotary_factor = 1.0;
  if (auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    const json& rp = *it;
    if (!rp.is_object()) return InvalidArgument("rope_parameters must be an object, got {}", ShowJson(rp));
    if (rp.contains("rope_type") || rp.contains("rope_theta")) {
      return InvalidArgument(
          "rope_parameters is flat (has 'rope_type'/'rope_theta' at the top level); Laguna needs one "
          "entry per layer type: {{\"full_attention\": {{...}}, \"sliding_attention\": {{...}}}}");
    }
    bool has_partial_full = false, has_partial_sliding = false;
    bool have_full = false, have_sliding = false;
    for (auto e = rp.begin(); e != rp.end(); ++e) {
      const std::string& key = e.key();
      if (key == "full_attention") {
        DL_RETURN_IF_ERROR(ParseRopeEntry(*e, key, c->max_position_embeddings, &c->rope_full, &has_partial_full));
        have_full = true;
      } else if (key == "sliding_attention") {
        DL_RETURN_IF_ERROR(
            ParseRopeEntry(*e, key, c->max_position_embeddings, &c->rope_sliding, &has_partial_sliding));
        have_sliding = true;
      } else if (key == "original_max_position_embeddings" && !e->is_object()) {
        // The duplicate some Poolside configs carry beside the nested entries; transformers 5.17.0
        // rejects it, the RoPE math never uses it. Accept and ignore.
      } else if (e->is_object()) {
        return InvalidArgument("rope_parameters has an entry for unknown layer type '{}'", key);
      } else {
        return InvalidArgument("rope_parameters has an unsupported top-level key '{}' = {}", key, ShowJson(*e));
      }
    }
    if (any_full && !have_full) return InvalidArgument("rope_parameters has no 'full_attention' entry");
    if (any_sliding && !have_sliding) return InvalidArgument("rope_parameters has no 'sliding_attention' entry");
    // When a YaRN entry exists, 5.17.0 copies a top-level partial_rotary_factor into entries that
    // lack their own (§2).
    const bool any_yarn = (have_full && c->rope_full.rope_type == "yarn") ||
                          (have_sliding && c->rope_sliding.rope_type == "yarn");
    if (any_yarn && j.contains("partial_rotary_factor") && !j["partial_rotary_factor"].is_null()) {
      double top = 1.0;
      DL_RETURN_IF_ERROR(ReadDouble(j, "partial_rotary_factor", &top));
      if (have_full && !has_partial_full) c->rope_full.partial_rotary_factor = top;
      if (have_sliding && !has_partial_sliding) c->rope_sliding.partial_rotary_factor = top;
    }
  } else {
    c->warnings.push_back(
        "rope_parameters absent: full layers default RoPE theta 5e5 over half the dims, sliding layers "
        "theta 1e4 (transformers defaults, no YaRN)");
  }
  if (any_full) DL_RETURN_IF_ERROR(ValidateRotary(c->rope_full, "full_attention", c->head_dim));
  if (any_sliding) DL_RETURN_IF_ERROR(ValidateRotary(c->rope_sliding, "sliding_attention", c->head_dim));

  // Quantisation: validated here (model/quantization.cc); Checkpoint::Open reads the scales.
  c->has_quantization_config = false;
  c->quantizes_weights = false;
  c->quant_method.clear();
  c->weight_quant = WeightQuantization{};
  c->quantization_config = nullptr;
  if (auto it = j.find("quantization_config"); it != j.end() && !it->is_null()) {
    c->has_quantization_config = true;
    DL_RETURN_IF_ERROR(ParseQuantizationConfig(*it, &c->weight_quant, &c->quant_method, &c->quantizes_weights));
    c->quantization_config = *it;
  }
  return Status::Ok();
}

// Every key a transformers 5.17.0 LagunaConfig reads or writes, and the keys Poolside configs carry
// for other engines that 5.17.0 ignores (laguna-architecture.md §2); anything else is listed in a
// warning at load.
constexpr const char* kKnownKeys[] = {
    // Read above.
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "attention_bias", "tie_word_embeddings", "max_position_embeddings", "sliding_window",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "moe_routed_scaling_factor", "moe_router_logit_softcapping", "bos_token_id", "pad_token_id",
    "eos_token_id", "moe_apply_router_weight_on_input", "dtype", "torch_dtype",
    "num_attention_heads_per_layer", "layer_types", "mlp_layer_types", "gating", "rope_parameters",
    "partial_rotary_factor", "quantization_config", "moe_router_score_func",
    // Written by save_pretrained; no effect on inference.
    "architectures", "attention_dropout", "use_cache", "transformers_version", "initializer_range",
    "router_aux_loss_coef", "output_router_logits", "_name_or_path",
    // Carried for other engines; 5.17.0 ignores them and so does decodelab.
    "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "qkv_bias", "gating_types",
    "swa_attention_sink_enabled", "swa_rope_parameters", "auto_map",
};

// Keys of older config formats that would change the model if honoured: refused, never dropped.
Status CheckLegacyKeys(const json& j) {
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    return InvalidArgument(
        "config.json has the legacy key 'rope_scaling' = {}. Laguna's RoPE is configured per layer "
        "type in 'rope_parameters' ({{\"full_attention\": {{...}}, \"sliding_attention\": {{...}}}}); "
        "running without this scaling would silently lose YaRN, and which layer types it applies to "
        "cannot be guessed. Move it into the rope_parameters entries (rope_type, factor, "
        "original_max_position_embeddings, ...) and remove 'rope_scaling'",
        ShowJson(*it));
  }
  if (auto it = j.find("moe_router_score_func"); it != j.end() && !it->is_null() && *it != "sigmoid") {
    return Unimplemented("moe_router_score_func {} is not supported (only \"sigmoid\", the Laguna router)",
                         ShowJson(*it));
  }
  return Status::Ok();
}

}  // namespace

int64_t ModelConfig::rotary_dim(int64_t layer) const {
  return static_cast<int64_t>(static_cast<double>(head_dim) * rope(layer).partial_rotary_factor);
}

Result<ModelConfig> ModelConfig::FromJson(const nlohmann::json& j) {
  ModelConfig c;
  try {
    Status s = FromJsonImpl(j, &c);
    if (!s.ok()) return s;
    DL_RETURN_IF_ERROR(CheckLegacyKeys(j));
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (std::find(std::begin(kKnownKeys), std::end(kKnownKeys), it.key()) == std::end(kKnownKeys)) {
        c.warnings.push_back(fmt::format("unknown key '{}' = {} ignored (not a Laguna config key)",
                                         it.key(), ShowJson(*it)));
      }
    }
  } catch (const std::exception& e) {
    return InvalidArgument("malformed config: {}", e.what());
  }
  return c;
}

Result<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  DL_ASSIGN_OR_RETURN(const json j, ReadJsonFile(path, kMaxConfigFileBytes));
  auto r = FromJson(j);
  if (!r.ok()) return r.status().WithContext(path);
  // generation_config.json beside it: its eos ids stop generation too (Laguna's adds 24,
  // </assistant>), and its sampling values are the request defaults.
  const auto gen_path = std::filesystem::path(path).parent_path() / "generation_config.json";
  auto gen = GenerationConfig::FromFile(gen_path.string());
  if (gen.ok()) {
    for (int64_t id : gen->eos_token_ids) {
      if (std::find(r->eos_token_ids.begin(), r->eos_token_ids.end(), id) == r->eos_token_ids.end()) {
        r->eos_token_ids.push_back(id);
      }
    }
    for (const auto& w : gen->warnings) r->warnings.push_back(w);
    r->generation = std::move(gen).value();
  } else if (gen.status().code() != StatusCode::kNotFound) {
    return gen.status();
  }
  return r;
}

nlohmann::json ModelConfig::ToJson() const {
  json j;
  j["architectures"] = {"LagunaForCausalLM"};
  j["model_type"] = "laguna";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_attention_heads_per_layer"] = num_attention_heads_per_layer;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = hidden_act;
  j["rms_norm_eps"] = rms_norm_eps;
  j["attention_bias"] = attention_bias;
  j["attention_dropout"] = 0.0;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["max_position_embeddings"] = max_position_embeddings;
  json lt = json::array();
  for (auto t : layer_types) lt.push_back(LayerTypeName(t));
  j["layer_types"] = lt;
  j["sliding_window"] = sliding_window;
  auto rope_json = [](const RopeParams& p) {
    json e;
    e["rope_type"] = p.rope_type;
    e["rope_theta"] = p.theta;
    e["partial_rotary_factor"] = p.partial_rotary_factor;
    if (p.rope_type == "yarn") {
      e["factor"] = p.factor;
      e["original_max_position_embeddings"] = p.original_max_position_embeddings;
      e["beta_fast"] = p.beta_fast;
      e["beta_slow"] = p.beta_slow;
      e["attention_factor"] = p.attention_factor;
    }
    return e;
  };
  bool any_sliding = false, any_full = false;
  for (auto t : layer_types) (t == LayerType::kSliding ? any_sliding : any_full) = true;
  json rp = json::object();
  if (any_full) rp["full_attention"] = rope_json(rope_full);
  if (any_sliding) rp["sliding_attention"] = rope_json(rope_sliding);
  j["rope_parameters"] = rp;
  if (gating == GatingKind::kPerHead) {
    j["gating"] = true;
  } else {
    j["gating"] = "per-element";
  }
  json mt = json::array();
  for (auto t : mlp_layer_types) mt.push_back(t == MlpType::kSparse ? "sparse" : "dense");
  j["mlp_layer_types"] = mt;
  j["num_experts"] = num_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
  j["moe_routed_scaling_factor"] = moe_routed_scaling_factor;
  j["moe_router_logit_softcapping"] = moe_router_logit_softcapping;
  j["moe_apply_router_weight_on_input"] = false;
  j["router_aux_loss_coef"] = 0.0;
  j["output_router_logits"] = false;
  j["initializer_range"] = 0.02;
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else if (!eos_token_ids.empty()) {
    j["eos_token_id"] = eos_token_ids;
  }
  if (pad_token_id >= 0) j["pad_token_id"] = pad_token_id;
  j["dtype"] = dtype;
  if (has_quantization_config) j["quantization_config"] = quantization_config;
  j["use_cache"] = true;
  j["transformers_version"] = "5.17.0";
  return j;
}

// Mirrors transformers' FP32 computation step by step (modeling_rope_utils, 5.17.0): exponents
// arange(0, R, 2) / R in FP32, base ** exponent in FP32, reciprocal; YaRN blends the extrapolated
// and interpolated tables with the FP32 ramp. This file is compiled with -ffp-contract=off so no
// step is fused into an FMA the reference does not do.
RopeTable ComputeRopeTable(const RopeParams& p, int64_t head_dim) {
  RopeTable t;
  const int64_t r = static_cast<int64_t>(static_cast<double>(head_dim) * p.partial_rotary_factor);
  t.rotary_dim = r;
  const int64_t half = r / 2;
  t.inv_freq.resize(half);
  const float base = static_cast<float>(p.theta);
  std::vector<float> pos_freqs(half);
  for (int64_t j = 0; j < half; ++j) {
    const float e = static_cast<float>(2 * j) / static_cast<float>(r);
    pos_freqs[j] = std::pow(base, e);
  }
  if (p.rope_type != "yarn") {
    for (int64_t j = 0; j < half; ++j) t.inv_freq[j] = 1.0f / pos_freqs[j];
    t.attention_factor = 1.0f;
    return t;
  }
  const double b = p.theta;
  const double o = static_cast<double>(p.original_max_position_embeddings);
  auto correction_dim = [&](double n) {
    return (static_cast<double>(r) * std::log(o / (n * 2.0 * M_PI))) / (2.0 * std::log(b));
  };
  // Truncation (floor/ceil) is always on for Laguna in 5.17.0 (§3.4).
  double lo = std::floor(correction_dim(p.beta_fast));
  double hi = std::ceil(correction_dim(p.beta_slow));
  lo = std::max(lo, 0.0);
  hi = std::min(hi, static_cast<double>(r - 1));
  if (lo == hi) hi += 0.001;
  t.yarn_low = lo;
  t.yarn_high = hi;
  const float lo_f = static_cast<float>(lo);
  const float span_f = static_cast<float>(hi - lo);
  const float factor = static_cast<float>(p.factor);
  for (int64_t j = 0; j < half; ++j) {
    float ramp = (static_cast<float>(j) - lo_f) / span_f;
    ramp = std::min(std::max(ramp, 0.0f), 1.0f);
    const float extrap_factor = 1.0f - ramp;
    const float extrap = 1.0f / pos_freqs[j];
    const float interp = 1.0f / (factor * pos_freqs[j]);
    t.inv_freq[j] = interp * (1.0f - extrap_factor) + extrap * extrap_factor;
  }
  t.attention_factor = static_cast<float>(p.attention_factor);
  return t;
}

}  // namespace dl
