#include "model/weight_shard.h"

#include <cstring>

#include <fmt/format.h>

namespace dl {

WeightRef RowSlice(const WeightRef& w, Slice rows) {
  if (rows.begin == 0 && rows.size == w.rows()) return w;
  WeightRef s = w;
  s.name = fmt::format("{}[rows {}:{}]", w.name, rows.begin, rows.end());
  s.shape[0] = rows.size;
  s.data = static_cast<const uint8_t*>(w.data) + rows.begin * w.cols() * DTypeSize(w.dtype);
  return s;
}

namespace {

// Columns [cols.begin, cols.end()) of a matrix, copied (a view when it is every column).
WeightRef ColumnSlice(const WeightRef& w, Slice cols, HostWeightShard* shard) {
  if (cols.begin == 0 && cols.size == w.cols()) return w;
  const size_t elem = DTypeSize(w.dtype);
  std::vector<uint8_t>& buf = shard->owned.emplace_back(static_cast<size_t>(w.rows() * cols.size) * elem);
  const uint8_t* src = static_cast<const uint8_t*>(w.data);
  for (int64_t r = 0; r < w.rows(); ++r) {
    std::memcpy(buf.data() + r * cols.size * elem, src + (r * w.cols() + cols.begin) * elem, cols.size * elem);
  }
  WeightRef s = w;
  s.name = fmt::format("{}[cols {}:{}]", w.name, cols.begin, cols.end());
  s.shape = {w.rows(), cols.size};
  s.data = buf.data();
  return s;
}

Slice Times(Slice s, int64_t f) { return {s.begin * f, s.size * f}; }

Status CheckUnquantised(const WeightRef& w) {
  if (w.scales != nullptr) {
    return Unimplemented("{}: tensor parallelism over quantised (scaled) weights is not built", w.name);
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<HostWeightShard>> ShardHostWeights(const ModelConfig& c, const LagunaWeights& full,
                                                          const TensorParallelPlan& plan, int rank) {
  if (rank < 0 || rank >= plan.tp_size) {
    return InvalidArgument("rank {} outside the plan's {} ranks", rank, plan.tp_size);
  }
  if (static_cast<int64_t>(full.layers.size()) != c.num_hidden_layers) {
    return Internal("{} layers of weights for a config of {}", full.layers.size(), c.num_hidden_layers);
  }
  const RankShard& rs = plan.ranks[rank];
  const int64_t D = c.head_dim;
  auto shard = std::make_unique<HostWeightShard>();
  shard->rank = rank;
  LagunaWeights& w = shard->weights;
  DL_RETURN_IF_ERROR(CheckUnquantised(full.embed));
  w.embed = RowSlice(full.embed, rs.embed_vocab);
  w.embed_vocab_begin = rs.embed_vocab.begin;
  w.embed_vocab_parallel = rs.embed_vocab.size != c.vocab_size;
  w.final_norm = full.final_norm;
  if (full.lm_head.parts.size() != 1) return Internal("LM head expected as one matrix");
  DL_RETURN_IF_ERROR(CheckUnquantised(full.lm_head.parts[0]));
  w.lm_head.parts = {RowSlice(full.lm_head.parts[0], rs.lm_head_vocab)};
  w.lm_head_vocab_begin = rs.lm_head_vocab.begin;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LagunaLayerWeights& F = full.layers[l];
    const LayerShard& ls = rs.layers[l];
    LagunaLayerWeights L;
    L.input_norm = F.input_norm;
    L.post_attn_norm = F.post_attn_norm;
    L.q_norm = F.q_norm;
    L.k_norm = F.k_norm;
    if (F.qkvg.parts.size() != 4 || F.o.parts.size() != 1) {
      return Internal("layer {}: attention weights expected as q, k, v, g and o", l);
    }
    for (const WeightRef& p : F.qkvg.parts) DL_RETURN_IF_ERROR(CheckUnquantised(p));
    DL_RETURN_IF_ERROR(CheckUnquantised(F.o.parts[0]));
    L.qkvg.parts = {RowSlice(F.qkvg.parts[0], Times(ls.q_heads, D)), RowSlice(F.qkvg.parts[1], Times(ls.kv_heads, D)),
                    RowSlice(F.qkvg.parts[2], Times(ls.kv_heads, D)), RowSlice(F.qkvg.parts[3], ls.gate_rows)};
    L.o.parts = {ColumnSlice(F.o.parts[0], Times(ls.q_heads, D), shard.get())};
    if (c.is_sparse(l)) {
      const MoeWeights& M = F.moe;
      MoeWeights& m = L.moe;
      m.router = M.router;
      m.correction_bias = M.correction_bias;
      for (size_t e = 0; e < M.gate.size(); ++e) {
        DL_RETURN_IF_ERROR(CheckUnquantised(M.gate[e]));
        DL_RETURN_IF_ERROR(CheckUnquantised(M.up[e]));
        DL_RETURN_IF_ERROR(CheckUnquantised(M.down[e]));
        m.gate.push_back(RowSlice(M.gate[e], ls.expert_ff));
        m.up.push_back(RowSlice(M.up[e], ls.expert_ff));
        m.down.push_back(ColumnSlice(M.down[e], ls.expert_ff, shard.get()));
      }
      m.shared_gate = RowSlice(M.shared_gate, ls.shared_ff);
      m.shared_up = RowSlice(M.shared_up, ls.shared_ff);
      m.shared_down = ColumnSlice(M.shared_down, ls.shared_ff, shard.get());
    } else {
      if (F.mlp_gate_up.parts.size() != 2 || F.mlp_down.parts.size() != 1) {
        return Internal("layer {}: dense MLP expected as gate, up and down", l);
      }
      for (const WeightRef& p : F.mlp_gate_up.parts) DL_RETURN_IF_ERROR(CheckUnquantised(p));
      DL_RETURN_IF_ERROR(CheckUnquantised(F.mlp_down.parts[0]));
      L.mlp_gate_up.parts = {RowSlice(F.mlp_gate_up.parts[0], ls.dense_ff),
                             RowSlice(F.mlp_gate_up.parts[1], ls.dense_ff)};
      L.mlp_down.parts = {ColumnSlice(F.mlp_down.parts[0], ls.dense_ff, shard.get())};
    }
    w.layers.push_back(std::move(L));
  }
  return shard;
}

}  // namespace dl
