#include "model/shapes.h"

#include <cmath>

namespace dl {
namespace {

// The period-4 hybrid schedule of XS.2 and S 2.1: full attention at l % 4 == 0.
void FillHybrid(ModelConfig* c, int64_t heads_full, int64_t heads_sliding) {
  const int64_t L = c->num_hidden_layers;
  c->layer_types.resize(L);
  c->num_attention_heads_per_layer.resize(L);
  c->mlp_layer_types.assign(L, MlpType::kSparse);
  c->mlp_layer_types[0] = MlpType::kDense;
  for (int64_t l = 0; l < L; ++l) {
    const bool full = l % 4 == 0;
    c->layer_types[l] = full ? LayerType::kFull : LayerType::kSliding;
    c->num_attention_heads_per_layer[l] = full ? heads_full : heads_sliding;
  }
}

void CommonLaguna(ModelConfig* c) {
  c->vocab_size = 100352;
  c->num_key_value_heads = 8;
  c->head_dim = 128;
  c->hidden_act = "silu";
  c->rms_norm_eps = 1e-6;
  c->sliding_window = 512;
  c->num_experts = 256;
  c->moe_routed_scaling_factor = 2.5;
  c->moe_router_logit_softcapping = 0.0;
  c->bos_token_id = 2;
  c->eos_token_ids = {2, 24};
  c->pad_token_id = 9;
  c->rope_sliding = RopeParams{};
  c->rope_sliding.rope_type = "default";
  c->rope_sliding.theta = 10000.0;
  c->rope_sliding.partial_rotary_factor = 1.0;
  c->rope_full = RopeParams{};
  c->rope_full.rope_type = "yarn";
  c->rope_full.theta = 500000.0;
  c->rope_full.partial_rotary_factor = 0.5;
  c->rope_full.beta_slow = 1.0;
}

ModelConfig Tiny() {
  ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 5;
  c.num_attention_heads = 4;
  c.num_attention_heads_per_layer = {4, 8, 8, 8, 4};
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.rms_norm_eps = 1e-6;
  c.max_position_embeddings = 131072;
  c.layer_types = {LayerType::kFull, LayerType::kSliding, LayerType::kSliding, LayerType::kSliding,
                   LayerType::kFull};
  c.sliding_window = 8;
  c.rope_full.rope_type = "yarn";
  c.rope_full.theta = 500000.0;
  c.rope_full.factor = 32.0;
  c.rope_full.original_max_position_embeddings = 4096;
  c.rope_full.beta_fast = 64.0;
  c.rope_full.beta_slow = 1.0;
  c.rope_full.attention_factor = 1.0;
  c.rope_full.partial_rotary_factor = 0.5;
  c.rope_sliding.rope_type = "default";
  c.rope_sliding.theta = 10000.0;
  c.rope_sliding.partial_rotary_factor = 1.0;
  c.gating = GatingKind::kPerHead;
  c.mlp_layer_types = {MlpType::kDense, MlpType::kSparse, MlpType::kSparse, MlpType::kSparse,
                       MlpType::kSparse};
  c.num_experts = 8;
  c.num_experts_per_tok = 3;
  c.moe_intermediate_size = 32;
  c.shared_expert_intermediate_size = 16;
  c.moe_routed_scaling_factor = 2.5;
  c.moe_router_logit_softcapping = 0.0;
  c.bos_token_id = 2;
  c.eos_token_ids = {2, 24};
  c.pad_token_id = 9;
  return c;
}

ModelConfig Xs2() {
  ModelConfig c;
  CommonLaguna(&c);
  c.hidden_size = 2048;
  c.intermediate_size = 8192;
  c.num_hidden_layers = 40;
  c.num_attention_heads = 48;
  c.max_position_embeddings = 131072;
  FillHybrid(&c, 48, 64);
  c.rope_full.factor = 32.0;
  c.rope_full.original_max_position_embeddings = 4096;
  c.rope_full.beta_fast = 64.0;
  c.rope_full.attention_factor = 1.0;
  c.gating = GatingKind::kPerHead;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 512;
  c.shared_expert_intermediate_size = 512;
  return c;
}

ModelConfig S21() {
  ModelConfig c;
  CommonLaguna(&c);
  c.hidden_size = 3072;
  c.intermediate_size = 12288;
  c.num_hidden_layers = 48;
  c.num_attention_heads = 48;
  c.max_position_embeddings = 1048576;
  FillHybrid(&c, 48, 72);
  c.rope_full.factor = 128.0;
  c.rope_full.original_max_position_embeddings = 8192;
  c.rope_full.beta_fast = 32.0;
  c.rope_full.attention_factor = 0.1 * std::log(128.0) + 1.0;  // 1.4852030263919618, as shipped
  c.gating = GatingKind::kPerHead;
  c.num_experts_per_tok = 10;
  c.moe_intermediate_size = 1024;
  c.shared_expert_intermediate_size = 1024;
  return c;
}

}  // namespace

std::vector<std::string> ShapeNames() { return {"tiny", "xs2", "s21"}; }

Result<ModelConfig> ShapeConfig(std::string_view shape, std::optional<int> num_layers) {
  ModelConfig c;
  if (shape == "tiny") {
    c = Tiny();
  } else if (shape == "xs2") {
    c = Xs2();
  } else if (shape == "s21") {
    c = S21();
  } else {
    return InvalidArgument("unknown shape '{}' (known: tiny, xs2, s21)", shape);
  }
  if (num_layers) {
    if (*num_layers < 1 || *num_layers > c.num_hidden_layers) {
      return InvalidArgument("--num-layers {} is out of range for shape '{}' (1..{})", *num_layers, shape,
                             c.num_hidden_layers);
    }
    const size_t n = static_cast<size_t>(*num_layers);
    c.num_hidden_layers = *num_layers;
    c.layer_types.resize(n);
    c.mlp_layer_types.resize(n);
    c.num_attention_heads_per_layer.resize(n);
  }
  // Round-trip through the parser so a shape obeys exactly the rules a config.json does.
  auto parsed = ModelConfig::FromJson(c.ToJson());
  if (!parsed.ok()) return parsed.status().WithContext(fmt::format("shape '{}'", shape));
  return parsed;
}

}  // namespace dl
