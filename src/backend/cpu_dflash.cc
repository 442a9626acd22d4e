#include "backend/cpu_dflash.h"

#include <algorithm>
#include <cmath>

#include "backend/cpu_ops.h"

namespace dl {

CpuDflashRunner::CpuDflashRunner(const DflashCheckpoint& drafter, WeightRef target_embed,
                                 LinearWeights target_lm_head)
    : cfg_(drafter.config()),
      drafter_(drafter),
      target_embed_(std::move(target_embed)),
      target_lm_head_(std::move(target_lm_head)) {
  RopeParams p;
  p.rope_type = "default";
  p.theta = cfg_.rope_theta;
  p.partial_rotary_factor = cfg_.partial_rotary_factor;
  inv_freq_ = ComputeRopeTable(p, cfg_.head_dim).inv_freq;
}

int32_t CpuDflashRunner::length(uint64_t seq) const {
  auto it = cache_.find(seq);
  return it == cache_.end() ? 0 : it->second.length;
}

Status CpuDflashRunner::Run(const DraftBatch& batch, std::vector<std::vector<int32_t>>* tokens) {
  const int64_t d = cfg_.hidden_size, taps = cfg_.num_taps();
  // Context rows must continue each sequence's cache exactly (no gap, no overlap).
  int64_t ctx_rows = 0;
  for (const auto& c : batch.contexts) {
    if (c.first_position != length(c.seq)) {
      return FailedPrecondition("DFlash drafter: context rows of sequence {} start at position {} but its drafter "
                                "cache holds {} positions", c.seq, c.first_position, length(c.seq));
    }
    ctx_rows += c.num_rows;
  }
  if (static_cast<int64_t>(batch.taps.size()) != ctx_rows * taps * d) {
    return Internal("DFlash drafter: {} tap floats for {} context rows of {} x {}", batch.taps.size(), ctx_rows, taps, d);
  }
  batch_ = &batch;
  Slot& t = slot(DraftAct::kTaps);
  t.width = taps * d;
  t.data = batch.taps;
  Status st = DflashContextForward(cfg_, drafter_.weights(), batch, *this);
  if (st.ok()) {
    for (const auto& b : batch.blocks) {
      if (b.position != length(b.seq)) {
        st = FailedPrecondition("DFlash drafter: block of sequence {} at position {} but its drafter cache holds {} "
                                "positions (context rows missing)", b.seq, b.position, length(b.seq));
        break;
      }
      if (b.num_outputs < 0 || b.num_outputs >= cfg_.block_size) {
        st = InvalidArgument("DFlash drafter: {} drafts asked of a block of {}", b.num_outputs, cfg_.block_size);
        break;
      }
    }
  }
  if (st.ok()) {
    block_tokens_.clear();
    output_rows_.clear();
    for (const auto& b : batch.blocks) {
      const int32_t first = static_cast<int32_t>(block_tokens_.size());
      block_tokens_.push_back(b.anchor);
      for (int64_t j = 1; j < cfg_.block_size; ++j) block_tokens_.push_back(static_cast<int32_t>(cfg_.mask_token_id));
      for (int32_t j = 1; j <= b.num_outputs; ++j) output_rows_.push_back(first + j);
    }
    st = DflashBlockForward(cfg_, drafter_.weights(), target_embed_, target_lm_head_, batch, *this);
  }
  batch_ = nullptr;
  DL_RETURN_IF_ERROR(st);
  tokens->assign(batch.blocks.size(), {});
  size_t o = 0;
  for (size_t i = 0; i < batch.blocks.size(); ++i) {
    for (int32_t j = 0; j < batch.blocks[i].num_outputs; ++j) (*tokens)[i].push_back(selected_[o++]);
  }
  return Status::Ok();
}

Status CpuDflashRunner::NormTapSlices(std::span<const WeightRef> weights) {
  Slot& t = slot(DraftAct::kTaps);
  const int64_t d = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  for (int64_t r = 0; r < t.rows(); ++r) {
    for (size_t i = 0; i < weights.size(); ++i) {
      float* x = t.row(r) + static_cast<int64_t>(i) * d;
      cpu::RmsNorm(x, weights[i], d, eps, x);
    }
  }
  return Status::Ok();
}

Status CpuDflashRunner::RmsNorm(const WeightRef& weight, DraftAct in, DraftAct out) {
  Slot& x = slot(in);
  const int64_t rows = x.rows(), d = x.width;
  if (in != out) {
    slot(out).width = d;
    slot(out).data.assign(x.data.size(), 0.0f);
  }
  Slot& y = slot(out);
  for (int64_t r = 0; r < rows; ++r) cpu::RmsNorm(x.row(r), weight, d, static_cast<float>(cfg_.rms_norm_eps), y.row(r));
  return Status::Ok();
}

Status CpuDflashRunner::Linear(const LinearWeights& w, DraftAct in, DraftAct out) {
  Slot& x = slot(in);
  if (x.width != w.in()) {
    return Internal("DFlash linear {}: input width {} against the weight's {}", w.parts[0].name, x.width, w.in());
  }
  const int64_t rows = x.rows();
  Slot& y = slot(out);
  y.width = w.out();
  y.data.assign(static_cast<size_t>(rows * y.width), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (const WeightRef& part : w.parts) {
      cpu::MatVec(part, x.row(r), y.row(r) + off);
      off += part.rows();
    }
  }
  return Status::Ok();
}

void CpuDflashRunner::NormRope(float* x, const WeightRef& norm, int32_t position) const {
  const int64_t D = cfg_.head_dim, half = static_cast<int64_t>(inv_freq_.size());
  cpu::RmsNorm(x, norm, D, static_cast<float>(cfg_.rms_norm_eps), x);
  const float p = static_cast<float>(position);
  for (int64_t j = 0; j < half; ++j) {
    const float angle = p * inv_freq_[j];
    const float c = std::cos(angle), s = std::sin(angle);
    const float a = x[j], b = x[j + half];
    x[j] = a * c - b * s;
    x[j + half] = b * c + a * s;
  }
}

Status CpuDflashRunner::AppendContextKv(int32_t layer, const WeightRef& k_norm) {
  Slot& kv = slot(DraftAct::kContextKv);
  const int64_t K = cfg_.num_key_value_heads, D = cfg_.head_dim, w = K * D;
  const size_t layers = static_cast<size_t>(cfg_.num_hidden_layers);
  int64_t r = 0;
  for (const auto& c : batch_->contexts) {
    SeqCache& s = cache_[c.seq];
    if (s.k.size() != layers) {
      s.k.resize(layers);
      s.v.resize(layers);
    }
    for (int32_t i = 0; i < c.num_rows; ++i, ++r) {
      float* row = kv.row(r);
      for (int64_t h = 0; h < K; ++h) NormRope(row + h * D, k_norm, c.first_position + i);
      s.k[layer].insert(s.k[layer].end(), row, row + w);
      s.v[layer].insert(s.v[layer].end(), row + w, row + 2 * w);
    }
    // The last layer's append completes these positions.
    if (layer + 1 == cfg_.num_hidden_layers) s.length = c.first_position + c.num_rows;
  }
  return Status::Ok();
}

Status CpuDflashRunner::Embed(const WeightRef& table) {
  const int64_t d = cfg_.hidden_size, n = static_cast<int64_t>(block_tokens_.size());
  residual_.assign(static_cast<size_t>(n * d), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tok = block_tokens_[i];
    if (tok < 0 || tok >= table.rows()) return InvalidArgument("DFlash block token {} outside the target's table", tok);
    for (int64_t j = 0; j < d; ++j) residual_[i * d + j] = cpu::WeightAt(table, tok * d + j);
  }
  return Status::Ok();
}

Status CpuDflashRunner::AddRmsNorm(const WeightRef& weight, bool add_delta) {
  const int64_t d = cfg_.hidden_size, n = static_cast<int64_t>(block_tokens_.size());
  if (add_delta) {
    const float* delta = slot(DraftAct::kDelta).data.data();
    for (int64_t i = 0; i < n * d; ++i) residual_[i] += delta[i];
  }
  Slot& y = slot(DraftAct::kNormed);
  y.width = d;
  y.data.assign(static_cast<size_t>(n * d), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    cpu::RmsNorm(residual_.data() + i * d, weight, d, static_cast<float>(cfg_.rms_norm_eps), y.row(i));
  }
  return Status::Ok();
}

Status CpuDflashRunner::BlockAttention(int32_t layer, const WeightRef& q_norm, const WeightRef& k_norm) {
  const int64_t H = cfg_.num_attention_heads, K = cfg_.num_key_value_heads, D = cfg_.head_dim;
  const int64_t G = H / K, kvw = K * D, B = cfg_.block_size;
  const bool sliding = cfg_.layer_types[layer] == LayerType::kSliding;
  const bool causal = cfg_.block_causal[layer];
  const int64_t W = cfg_.sliding_window;
  Slot& qkvg = slot(DraftAct::kQkvg);
  Slot& out = slot(DraftAct::kAttention);
  out.width = H * D;
  out.data.assign(static_cast<size_t>(qkvg.rows() * H * D), 0.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> q(static_cast<size_t>(B * H * D)), bk(static_cast<size_t>(B * kvw)), bv(bk.size());
  std::vector<float> scores;
  for (size_t bi = 0; bi < batch_->blocks.size(); ++bi) {
    const auto& blk = batch_->blocks[bi];
    const int64_t first = static_cast<int64_t>(bi) * B;
    const SeqCache* s = nullptr;
    if (auto it = cache_.find(blk.seq); it != cache_.end()) s = &it->second;
    const int32_t ctx_len = s ? s->length : 0;
    // The block's q/k (normed, rotated at s + j) and v.
    for (int64_t j = 0; j < B; ++j) {
      const float* row = qkvg.row(first + j);
      const int32_t pos = blk.position + static_cast<int32_t>(j);
      std::copy(row, row + H * D, q.begin() + j * H * D);
      std::copy(row + H * D, row + H * D + kvw, bk.begin() + j * kvw);
      std::copy(row + H * D + kvw, row + H * D + 2 * kvw, bv.begin() + j * kvw);
      for (int64_t h = 0; h < H; ++h) NormRope(q.data() + (j * H + h) * D, q_norm, pos);
      for (int64_t h = 0; h < K; ++h) NormRope(bk.data() + j * kvw + h * D, k_norm, pos);
    }
    for (int64_t j = 0; j < B; ++j) {
      const int64_t qpos = blk.position + j;
      // Visible keys: context positions within the window, then block rows (all, or 0..j when causal;
      // sliding layers also drop block rows outside the window, which only matters for W < B).
      const int64_t ctx_first = sliding ? std::max<int64_t>(0, qpos - W + 1) : 0;
      const int64_t blk_last = causal ? j : B - 1;
      const int64_t blk_first = sliding ? std::max<int64_t>(0, qpos - W + 1 - blk.position) : 0;
      float* o = out.row(first + j);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kh = h / G;
        const float* qh = q.data() + (j * H + h) * D;
        scores.clear();
        float mx = -INFINITY;
        auto dot = [&](const float* k) {
          float acc = 0.0f;
          for (int64_t e = 0; e < D; ++e) acc += qh[e] * k[e];
          return acc * scale;
        };
        for (int64_t p = ctx_first; p < ctx_len; ++p) {
          scores.push_back(dot(s->k[layer].data() + p * kvw + kh * D));
          mx = std::max(mx, scores.back());
        }
        for (int64_t i = blk_first; i <= blk_last; ++i) {
          scores.push_back(dot(bk.data() + i * kvw + kh * D));
          mx = std::max(mx, scores.back());
        }
        float denom = 0.0f;
        for (float& x : scores) {
          x = std::exp(x - mx);
          denom += x;
        }
        float* oh = o + h * D;
        size_t idx = 0;
        for (int64_t p = ctx_first; p < ctx_len; ++p, ++idx) {
          const float pr = scores[idx] / denom;
          const float* v = s->v[layer].data() + p * kvw + kh * D;
          for (int64_t e = 0; e < D; ++e) oh[e] += pr * v[e];
        }
        for (int64_t i = blk_first; i <= blk_last; ++i, ++idx) {
          const float pr = scores[idx] / denom;
          const float* v = bv.data() + i * kvw + kh * D;
          for (int64_t e = 0; e < D; ++e) oh[e] += pr * v[e];
        }
        // Laguna's per-head output gate: softplus of the head's g_proj output.
        if (cfg_.per_head_gate) {
          const float g = cpu::Softplus(qkvg.row(first + j)[H * D + 2 * kvw + h]);
          for (int64_t e = 0; e < D; ++e) oh[e] *= g;
        }
      }
    }
  }
  return Status::Ok();
}

Status CpuDflashRunner::SiluMul() {
  Slot& gu = slot(DraftAct::kGateUp);
  const int64_t f = gu.width / 2, n = gu.rows();
  Slot& h = slot(DraftAct::kHidden);
  h.width = f;
  h.data.assign(static_cast<size_t>(n * f), 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    const float* g = gu.row(r);
    float* y = h.row(r);
    for (int64_t j = 0; j < f; ++j) y[j] = cpu::Silu(g[j]) * g[f + j];
  }
  return Status::Ok();
}

Status CpuDflashRunner::OutputNorm(const WeightRef& weight) {
  const int64_t d = cfg_.hidden_size;
  const float* delta = slot(DraftAct::kDelta).data.data();
  for (size_t i = 0; i < residual_.size(); ++i) residual_[i] += delta[i];
  Slot& y = slot(DraftAct::kOutputNormed);
  y.width = d;
  y.data.assign(output_rows_.size() * static_cast<size_t>(d), 0.0f);
  for (size_t o = 0; o < output_rows_.size(); ++o) {
    cpu::RmsNorm(residual_.data() + output_rows_[o] * d, weight, d, static_cast<float>(cfg_.rms_norm_eps),
                 y.row(static_cast<int64_t>(o)));
  }
  return Status::Ok();
}

Status CpuDflashRunner::SelectTokens() {
  Slot& l = slot(DraftAct::kLogits);
  if (keep_logits_) kept_logits_ = l.data;
  selected_.assign(output_rows_.size(), 0);
  for (size_t o = 0; o < output_rows_.size(); ++o) {
    const float* row = l.row(static_cast<int64_t>(o));
    int64_t best = 0;
    for (int64_t j = 1; j < l.width; ++j) {
      if (row[j] > row[best]) best = j;  // lowest id on ties, as every argmax here
    }
    selected_[o] = static_cast<int32_t>(best);
  }
  return Status::Ok();
}

}  // namespace dl
