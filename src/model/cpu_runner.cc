#include "model/cpu_runner.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "model/cpu_ops.h"

namespace dl {

using cpu::MatVec;
using cpu::RmsNorm;

CpuRunner::CpuRunner(const Checkpoint& checkpoint, const KvCacheSpec& kv, KvScales scales)
    : cfg_(checkpoint.config()),
      w_(checkpoint.weights()),
      kv_spec_(kv),
      storage_(kv, std::move(scales)),
      rope_full_(ComputeRopeTable(checkpoint.config().rope_full, checkpoint.config().head_dim)),
      rope_sliding_(ComputeRopeTable(checkpoint.config().rope_sliding, checkpoint.config().head_dim)) {}

Result<std::unique_ptr<CpuRunner>> CpuRunner::Create(const Checkpoint& checkpoint,
                                                     const KvCacheSpec& kv, KvScales scales) {
  const ModelConfig& c = checkpoint.config();
  if (kv.num_layers != c.num_hidden_layers || kv.num_kv_heads != c.num_key_value_heads ||
      kv.head_dim != c.head_dim) {
    return InvalidArgument("KV cache geometry does not match the model");
  }
  if (kv.dtype == DType::kF8E4M3 &&
      (static_cast<int64_t>(scales.k.size()) != c.num_hidden_layers ||
       static_cast<int64_t>(scales.v.size()) != c.num_hidden_layers)) {
    return InvalidArgument("FP8 KV cache needs one K and one V scale per layer ({} layers)",
                           c.num_hidden_layers);
  }
  if (scales.empty()) scales = KvScales::Unit(static_cast<int>(c.num_hidden_layers));
  return std::unique_ptr<CpuRunner>(new CpuRunner(checkpoint, kv, std::move(scales)));
}

nlohmann::json CpuRunner::Describe() const {
  return {{"backend", backend_name()},
          {"kernel_presets", "cpu-reference"},
          {"fallback", false},
          {"fallback_ops", nlohmann::json::array()},
          {"topology", "not applicable (cpu-reference has no captured graph)"},
          {"kv_dtype", std::string(DTypeName(kv_spec_.dtype))},
          {"page_size", kv_spec_.page_size}};
}

Status CpuRunner::Forward(const SequenceKv& seq, std::span<const int32_t> tokens, bool all_logits,
                          std::vector<float>* logits) {
  const int64_t d = cfg_.hidden_size;
  const int32_t n = static_cast<int32_t>(tokens.size());
  if (n == 0) return InvalidArgument("forward of zero tokens");
  const int32_t pos0 = seq.length();
  for (int32_t t : tokens) {
    if (t < 0 || t >= cfg_.vocab_size) {
      return InvalidArgument("token id {} is outside the vocabulary [0, {})", t, cfg_.vocab_size);
    }
  }
  const int32_t reserved = static_cast<int32_t>(seq.block_table(KvGroup::kFull).size() +
                                                seq.block_table(KvGroup::kSliding).size());
  if (reserved == 0) return FailedPrecondition("forward without reserved KV pages");

  // Embedding: row lookup, no scaling.
  std::vector<float> h(static_cast<size_t>(n) * d);
  for (int32_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < d; ++j) h[i * d + j] = cpu::WeightAt(w_.embed, tokens[i] * d + j);
  }
  for (int32_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    Attention(l, seq, pos0, n, h.data());
    Mlp(l, n, h.data());
  }
  const int32_t first = all_logits ? 0 : n - 1;
  const int64_t vocab = cfg_.vocab_size;
  logits->assign(static_cast<size_t>(n - first) * vocab, 0.0f);
  std::vector<float> y(d);
  for (int32_t i = first; i < n; ++i) {
    RmsNorm(h.data() + i * d, w_.final_norm, d, static_cast<float>(cfg_.rms_norm_eps), y.data());
    MatVec(w_.lm_head, y.data(), logits->data() + (i - first) * vocab);
  }
  return Status::Ok();
}

