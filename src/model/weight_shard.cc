#include "model/weight_shard.h"

#include <cstring>

#include <fmt/format.h>

namespace dl {

namespace {

// Block index range [first, last] of elements [begin, begin + size) along a dimension cut into blocks
// of `block` (FP8 scales, weights.h): a slice keeps its scales when it starts on a block boundary or
// lies inside one block; otherwise its rows or columns would need scales the checkpoint does not have.
struct BlockRange {
  int64_t first = 0, count = 0, block = 0;  // the slice's blocks and its block size
};
Result<BlockRange> SliceBlocks(const WeightRef& w, Slice s, int64_t block, const char* dim) {
  const int64_t b = std::max<int64_t>(block, 1);
  const int64_t first = s.begin / b, last = (s.end() - 1) / b;
  if (s.begin % b == 0) return BlockRange{first, last - first + 1, b};  // index i -> block first + i / b
  if (first != last) {
    return Unimplemented("{}: {} {}:{} of an FP8 weight with {}-wide scale blocks: a slice must start on a block "
                         "boundary or lie inside one block",
                         w.name, dim, s.begin, s.end(), b);
  }
  return BlockRange{first, 1, s.size};  // inside one block: one block as wide as the slice
}

}  // namespace

Result<WeightRef> RowSlice(const WeightRef& w, Slice rows) {
  if (rows.begin == 0 && rows.size == w.rows()) return w;
  WeightRef s = w;
  s.name = fmt::format("{}[rows {}:{}]", w.name, rows.begin, rows.end());
  s.shape[0] = rows.size;
  s.data = static_cast<const uint8_t*>(w.data) + rows.begin * w.cols() * DTypeSize(w.dtype);
  if (w.scales != nullptr) {  // the scale rows of the slice's blocks: a view too
    DL_ASSIGN_OR_RETURN(const BlockRange br, SliceBlocks(w, rows, w.block_rows, "rows"));
    const int64_t scale_cols = (w.cols() + w.block_cols - 1) / w.block_cols;
    s.scales = w.scales + br.first * scale_cols;
    s.block_rows = br.block;
  }
  return s;
}

namespace {

// Columns [cols.begin, cols.end()) of a matrix, copied (a view when it is every column); an FP8
// weight's scale columns of the slice's blocks are copied the same way.
Result<WeightRef> ColumnSlice(const WeightRef& w, Slice cols, HostWeightShard* shard) {
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
  if (w.scales != nullptr) {
    DL_ASSIGN_OR_RETURN(const BlockRange bc, SliceBlocks(w, cols, w.block_cols, "columns"));
    const int64_t scale_rows = (w.rows() + w.block_rows - 1) / w.block_rows;
    const int64_t scale_cols = (w.cols() + w.block_cols - 1) / w.block_cols;
    std::vector<uint8_t>& sb = shard->owned.emplace_back(static_cast<size_t>(scale_rows * bc.count) * sizeof(float));
    for (int64_t r = 0; r < scale_rows; ++r) {
      std::memcpy(sb.data() + r * bc.count * sizeof(float), w.scales + r * scale_cols + bc.first,
                  bc.count * sizeof(float));
    }
    s.scales = reinterpret_cast<const float*>(sb.data());
    s.block_cols = bc.block;
  }
  return s;
}

Slice Times(Slice s, int64_t f) { return {s.begin * f, s.size * f}; }


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
  // FP8 weights are cut with their scales (a slice must start on a scale block's boundary or lie in
  // one block: every per-rank width of Laguna's shapes is a multiple of 128, and per-tensor and
  // per-channel scales cut anywhere); the embedding and LM head are never FP8.
  DL_ASSIGN_OR_RETURN(w.embed, RowSlice(full.embed, rs.embed_vocab));
  w.embed_vocab_begin = rs.embed_vocab.begin;
  w.embed_vocab_parallel = rs.embed_vocab.size != c.vocab_size;
  w.final_norm = full.final_norm;
  if (full.lm_head.parts.size() != 1) return Internal("LM head expected as one matrix");
  DL_ASSIGN_OR_RETURN(WeightRef lm_head, RowSlice(full.lm_head.parts[0], rs.lm_head_vocab));
  w.lm_head.parts = {std::move(lm_head)};
  w.lm_head_vocab_begin = rs.lm_head_vocab.begin;
  auto rows = [](const WeightRef& m, Slice r) { return RowSlice(m, r); };
  auto cols = [&](const WeightRef& m, Slice r) { return ColumnSlice(m, r, shard.get()); };
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
    const Slice parts[4] = {Times(ls.q_heads, D), Times(ls.kv_heads, D), Times(ls.kv_heads, D), ls.gate_rows};
    for (int i = 0; i < 4; ++i) {
      DL_ASSIGN_OR_RETURN(WeightRef part, rows(F.qkvg.parts[i], parts[i]));
      L.qkvg.parts.push_back(std::move(part));
    }
    DL_ASSIGN_OR_RETURN(WeightRef o, cols(F.o.parts[0], Times(ls.q_heads, D)));
    L.o.parts = {std::move(o)};
    if (c.is_sparse(l)) {
      const MoeWeights& M = F.moe;
      MoeWeights& m = L.moe;
      m.router = M.router;
      m.correction_bias = M.correction_bias;
      for (size_t e = 0; e < M.gate.size(); ++e) {
        DL_ASSIGN_OR_RETURN(WeightRef gate, rows(M.gate[e], ls.expert_ff));
        DL_ASSIGN_OR_RETURN(WeightRef up, rows(M.up[e], ls.expert_ff));
        DL_ASSIGN_OR_RETURN(WeightRef down, cols(M.down[e], ls.expert_ff));
        m.gate.push_back(std::move(gate));
        m.up.push_back(std::move(up));
        m.down.push_back(std::move(down));
      }
      DL_ASSIGN_OR_RETURN(m.shared_gate, rows(M.shared_gate, ls.shared_ff));
      DL_ASSIGN_OR_RETURN(m.shared_up, rows(M.shared_up, ls.shared_ff));
      DL_ASSIGN_OR_RETURN(m.shared_down, cols(M.shared_down, ls.shared_ff));
    } else {
      if (F.mlp_gate_up.parts.size() != 2 || F.mlp_down.parts.size() != 1) {
        return Internal("layer {}: dense MLP expected as gate, up and down", l);
      }
      for (int i = 0; i < 2; ++i) {
        DL_ASSIGN_OR_RETURN(WeightRef part, rows(F.mlp_gate_up.parts[i], ls.dense_ff));
        L.mlp_gate_up.parts.push_back(std::move(part));
      }
      DL_ASSIGN_OR_RETURN(WeightRef down, cols(F.mlp_down.parts[0], ls.dense_ff));
      L.mlp_down.parts = {std::move(down)};
    }
    w.layers.push_back(std::move(L));
  }
  return shard;
}

}  // namespace dl
