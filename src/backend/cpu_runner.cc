#include "backend/cpu_runner.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu_ops.h"
#include "kernels/reference/reference.h"

namespace dl {

using cpu::MatVec;
using cpu::RmsNorm;

namespace {

// The rank's cache: the model's page geometry with only the rank's KV heads (the same for every
// layer: the plan splits K uniformly).
KvCacheSpec RankKvSpec(const KvCacheSpec& kv, const TensorParallelPlan& plan, int rank) {
  KvCacheSpec s = kv;
  if (!plan.ranks[rank].layers.empty()) {
    s.num_kv_heads = static_cast<int32_t>(plan.ranks[rank].layers[0].kv_heads.size);
  }
  return s;
}

std::vector<Slice> LmHeadSlices(const TensorParallelPlan& plan) {
  std::vector<Slice> v;
  for (const RankShard& r : plan.ranks) v.push_back(r.lm_head_vocab);
  return v;
}

}  // namespace

CpuRunner::CpuRunner(const Checkpoint& checkpoint, const KvCacheSpec& kv, KvScales scales,
                     const TensorParallelPlan& plan, int rank, comm::Communicator* comm,
                     std::unique_ptr<HostWeightShard> shard)
    : cfg_(checkpoint.config()),
      tp_size_(plan.tp_size),
      rank_(rank),
      layer_shards_(plan.ranks[rank].layers),
      shard_(std::move(shard)),
      comm_(comm),
      lm_head_slices_(LmHeadSlices(plan)),
      weights_(shard_ ? shard_->weights : HostLagunaWeights(checkpoint.weights())),
      kv_spec_(kv),
      storage_(RankKvSpec(kv, plan, rank), std::move(scales)),
      rope_full_(ComputeRopeTable(checkpoint.config().rope_full, checkpoint.config().head_dim)),
      rope_sliding_(ComputeRopeTable(checkpoint.config().rope_sliding, checkpoint.config().head_dim)) {}

Status CpuRunner::CheckKvSpec(const ModelConfig& c, const KvCacheSpec& kv, const KvScales& scales) {
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
  return Status::Ok();
}

Result<std::unique_ptr<CpuRunner>> CpuRunner::Create(const Checkpoint& checkpoint,
                                                     const KvCacheSpec& kv, KvScales scales) {
  const ModelConfig& c = checkpoint.config();
  DL_RETURN_IF_ERROR(CheckKvSpec(c, kv, scales));
  if (scales.empty()) scales = KvScales::Unit(static_cast<int>(c.num_hidden_layers));
  DL_ASSIGN_OR_RETURN(TensorParallelPlan whole, MakeTensorParallelPlan(c, 1, EmbeddingMode::kReplicated));
  return std::unique_ptr<CpuRunner>(new CpuRunner(checkpoint, kv, std::move(scales), whole, 0, nullptr, nullptr));
}

Result<std::unique_ptr<CpuRunner>> CpuRunner::CreateRank(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                         KvScales scales, const TensorParallelPlan& plan, int rank,
                                                         comm::Communicator* comm) {
  const ModelConfig& c = checkpoint.config();
  DL_RETURN_IF_ERROR(CheckKvSpec(c, kv, scales));
  if (comm == nullptr || comm->size() != plan.tp_size || comm->rank() != rank) {
    return InvalidArgument("tensor-parallel rank {} of {}: the communicator is {} of {}", rank, plan.tp_size,
                           comm ? comm->rank() : -1, comm ? comm->size() : 0);
  }
  if (scales.empty()) scales = KvScales::Unit(static_cast<int>(c.num_hidden_layers));
  DL_ASSIGN_OR_RETURN(auto shard, ShardHostWeights(c, HostLagunaWeights(checkpoint.weights()), plan, rank));
  return std::unique_ptr<CpuRunner>(
      new CpuRunner(checkpoint, kv, std::move(scales), plan, rank, comm, std::move(shard)));
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

Status CpuRunner::Launch(const ForwardBatch& batch) {
  if (batch_ != nullptr) return FailedPrecondition("a forward is already in flight");
  DL_RETURN_IF_ERROR(batch.Validate(cfg_.vocab_size, kv_spec_.page_size));
  batch_ = &batch;
  positions_ = batch.Positions();
  result_ = ForwardResult{};
  result_.rows.resize(batch.outputs.size());
  result_.hidden.resize(batch.hidden_taps.size());
  // The CPU runs the forward here; Wait hands over the result.
  const int64_t collectives_before = comm_ ? comm_->collectives_issued() : 0;
  status_ = LagunaForward(cfg_, weights_, batch, *this);
  collectives_last_forward_ = comm_ ? comm_->collectives_issued() - collectives_before : 0;
  return Status::Ok();
}

Status CpuRunner::Wait(ForwardResult* result) {
  if (batch_ == nullptr) return FailedPrecondition("no forward in flight");
  batch_ = nullptr;
  DL_RETURN_IF_ERROR(std::exchange(status_, Status::Ok()));
  *result = std::move(result_);
  return Status::Ok();
}

void CpuRunner::Resize(Act a, int64_t rows, int64_t width) {
  Slot& s = slot(a);
  s.width = width;
  s.data.assign(static_cast<size_t>(rows * width), 0.0f);
}

Status CpuRunner::Embed(const WeightRef& table) {
  const int64_t d = cfg_.hidden_size, n = batch_->num_rows();
  // A vocab-parallel slice holds rows [embed_vocab_begin, + rows): other tokens' rows are -0 here and
  // come from their rank through the all-reduce, which sums from rank 0's value in rank order. -0 is
  // the exact identity, x + (-0) = x for every x; +0 would turn a table's -0 into +0 (-0 + +0 = +0),
  // so with it the two embedding modes could differ in a zero's sign.
  residual_.assign(static_cast<size_t>(n * d), weights_.embed_vocab_parallel ? -0.0f : 0.0f);
  const int64_t first = weights_.embed_vocab_begin, held = table.rows();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tok = batch_->tokens[i] - first;
    if (tok < 0 || tok >= held) continue;
    for (int64_t j = 0; j < d; ++j) residual_[i * d + j] = cpu::WeightAt(table, tok * d + j);
  }
  return Status::Ok();
}

Status CpuRunner::AddRmsNorm(const WeightRef& weight, bool add_delta) {
  const int64_t d = cfg_.hidden_size, n = batch_->num_rows();
  if (add_delta) {
    const float* delta = slot(Act::kDelta).data.data();
    for (int64_t i = 0; i < n * d; ++i) residual_[i] += delta[i];
  }
  Resize(Act::kNormed, n, d);
  for (int64_t i = 0; i < n; ++i) {
    RmsNorm(residual_.data() + i * d, weight, d, static_cast<float>(cfg_.rms_norm_eps),
            slot(Act::kNormed).row(i));
  }
  return Status::Ok();
}

Status CpuRunner::Linear(const LinearWeights& w, Act in, Act out) {
  Slot& x = slot(in);
  if (x.width != w.in()) {
    return Internal("linear {}: input width {} against the weight's {}", w.parts[0].name, x.width, w.in());
  }
  const int64_t rows = static_cast<int64_t>(x.data.size()) / std::max<int64_t>(x.width, 1);
  Resize(out, rows, w.out());
  Slot& y = slot(out);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (const WeightRef& part : w.parts) {
      if (part.dtype == DType::kF8E4M3 && part.scales == nullptr) {
        return Internal("linear {}: FP8 weight without scales", part.name);
      }
      MatVec(part, x.row(r), y.row(r) + off);
      off += part.rows();
    }
  }
  return Status::Ok();
}