void CpuRunner::Attention(int32_t l, const SequenceKv& seq, int32_t pos0, int32_t n, float* h) {
  const LayerWeights& lw = w_.layers[l];
  const int64_t d = cfg_.hidden_size, D = cfg_.head_dim, H = cfg_.heads(l), K = cfg_.num_key_value_heads;
  const int64_t G = H / K, gate_width = cfg_.gate_width(l);
  const bool sliding = cfg_.is_sliding(l);
  const RopeTable& rope = sliding ? rope_sliding_ : rope_full_;
  const int64_t R = rope.rotary_dim, half = R / 2;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const KvGroup group = sliding ? KvGroup::kSliding : KvGroup::kFull;
  const auto& table = seq.block_table(group);

  std::vector<float> u(n * d), q(n * H * D), k(n * K * D), v(n * K * D), g(n * gate_width);
  for (int32_t i = 0; i < n; ++i) {
    RmsNorm(h + i * d, lw.input_norm, d, eps, u.data() + i * d);
    MatVec(lw.q, u.data() + i * d, q.data() + i * H * D);
    MatVec(lw.k, u.data() + i * d, k.data() + i * K * D);
    MatVec(lw.v, u.data() + i * d, v.data() + i * K * D);
    MatVec(lw.g, u.data() + i * d, g.data() + i * gate_width);
  }
  // QK-norm per head (one [D] weight per layer), then half-split partial RoPE on the first R dims.
  std::vector<float> cos_t(half), sin_t(half);
  for (int32_t i = 0; i < n; ++i) {
    const float p = static_cast<float>(pos0 + i);
    for (int64_t j = 0; j < half; ++j) {
      const float angle = p * rope.inv_freq[j];
      cos_t[j] = std::cos(angle) * rope.attention_factor;
      sin_t[j] = std::sin(angle) * rope.attention_factor;
    }
    auto rotate = [&](float* x) {
      for (int64_t j = 0; j < half; ++j) {
        const float a = x[j], b = x[j + half];
        x[j] = a * cos_t[j] - b * sin_t[j];
        x[j + half] = b * cos_t[j] + a * sin_t[j];
      }
    };
    for (int64_t hh = 0; hh < H; ++hh) {
      float* qh = q.data() + (i * H + hh) * D;
      RmsNorm(qh, lw.q_norm, D, eps, qh);
      rotate(qh);
    }
    for (int64_t kh = 0; kh < K; ++kh) {
      float* kk = k.data() + (i * K + kh) * D;
      RmsNorm(kk, lw.k_norm, D, eps, kk);
      rotate(kk);
    }
    if (observer_) observer_->Observe(l, k.data() + i * K * D, v.data() + i * K * D, 1);
    storage_.Write(l, LocatePosition(table, kv_spec_.page_size, pos0 + i), k.data() + i * K * D,
                   v.data() + i * K * D);
  }

  // Scores over the visible keys, read back from the cache (so quantised KV is what attention sees).
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> attn(H * D), o(d), kbuf(K * D), vbuf(K * D);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t p = pos0 + i;
    const int32_t first = sliding ? std::max(0, p - static_cast<int32_t>(cfg_.sliding_window) + 1) : 0;
    const int32_t count = p - first + 1;
    std::vector<float> keys(static_cast<size_t>(count) * K * D), vals(keys.size());
    for (int32_t s = first; s <= p; ++s) {
      storage_.Read(l, LocatePosition(table, kv_spec_.page_size, s), kbuf.data(), vbuf.data());
      std::copy(kbuf.begin(), kbuf.end(), keys.begin() + (s - first) * K * D);
      std::copy(vbuf.begin(), vbuf.end(), vals.begin() + (s - first) * K * D);
    }
    std::vector<float> scores(count);
    for (int64_t hh = 0; hh < H; ++hh) {
      const int64_t kv_head = hh / G;
      const float* qh = q.data() + (i * H + hh) * D;
      float max_score = -INFINITY;
      for (int32_t s = 0; s < count; ++s) {
        const float* ks = keys.data() + (s * K + kv_head) * D;
        float dot = 0.0f;
        for (int64_t j = 0; j < D; ++j) dot += qh[j] * ks[j];
        scores[s] = dot * scale;
        max_score = std::max(max_score, scores[s]);
      }
      float denom = 0.0f;
      for (int32_t s = 0; s < count; ++s) {
        scores[s] = std::exp(scores[s] - max_score);
        denom += scores[s];
      }
      float* out = attn.data() + hh * D;
      std::fill(out, out + D, 0.0f);
      for (int32_t s = 0; s < count; ++s) {
        const float pr = scores[s] / denom;
        const float* vs = vals.data() + (s * K + kv_head) * D;
        for (int64_t j = 0; j < D; ++j) out[j] += pr * vs[j];
      }
    }
    // Softplus output gate from the attention input's projection (per head or per element).
    const float* gi = g.data() + i * gate_width;
    for (int64_t hh = 0; hh < H; ++hh) {
      for (int64_t j = 0; j < D; ++j) {
        const float gv = cfg_.gating == GatingKind::kPerHead ? gi[hh] : gi[hh * D + j];
        attn[hh * D + j] *= cpu::Softplus(gv);
      }
    }
    MatVec(lw.o, attn.data(), o.data());
    for (int64_t j = 0; j < d; ++j) h[i * d + j] += o[j];
  }
}

