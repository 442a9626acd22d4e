#include "model/shard_plan.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace dl {

const char* EmbeddingModeName(EmbeddingMode m) {
  return m == EmbeddingMode::kVocabParallel ? "vocab-parallel" : "replicated";
}

Result<EmbeddingMode> ParseEmbeddingMode(std::string_view name) {
  if (name == "vocab-parallel") return EmbeddingMode::kVocabParallel;
  if (name == "replicated") return EmbeddingMode::kReplicated;
  return InvalidArgument("--embedding must be vocab-parallel or replicated (got \"{}\")", name);
}

Slice SplitEvenly(int64_t n, int parts, int index) {
  const int64_t base = n / parts, extra = n % parts;
  Slice s;
  s.begin = index * base + std::min<int64_t>(index, extra);
  s.size = base + (index < extra ? 1 : 0);
  return s;
}

int64_t TensorParallelPlan::AllReducesPerForward(int64_t num_layers) const {
  if (tp_size == 1) return 0;
  return 2 * num_layers + (embedding == EmbeddingMode::kVocabParallel ? 1 : 0);
}

Result<TensorParallelPlan> MakeTensorParallelPlan(const ModelConfig& c, int tp, EmbeddingMode embedding) {
  if (tp < 1) return InvalidArgument("--tp must be at least 1 (got {})", tp);
  const int64_t K = c.num_key_value_heads, D = c.head_dim, L = c.num_hidden_layers;
  // KV heads: split when K divides; replicated over groups of tp/K ranks when tp is a multiple of K
  // (the rank's query heads then all use one KV head); anything else would give a rank query heads
  // of a KV head it does not hold.
  if (K % tp != 0 && tp % K != 0) {
    return InvalidArgument(
        "tensor parallel {}: the {} KV heads neither divide among {} ranks nor does {} divide into "
        "groups of them (use a tp that divides {} or is a multiple of it)",
        tp, K, tp, tp, K);
  }
  for (int64_t l = 0; l < L; ++l) {
    const int64_t H = c.heads(l);
    if (H % tp != 0) {
      return InvalidArgument(
          "tensor parallel {}: layer {} ({} attention) has {} query heads, which do not divide "
          "among {} ranks",
          tp, l, c.is_sliding(l) ? "sliding" : "full", H, tp);
    }
  }
  TensorParallelPlan plan;
  plan.tp_size = tp;
  plan.embedding = embedding;
  for (int r = 0; r < tp; ++r) {
    RankShard rs;
    rs.rank = r;
    for (int64_t l = 0; l < L; ++l) {
      LayerShard ls;
      const int64_t H = c.heads(l), per_rank = H / tp;
      ls.q_heads = {r * per_rank, per_rank};
      ls.kv_heads = K >= tp ? SplitEvenly(K, tp, r) : Slice{r / (tp / K), 1};
      ls.gate_rows = c.gating == GatingKind::kPerHead ? ls.q_heads
                                                       : Slice{ls.q_heads.begin * D, ls.q_heads.size * D};
      if (c.is_sparse(l)) {
        ls.expert_ff = SplitEvenly(c.moe_intermediate_size, tp, r);
        ls.shared_ff = SplitEvenly(c.shared_expert_intermediate_size, tp, r);
      } else {
        ls.dense_ff = SplitEvenly(c.intermediate_size, tp, r);
      }
      rs.layers.push_back(ls);
    }
    rs.lm_head_vocab = SplitEvenly(c.vocab_size, tp, r);
    rs.embed_vocab = embedding == EmbeddingMode::kReplicated ? Slice{0, c.vocab_size} : rs.lm_head_vocab;
    plan.ranks.push_back(std::move(rs));
  }
  return plan;
}

ModelConfig RankModelConfig(const ModelConfig& c, const TensorParallelPlan& plan, int rank) {
  ModelConfig r = c;
  if (plan.tp_size == 1) return r;
  const RankShard& rs = plan.ranks[static_cast<size_t>(rank)];
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerShard& ls = rs.layers[static_cast<size_t>(l)];
    r.num_attention_heads_per_layer[static_cast<size_t>(l)] = ls.q_heads.size;
    r.num_key_value_heads = ls.kv_heads.size;  // the same in every layer (MakeTensorParallelPlan)
  }
  r.num_attention_heads = c.num_attention_heads / plan.tp_size;
  // The plan's widths, whichever layers use them.
  r.intermediate_size = SplitEvenly(c.intermediate_size, plan.tp_size, rank).size;
  r.moe_intermediate_size = SplitEvenly(c.moe_intermediate_size, plan.tp_size, rank).size;
  r.shared_expert_intermediate_size = SplitEvenly(c.shared_expert_intermediate_size, plan.tp_size, rank).size;
  return r;
}