Status CpuRunner::QkNormRopeAppend(int32_t l, const LagunaLayerWeights& lw) {
  const int64_t D = cfg_.head_dim, H = local_heads(l), K = local_kv_heads(l);
  const bool sliding = cfg_.is_sliding(l);
  const RopeTable& rope = sliding ? rope_sliding_ : rope_full_;
  const int64_t R = rope.rotary_dim, half = R / 2;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const KvGroup group = sliding ? KvGroup::kSliding : KvGroup::kFull;
  Slot& qkvg = slot(Act::kQkvg);
  const int64_t n = batch_->num_rows();
  q_.assign(static_cast<size_t>(n * H * D), 0.0f);
  std::vector<float> k(K * D), v(K * D), cos_t(half), sin_t(half);
  for (const BatchSequence& s : batch_->seqs) {
    const auto& table = s.kv->block_table(group);
    for (int32_t r = s.first_row; r < s.first_row + s.num_rows; ++r) {
      const float* row = qkvg.row(r);
      std::copy(row, row + H * D, q_.begin() + r * H * D);
      std::copy(row + H * D, row + (H + K) * D, k.begin());
      std::copy(row + (H + K) * D, row + (H + 2 * K) * D, v.begin());
      // QK-norm per head (one [D] weight per layer), then half-split partial RoPE on the first R dims.
      const float p = static_cast<float>(positions_[r]);
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
        float* qh = q_.data() + (r * H + hh) * D;
        RmsNorm(qh, lw.q_norm, D, eps, qh);
        rotate(qh);
      }
      for (int64_t kh = 0; kh < K; ++kh) {
        float* kk = k.data() + kh * D;
        RmsNorm(kk, lw.k_norm, D, eps, kk);
        rotate(kk);
      }
      if (observer_) observer_->Observe(l, k.data(), v.data(), 1);
      storage_.Write(l, LocatePosition(table, kv_spec_.page_size, positions_[r]), k.data(), v.data());
    }
  }
  return Status::Ok();
}

