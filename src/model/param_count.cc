#include "model/param_count.h"

#include <algorithm>
#include <string>

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

}  // namespace dl
