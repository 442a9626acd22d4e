#include "model/synthetic.h"

#include <cmath>

#include <algorithm>

#include "base/dtype.h"
#include "base/rng.h"

namespace dl {

std::vector<TensorSpec> CheckpointTensorSpecs(const ModelConfig& c) {
  const int64_t d = c.hidden_size, D = c.head_dim, K = c.num_key_value_heads;
  std::vector<TensorSpec> v;
  auto add = [&](std::string name, std::vector<int64_t> shape, TensorKind kind, int64_t fan_in) {
    v.push_back(TensorSpec{std::move(name), std::move(shape), kind, fan_in});
  };
  add("model.embed_tokens.weight", {c.vocab_size, d}, TensorKind::kEmbedding, d);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    const int64_t H = c.heads(l);
    add(p + "self_attn.q_proj.weight", {H * D, d}, TensorKind::kLinear, d);
    add(p + "self_attn.k_proj.weight", {K * D, d}, TensorKind::kLinear, d);
    add(p + "self_attn.v_proj.weight", {K * D, d}, TensorKind::kLinear, d);
    add(p + "self_attn.o_proj.weight", {d, H * D}, TensorKind::kLinear, H * D);
    add(p + "self_attn.g_proj.weight", {c.gate_width(l), d}, TensorKind::kLinear, d);
    add(p + "self_attn.q_norm.weight", {D}, TensorKind::kNorm, D);
    add(p + "self_attn.k_norm.weight", {D}, TensorKind::kNorm, D);
    if (c.is_sparse(l)) {
      const int64_t F = c.moe_intermediate_size, Fs = c.shared_expert_intermediate_size;
      add(p + "mlp.gate.weight", {c.num_experts, d}, TensorKind::kRouter, d);
      add(p + "mlp.experts.e_score_correction_bias", {c.num_experts}, TensorKind::kCorrectionBias, 1);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
        add(q + "gate_proj.weight", {F, d}, TensorKind::kLinear, d);
        add(q + "up_proj.weight", {F, d}, TensorKind::kLinear, d);
        add(q + "down_proj.weight", {d, F}, TensorKind::kLinear, F);
      }
      add(p + "mlp.shared_expert.gate_proj.weight", {Fs, d}, TensorKind::kLinear, d);
      add(p + "mlp.shared_expert.up_proj.weight", {Fs, d}, TensorKind::kLinear, d);
      add(p + "mlp.shared_expert.down_proj.weight", {d, Fs}, TensorKind::kLinear, Fs);
    } else {
      const int64_t F = c.intermediate_size;
      add(p + "mlp.gate_proj.weight", {F, d}, TensorKind::kLinear, d);
      add(p + "mlp.up_proj.weight", {F, d}, TensorKind::kLinear, d);
      add(p + "mlp.down_proj.weight", {d, F}, TensorKind::kLinear, F);
    }
    add(p + "input_layernorm.weight", {d}, TensorKind::kNorm, d);
    add(p + "post_attention_layernorm.weight", {d}, TensorKind::kNorm, d);
  }
  add("model.norm.weight", {d}, TensorKind::kNorm, d);
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, d}, TensorKind::kLmHead, d);
  return v;
}

void TensorValueAffine(TensorKind kind, int64_t fan_in, float* scale, float* offset) {
  const float inv_sqrt = 1.0f / sqrtf(static_cast<float>(fan_in));
  *offset = 0.0f;
  switch (kind) {
    case TensorKind::kLinear: *scale = inv_sqrt; break;
    case TensorKind::kEmbedding: *scale = 1.0f; break;
    case TensorKind::kLmHead: *scale = 3.0f * inv_sqrt; break;
    case TensorKind::kNorm:
      *scale = 0.2f;
      *offset = 1.0f;
      break;
    case TensorKind::kRouter: *scale = 2.0f * inv_sqrt; break;
    case TensorKind::kCorrectionBias: *scale = 0.1f; break;
  }
}

void GenerateTensorValues(uint64_t seed, std::string_view name, TensorKind kind, int64_t fan_in, float* out,
                          int64_t begin, int64_t count) {
  const uint64_t key = StreamKey(seed, name);
  float scale, offset;
  TensorValueAffine(kind, fan_in, &scale, &offset);
  for (int64_t i = 0; i < count; ++i) {
    out[i] = offset + scale * NormalAt(key, static_cast<uint64_t>(begin + i));
  }
}

void QuantizeSyntheticFp8Band(uint64_t seed, const TensorSpec& spec, int64_t block_rows, int64_t block_cols,
                              int64_t band, std::vector<float>* scratch, uint8_t* codes, float* scales) {
  const int64_t out = spec.shape[0], in = spec.shape.size() > 1 ? spec.shape[1] : 1;
  const int64_t r0 = band * block_rows, r1 = std::min(out, r0 + block_rows);
  const int64_t n = (r1 - r0) * in;
  scratch->resize(static_cast<size_t>(n));
  GenerateTensorValues(seed, spec.name, spec.kind, spec.fan_in, scratch->data(), r0 * in, n);
  const int64_t col_blocks = (in + block_cols - 1) / block_cols;
  for (int64_t bj = 0; bj < col_blocks; ++bj) {
    const int64_t c0 = bj * block_cols, c1 = std::min(in, c0 + block_cols);
    float amax = 0.0f;
    for (int64_t r = 0; r < r1 - r0; ++r) {
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs((*scratch)[r * in + c]));
    }
    const float scale = SyntheticFp8Scale(amax);
    scales[bj] = scale;
    for (int64_t r = 0; r < r1 - r0; ++r) {
      for (int64_t c = c0; c < c1; ++c) codes[r * in + c] = FloatToFp8E4M3((*scratch)[r * in + c] / scale);
    }
  }
}

}  // namespace dl