Status CpuRunner::Attention(int32_t l) {
  // This rank's heads: its H/tp query heads use its K/tp KV heads in groups of H/K as on one rank,
  // or, when tp > K, all use the one KV head the rank holds (G = H/tp then).
  const int64_t D = cfg_.head_dim, H = local_heads(l), K = local_kv_heads(l);
  const int64_t G = H / K;
  const bool sliding = cfg_.is_sliding(l);
  const KvGroup group = sliding ? KvGroup::kSliding : KvGroup::kFull;
  const int64_t n = batch_->num_rows();
  Slot& qkvg = slot(Act::kQkvg);
  Resize(Act::kAttention, n, H * D);
  // Scores over the visible keys, read back from the cache (so quantised KV is what attention sees).
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> kbuf(K * D), vbuf(K * D);
  for (const BatchSequence& s : batch_->seqs) {
    const auto& table = s.kv->block_table(group);
    for (int32_t r = s.first_row; r < s.first_row + s.num_rows; ++r) {
      const int32_t p = positions_[r];
      const int32_t first = sliding ? std::max(0, p - static_cast<int32_t>(cfg_.sliding_window) + 1) : 0;
      const int32_t count = p - first + 1;
      std::vector<float> keys(static_cast<size_t>(count) * K * D), vals(keys.size());
      for (int32_t j = first; j <= p; ++j) {
        storage_.Read(l, LocatePosition(table, kv_spec_.page_size, j), kbuf.data(), vbuf.data());
        std::copy(kbuf.begin(), kbuf.end(), keys.begin() + (j - first) * K * D);
        std::copy(vbuf.begin(), vbuf.end(), vals.begin() + (j - first) * K * D);
      }
      float* attn = slot(Act::kAttention).row(r);
      std::vector<float> scores(count);
      for (int64_t hh = 0; hh < H; ++hh) {
        const int64_t kv_head = hh / G;
        const float* qh = q_.data() + (r * H + hh) * D;
        float max_score = -INFINITY;
        for (int32_t j = 0; j < count; ++j) {
          const float* ks = keys.data() + (j * K + kv_head) * D;
          float dot = 0.0f;
          for (int64_t e = 0; e < D; ++e) dot += qh[e] * ks[e];
          scores[j] = dot * scale;
          max_score = std::max(max_score, scores[j]);
        }
        float denom = 0.0f;
        for (int32_t j = 0; j < count; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          denom += scores[j];
        }
        float* out = attn + hh * D;
        std::fill(out, out + D, 0.0f);
        for (int32_t j = 0; j < count; ++j) {
          const float pr = scores[j] / denom;
          const float* vs = vals.data() + (j * K + kv_head) * D;
          for (int64_t e = 0; e < D; ++e) out[e] += pr * vs[e];
        }
      }
      // Softplus output gate from the attention input's projection (per head or per element).
      const float* gi = qkvg.row(r) + (H + 2 * K) * D;
      for (int64_t hh = 0; hh < H; ++hh) {
        for (int64_t e = 0; e < D; ++e) {
          const float gv = cfg_.gating == GatingKind::kPerHead ? gi[hh] : gi[hh * D + e];
          attn[hh * D + e] *= cpu::Softplus(gv);
        }
      }
    }
  }
  return Status::Ok();
}

