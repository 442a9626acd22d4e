#include "model/param_count.h"

#include <algorithm>
#include <string>
#include <unordered_map>

#include "model/synthetic.h"

namespace dl {

namespace {
bool Contains(const std::string& s, const char* p) { return s.find(p) != std::string::npos; }
}  // namespace

ParamCounts CountParams(const ModelConfig& c) {
  ParamCounts p;
  p.embedding_row = c.hidden_size;
  // Classify the exact tensor list make-model writes, so the count is the file's count.
  for (const TensorSpec& s : CheckpointTensorSpecs(c)) {
    const int64_t n = s.numel();
    p.total += n;
    const std::string& name = s.name;
    bool active = true;
    bool fp8_linear = false;
    if (name == "model.embed_tokens.weight") {
      p.embedding += n;
      active = false;
    } else if (name == "lm_head.weight") {
      p.lm_head += n;
    } else if (Contains(name, ".self_attn.")) {
      p.attention += n;
      fp8_linear = s.kind == TensorKind::kLinear && !Contains(name, "g_proj");
    } else if (Contains(name, ".mlp.experts.") && s.kind == TensorKind::kLinear) {
      p.routed_experts += n;
      // "model.layers.L.mlp.experts.E.xxx": active when E < k.
      const size_t at = name.find(".mlp.experts.") + 13;
      const int64_t e = std::stoll(name.substr(at, name.find('.', at) - at));
      active = e < c.num_experts_per_tok;
      if (active) p.active_routed += n;
      fp8_linear = true;
    } else if (Contains(name, ".mlp.shared_expert.")) {
      p.shared_experts += n;
      fp8_linear = true;
    } else if (s.kind == TensorKind::kRouter) {
      p.routers += n;
    } else if (s.kind == TensorKind::kCorrectionBias) {
      p.correction_biases += n;
    } else if (Contains(name, ".mlp.")) {
      p.dense_mlp += n;
      fp8_linear = true;
    } else {
      p.block_norms += n;  // input / post-attention / final norms
    }
    if (active) p.active += n;
    if (active && fp8_linear) p.active_fp8_linears += n;
  }
  if (c.tie_word_embeddings) p.active += c.vocab_size * c.hidden_size;  // the head still reads the table
  return p;
}

WeightBytesPerToken ActiveWeightBytes(const ModelConfig& c,
                                      const std::function<TensorStorage(const TensorSpec&)>& storage) {
  WeightBytesPerToken b;
  auto add = [&](const TensorSpec& s, bool routed) {
    const TensorStorage st = storage(s);
    const int64_t bytes = s.numel() * static_cast<int64_t>(DTypeSize(st.dtype));
    switch (st.dtype) {
      case DType::kF32: b.f32 += bytes; break;
      case DType::kBF16:
      case DType::kF16: b.bf16 += bytes; break;
      case DType::kF8E4M3: b.fp8 += bytes; break;
    }
    b.fp8_scales += 4 * st.scales;
    if (routed) b.routed += bytes + 4 * st.scales;
  };
  for (const TensorSpec& s : CheckpointTensorSpecs(c)) {
    if (s.name == "model.embed_tokens.weight") {
      if (c.tie_word_embeddings) add(s, false);  // the head reads the whole table
      continue;
    }
    const size_t at = s.name.find(".mlp.experts.");
    if (at != std::string::npos && s.kind == TensorKind::kLinear) {
      const size_t from = at + 13;
      const int64_t e = std::stoll(s.name.substr(from, s.name.find('.', from) - from));
      if (e < c.num_experts_per_tok) add(s, true);
      continue;
    }
    add(s, false);
  }
  return b;
}

WeightBytesPerToken ActiveWeightBytes(const ModelConfig& c, DType dtype, const Fp8Options* fp8) {
  WeightQuantization q;
  if (fp8 != nullptr) {
    q.format = fp8->format;
    q.granularity = fp8->granularity;
    q.block_rows = fp8->block_rows;
    q.block_cols = fp8->block_cols;
  }
  return ActiveWeightBytes(c, [&](const TensorSpec& s) {
    if (fp8 == nullptr || !Fp8LayoutQuantizes(fp8->layout, s)) return TensorStorage{dtype, 0};
    int64_t n = 1;
    for (int64_t d : q.ScaleShape(s.shape[0], s.shape[1])) n *= d;
    return TensorStorage{DType::kF8E4M3, n};
  });
}

WeightBytesPerToken ActiveWeightBytes(const Checkpoint& ck) {
  // The loaded views under the per-expert names CheckpointTensorSpecs uses (fused checkpoints too).
  std::unordered_map<std::string, const TensorView*> views;
  const ModelWeights& w = ck.weights();
  views["model.embed_tokens.weight"] = &w.embed;
  views["model.norm.weight"] = &w.final_norm;
  views["lm_head.weight"] = &w.lm_head;
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    const std::pair<const char*, const TensorView*> named[] = {
        {"input_layernorm.weight", &L.input_norm},
        {"post_attention_layernorm.weight", &L.post_attn_norm},
        {"self_attn.q_proj.weight", &L.q},
        {"self_attn.k_proj.weight", &L.k},
        {"self_attn.v_proj.weight", &L.v},
        {"self_attn.o_proj.weight", &L.o},
        {"self_attn.g_proj.weight", &L.g},
        {"self_attn.q_norm.weight", &L.q_norm},
        {"self_attn.k_norm.weight", &L.k_norm},
        {"mlp.gate_proj.weight", &L.mlp_gate},
        {"mlp.up_proj.weight", &L.mlp_up},
        {"mlp.down_proj.weight", &L.mlp_down},
        {"mlp.gate.weight", &L.router},
        {"mlp.experts.e_score_correction_bias", &L.correction_bias},
        {"mlp.shared_expert.gate_proj.weight", &L.shared.gate},
        {"mlp.shared_expert.up_proj.weight", &L.shared.up},
        {"mlp.shared_expert.down_proj.weight", &L.shared.down},
    };
    for (const auto& [n, v] : named) views[p + n] = v;
    for (size_t e = 0; e < L.experts.size(); ++e) {
      const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
      views[q + "gate_proj.weight"] = &L.experts[e].gate;
      views[q + "up_proj.weight"] = &L.experts[e].up;
      views[q + "down_proj.weight"] = &L.experts[e].down;
    }
  }
  return ActiveWeightBytes(ck.config(), [&](const TensorSpec& s) {
    auto it = views.find(s.name);
    if (it == views.end()) return TensorStorage{DType::kBF16, 0};  // not in this model's layout
    return TensorStorage{it->second->dtype, it->second->num_scales()};
  });
}