RankReadBytes ReadBytesPerForward(const ModelConfig& c, const TensorParallelPlan& plan, int rank,
                                  double distinct_experts, int64_t bytes) {
  const RankShard& rs = plan.ranks[rank];
  const int64_t d = c.hidden_size, D = c.head_dim;
  RankReadBytes b;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerShard& ls = rs.layers[l];
    const int64_t qkvg_rows = (ls.q_heads.size + 2 * ls.kv_heads.size) * D + ls.gate_rows.size;
    b.attention += (qkvg_rows * d + d * ls.q_heads.size * D) * bytes;
    if (c.is_sparse(l)) {
      b.routed_experts += static_cast<int64_t>(std::llround(distinct_experts * 3.0 * static_cast<double>(
                                                                ls.expert_ff.size * d * bytes)));
      b.shared_experts += 3 * ls.shared_ff.size * d * bytes;
      b.routers += c.num_experts * d * bytes;  // replicated: every rank chooses the same experts
    } else {
      b.dense_mlp += 3 * ls.dense_ff.size * d * bytes;
    }
  }
  b.lm_head = rs.lm_head_vocab.size * d * bytes;
  b.embedding = d * bytes;  // one row per token (held by one rank when vocab-parallel)
  return b;
}

double ExpectedDistinctExperts(int64_t num_experts, int64_t top_k, int64_t tokens) {
  const double E = static_cast<double>(num_experts);
  return E * (1.0 - std::pow(1.0 - static_cast<double>(top_k) / E, static_cast<double>(tokens)));
}

std::string DescribeTensorParallelPlan(const ModelConfig& c, const TensorParallelPlan& plan) {
  std::string out = fmt::format(
      "tensor parallel {}: attention by head (q/k/v/g column-, o_proj row-parallel), MLP and experts "
      "by intermediate width, LM head vocab-parallel, embedding {}; {} all-reduces per forward\n",
      plan.tp_size, EmbeddingModeName(plan.embedding), plan.AllReducesPerForward(c.num_hidden_layers));
  for (const RankShard& rs : plan.ranks) {
    // One line per distinct layer kind (full/sliding x dense/sparse), at its first layer.
    std::vector<std::string> seen;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const LayerShard& ls = rs.layers[l];
      const std::string kind = fmt::format("{} {}", c.is_sliding(l) ? "sliding" : "full",
                                           c.is_sparse(l) ? "sparse" : "dense");
      if (std::find(seen.begin(), seen.end(), kind) != seen.end()) continue;
      seen.push_back(kind);
      std::string mlp =
          c.is_sparse(l)
              ? fmt::format("expert_ff={} [{}, {}) shared_ff={} [{}, {})", ls.expert_ff.size,
                            ls.expert_ff.begin, ls.expert_ff.end(), ls.shared_ff.size, ls.shared_ff.begin,
                            ls.shared_ff.end())
              : fmt::format("dense_ff={} [{}, {})", ls.dense_ff.size, ls.dense_ff.begin, ls.dense_ff.end());
      out += fmt::format(
          "  rank {}: {:<14} (from layer {}): q={} heads [{}, {}) kv={} heads [{}, {}) of {} "
          "g_rows={} o_cols={} {}\n",
          rs.rank, kind, l, ls.q_heads.size, ls.q_heads.begin, ls.q_heads.end(), ls.kv_heads.size,
          ls.kv_heads.begin, ls.kv_heads.end(), c.head_dim, ls.gate_rows.size, ls.q_heads.size * c.head_dim,
          mlp);
    }
    out += fmt::format("  rank {}: lm_head vocab [{}, {}) ({} rows), embedding rows [{}, {})\n", rs.rank,
                       rs.lm_head_vocab.begin, rs.lm_head_vocab.end(), rs.lm_head_vocab.size,
                       rs.embed_vocab.begin, rs.embed_vocab.end());
  }
  return out;
}

}  // namespace dl