Status CpuRunner::SiluMul() {
  Slot& gu = slot(Act::kGateUp);
  const int64_t f = gu.width / 2;
  const int64_t n = static_cast<int64_t>(gu.data.size()) / std::max<int64_t>(gu.width, 1);
  Resize(Act::kHidden, n, f);
  for (int64_t r = 0; r < n; ++r) {
    const float* g = gu.row(r);
    float* h = slot(Act::kHidden).row(r);
    for (int64_t j = 0; j < f; ++j) h[j] = cpu::Silu(g[j]) * g[f + j];
  }
  return Status::Ok();
}

void CpuRunner::SwiGlu(const WeightRef& gate, const WeightRef& up, const WeightRef& down, const float* x,
                       float* y) {
  const int64_t f = gate.rows();
  std::vector<float> a(f), b(f);
  MatVec(gate, x, a.data());
  MatVec(up, x, b.data());
  for (int64_t j = 0; j < f; ++j) a[j] = cpu::Silu(a[j]) * b[j];
  MatVec(down, a.data(), y);
}

Status CpuRunner::Moe(int32_t /*layer*/, const MoeWeights& w) {
  const int64_t d = cfg_.hidden_size, n = batch_->num_rows();
  const int64_t E = cfg_.num_experts, topk = cfg_.num_experts_per_tok;
  Resize(Act::kDelta, n, d);
  std::vector<float> z(E), s(E), biased(E), tmp(d);
  for (int64_t r = 0; r < n; ++r) {
    const float* u = slot(Act::kNormed).row(r);
    float* y = slot(Act::kDelta).row(r);
    MatVec(w.router, u, z.data());
    const float cap = static_cast<float>(cfg_.moe_router_logit_softcapping);
    for (int64_t e = 0; e < E; ++e) {
      if (cap > 0.0f) z[e] = cap * std::tanh(z[e] / cap);
      s[e] = cpu::Sigmoid(z[e]);
      biased[e] = s[e] + cpu::WeightAt(w.correction_bias, e);
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
    std::fill(y, y + d, 0.0f);
    for (int64_t e : chosen) {
      const float weight = s[e] / sum;
      SwiGlu(w.gate[e], w.up[e], w.down[e], u, tmp.data());
      for (int64_t j = 0; j < d; ++j) y[j] += tmp[j] * weight;
    }
    const float alpha = static_cast<float>(cfg_.moe_routed_scaling_factor);
    SwiGlu(w.shared_gate, w.shared_up, w.shared_down, u, tmp.data());
    for (int64_t j = 0; j < d; ++j) y[j] = y[j] * alpha + tmp[j];
  }
  return Status::Ok();
}

Status CpuRunner::TapHidden(int32_t tap) {
  const float* delta = slot(Act::kDelta).data.data();
  std::vector<float>& h = result_.hidden[tap];
  h.resize(residual_.size());
  for (size_t i = 0; i < residual_.size(); ++i) h[i] = residual_[i] + delta[i];
  return Status::Ok();
}

Status CpuRunner::OutputNorm(const WeightRef& weight) {
  const int64_t d = cfg_.hidden_size;
  const float* delta = slot(Act::kDelta).data.data();
  for (size_t i = 0; i < residual_.size(); ++i) residual_[i] += delta[i];
  Resize(Act::kOutputNormed, static_cast<int64_t>(batch_->outputs.size()), d);
  for (size_t o = 0; o < batch_->outputs.size(); ++o) {
    RmsNorm(residual_.data() + batch_->outputs[o].row * d, weight, d,
            static_cast<float>(cfg_.rms_norm_eps), slot(Act::kOutputNormed).row(static_cast<int64_t>(o)));
  }
  return Status::Ok();
}

namespace {

// One output row's result from its whole [vocab] logits (the single-rank rule).
void FinishRow(const float* row, int vocab, const OutputRequest& req, RowResult& out) {
  if (req.want_logits) out.logits.assign(row, row + vocab);
  bool finite = true;
  if (req.sample) {
    out.token = kernels::ref::SampleRow(row, vocab, req.sampling, &finite);
  } else {
    for (int i = 0; i < vocab; ++i) finite = finite && std::isfinite(row[i]);
  }
  out.finite = finite;
}

}  // namespace

Status CpuRunner::SelectTokens() {
  Slot& logits = slot(Act::kLogits);
  if (comm_ == nullptr) {
    const int vocab = static_cast<int>(logits.width);
    for (size_t o = 0; o < batch_->outputs.size(); ++o) {
      FinishRow(logits.row(static_cast<int64_t>(o)), vocab, batch_->outputs[o], result_.rows[o]);
    }
    return Status::Ok();
  }
  // Vocab-parallel logits: this rank holds ids [first, first + held) of every output row. Rows whose
  // raw logits come back, or that sample (top-k/top-p need the whole distribution), gather the whole
  // row; greedy rows (and rows asking only whether the logits are finite) take the distributed argmax
  // (one candidate per rank): no full-logit gather.
  const int64_t held = logits.width, first = weights_.lm_head_vocab_begin;
  const int vocab = static_cast<int>(cfg_.vocab_size);
  const auto& outs = batch_->outputs;
  std::vector<size_t> whole_rows, argmax_rows;
  for (size_t o = 0; o < outs.size(); ++o) {
    const bool whole = outs[o].want_logits || (outs[o].sample && !outs[o].sampling.greedy());
    (whole ? whole_rows : argmax_rows).push_back(o);
  }
  if (!argmax_rows.empty()) {
    std::vector<comm::ArgmaxCandidate> local(argmax_rows.size());
    std::vector<float> row(static_cast<size_t>(held));
    for (size_t i = 0; i < argmax_rows.size(); ++i) {
      const OutputRequest& req = outs[argmax_rows[i]];
      const float* l = logits.row(static_cast<int64_t>(argmax_rows[i]));
      row.assign(l, l + held);
      comm::ArgmaxCandidate& c = local[i];
      for (float x : row) c.finite = c.finite && std::isfinite(x);
      // The row's adjustments that fall in this slice (kernels/sampling.h: applied before the argmax).
      for (const LogitAdjustment& a : req.sampling.adjustments) {
        if (a.token >= first && a.token < first + held) row[a.token - first] = kernels::AdjustedLogit(row[a.token - first], a);
      }
      int64_t best = -1;
      for (int64_t j = 0; j < held; ++j) {
        if (best < 0 || row[j] > row[best]) best = j;
      }
      if (best >= 0) {
        c.value = row[best];
        c.index = static_cast<int32_t>(first + best);
      }
    }
    DL_ASSIGN_OR_RETURN(auto chosen, comm::DistributedArgmax(*comm_, local));
    for (size_t i = 0; i < argmax_rows.size(); ++i) {
      RowResult& out = result_.rows[argmax_rows[i]];
      out.finite = chosen[i].finite != 0;
      if (outs[argmax_rows[i]].sample) out.token = std::max(chosen[i].index, 0);
    }
  }
  if (!whole_rows.empty()) {
    const int64_t n = static_cast<int64_t>(whole_rows.size());
    std::vector<float> local(static_cast<size_t>(n * held));
    for (int64_t i = 0; i < n; ++i) {
      const float* l = logits.row(static_cast<int64_t>(whole_rows[i]));
      std::copy(l, l + held, local.begin() + i * held);
    }
    std::vector<int64_t> counts;
    for (const Slice& v : lm_head_slices_) counts.push_back(n * v.size);
    DL_ASSIGN_OR_RETURN(std::vector<float> all, comm::AllGatherFloats(*comm_, local, counts));
    // all: rank-major, rank r's [n, V_r] block; reassemble each row over the whole vocabulary.
    std::vector<float> row(static_cast<size_t>(vocab));
    for (int64_t i = 0; i < n; ++i) {
      int64_t offset = 0;
      for (const Slice& v : lm_head_slices_) {
        std::copy_n(all.begin() + offset + i * v.size, v.size, row.begin() + v.begin);
        offset += n * v.size;
      }
      FinishRow(row.data(), vocab, outs[whole_rows[i]], result_.rows[whole_rows[i]]);
    }
  }
  return Status::Ok();
}

Status CpuRunner::AllReduce(PartialSum what) {
  if (comm_ == nullptr) return Status::Ok();  // one rank: nothing is partial
  std::vector<float>& data = what == PartialSum::kEmbedding ? residual_ : slot(Act::kDelta).data;
  return comm_->AllReduceSum(data);
}

}  // namespace dl