int64_t KvBytesPerToken(const ModelConfig& c, int64_t elem_bytes) {
  return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * elem_bytes;
}

int64_t KvBytesReadPerToken(const ModelConfig& c, int64_t context, int64_t elem_bytes) {
  int64_t total = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int64_t keys = c.is_sliding(l) ? std::min(context, c.sliding_window) : context;
    total += 2 * c.num_key_value_heads * c.head_dim * elem_bytes * keys;
  }
  return total;
}

PrefillFlops CountPrefillFlops(const ModelConfig& c, int64_t prompt_len, int64_t logit_rows) {
  const ParamCounts p = CountParams(c);
  PrefillFlops f;
  f.linear = 2.0 * static_cast<double>(p.active - p.lm_head) * static_cast<double>(prompt_len) +
             2.0 * static_cast<double>(p.lm_head) * static_cast<double>(std::min(logit_rows, prompt_len));
  const double n = static_cast<double>(prompt_len);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    // Keys visible to positions 0 .. n-1: sum of (s + 1) over s, capped at W on sliding layers.
    double keys = n * (n + 1) / 2;
    if (c.is_sliding(l) && c.sliding_window < prompt_len) {
      const double w = static_cast<double>(c.sliding_window);
      keys = w * (w + 1) / 2 + (n - w) * w;
    }
    f.attention += 4.0 * static_cast<double>(c.heads(l)) * static_cast<double>(c.head_dim) * keys;
  }
  return f;
}

}  // namespace dl