void CpuRunner::SwiGlu(const TensorView& gate, const TensorView& up, const TensorView& down,
                       const float* x, float* y) {
  const int64_t f = gate.shape[0];
  std::vector<float> a(f), b(f);
  MatVec(gate, x, a.data());
  MatVec(up, x, b.data());
  for (int64_t j = 0; j < f; ++j) a[j] = cpu::Silu(a[j]) * b[j];
  MatVec(down, a.data(), y);
}

void CpuRunner::Mlp(int32_t l, int32_t n, float* h) {
  const LayerWeights& lw = w_.layers[l];
  const int64_t d = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  std::vector<float> u(d), y(d), tmp(d);
  for (int32_t i = 0; i < n; ++i) {
    float* hi = h + i * d;
    RmsNorm(hi, lw.post_attn_norm, d, eps, u.data());
    if (!cfg_.is_sparse(l)) {
      SwiGlu(lw.mlp_gate, lw.mlp_up, lw.mlp_down, u.data(), y.data());
    } else {
      const int64_t E = cfg_.num_experts, topk = cfg_.num_experts_per_tok;
      std::vector<float> z(E), s(E), biased(E);
      MatVec(lw.router, u.data(), z.data());
      const float cap = static_cast<float>(cfg_.moe_router_logit_softcapping);
      for (int64_t e = 0; e < E; ++e) {
        if (cap > 0.0f) z[e] = cap * std::tanh(z[e] / cap);
        s[e] = cpu::Sigmoid(z[e]);
        biased[e] = s[e] + cpu::WeightAt(lw.correction_bias, e);
      }
      // Top-k by biased score (the bias chooses experts only), ties to the lower index.
      std::vector<int64_t> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + topk, order.end(), [&](int64_t a, int64_t b) {
        return biased[a] > biased[b] || (biased[a] == biased[b] && a < b);
      });
      std::vector<int64_t> chosen(order.begin(), order.begin() + topk);
      float sum = 0.0f;
      for (int64_t e : chosen) sum += s[e];
      // Accumulate in ascending expert id, as the reference's eager experts loop does.
      std::sort(chosen.begin(), chosen.end());
      std::fill(y.begin(), y.end(), 0.0f);
      for (int64_t e : chosen) {
        const float weight = s[e] / sum;
        const ExpertWeights& ex = lw.experts[e];
        SwiGlu(ex.gate, ex.up, ex.down, u.data(), tmp.data());
        for (int64_t j = 0; j < d; ++j) y[j] += tmp[j] * weight;
      }
      const float alpha = static_cast<float>(cfg_.moe_routed_scaling_factor);
      SwiGlu(lw.shared.gate, lw.shared.up, lw.shared.down, u.data(), tmp.data());
      for (int64_t j = 0; j < d; ++j) y[j] = y[j] * alpha + tmp[j];
    }
    for (int64_t j = 0; j < d; ++j) hi[j] += y[j];
  }
}

}  // namespace dl
