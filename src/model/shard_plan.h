// Tensor parallelism: which part of every weight each of tp ranks holds (docs/tensor-parallel.md).
// A pure function of the config and tp, so it is unit-tested without any backend and printed by
// `inspect`; the backends slice their weights from it.
//
//   attention  q/k/v/g rows column-parallel by head (each rank: H_l/tp query heads and their KV
//              heads; when tp > K a KV head is held by the tp/K ranks whose query heads use it),
//              o_proj row-parallel (the rank's H_l/tp * D input columns), then one all-reduce;
//   dense MLP  gate/up rows and down columns split over F_d, then one all-reduce;
//   MoE        every expert split over its intermediate width F_e (and the shared expert over F_s):
//              every rank runs the same replicated router and the same top-k, reads 1/tp of each
//              chosen expert, then one all-reduce (by width, not by expert: see the doc's bytes);
//   LM head    vocab-parallel rows, greedy by a distributed argmax;
//   embedding  vocab-parallel rows (one all-reduce) or replicated (no collective).
// Head counts that do not divide are refused naming the layer; widths and the vocabulary need not
// divide: they are split unevenly (sizes differ by at most one, the larger slices first).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "model/config.h"

namespace dl {

enum class EmbeddingMode : uint8_t {
  kVocabParallel,  // rank r holds rows [v0, v1) of the table; the embedding is one all-reduce
  kReplicated,     // every rank holds the whole table; no collective
};
const char* EmbeddingModeName(EmbeddingMode m);  // "vocab-parallel", "replicated"
Result<EmbeddingMode> ParseEmbeddingMode(std::string_view name);

// A contiguous part [begin, begin + size) of one dimension.
struct Slice {
  int64_t begin = 0;
  int64_t size = 0;
  int64_t end() const { return begin + size; }
  bool operator==(const Slice&) const = default;
};

// Part `index` of `n` split into `parts` contiguous slices whose sizes differ by at most one (the
// first n % parts slices are one larger). Never refuses: a part may be empty when n < parts.
Slice SplitEvenly(int64_t n, int parts, int index);

struct LayerShard {
  Slice q_heads;    // query heads; q rows = q_heads * D, o_proj input columns the same
  Slice kv_heads;   // KV heads held (k and v rows = kv_heads * D); cache heads of this rank
  Slice gate_rows;  // g_proj rows: q_heads (per-head gate) or q_heads * D (per-element)
  Slice dense_ff;   // dense layers: rows of gate and up, columns of down (of F_d); sparse: empty
  Slice expert_ff;  // sparse layers: rows of every expert's gate and up, columns of its down (of F_e)
  Slice shared_ff;  // sparse layers: the shared expert's (of F_s)
};

struct RankShard {
  int rank = 0;
  std::vector<LayerShard> layers;  // [L]
  Slice embed_vocab;    // rows of the embedding table held (the whole vocabulary when replicated)
  Slice lm_head_vocab;  // rows of the LM head held: logits [v0, v1) of every output row
};

struct TensorParallelPlan {
  int tp_size = 1;
  EmbeddingMode embedding = EmbeddingMode::kReplicated;
  std::vector<RankShard> ranks;  // [tp_size]
  // All-reduces one forward issues per layer (after o_proj, after the MLP), and once for a
  // vocab-parallel embedding: what the topology audit counts. 0 at tp 1.
  int64_t AllReducesPerForward(int64_t num_layers) const;
};

// The plan for `tp_size` ranks. Errors name the layer (query heads that do not divide) or the KV
// head count (neither K % tp nor tp % K is 0).
Result<TensorParallelPlan> MakeTensorParallelPlan(const ModelConfig& config, int tp_size, EmbeddingMode embedding);

// The model as rank `rank` of `plan` sees it: per-layer query heads, KV heads, the dense, expert and
// shared-expert widths cut to the rank's slices. The vocabulary stays whole (the rank's LM head rows
// are its part of it; token ids, the embedding and the gathered logits are global). A backend that
// sizes its kernels and buffers from a ModelConfig (the CUDA runner) runs a rank from this. The
// slices of one dimension are the same in every layer of a kind (SplitEvenly of the same width).
ModelConfig RankModelConfig(const ModelConfig& config, const TensorParallelPlan& plan, int rank);

// Weight bytes one rank reads in one decode forward at `bytes_per_weight`, when each sparse layer
// touches `distinct_experts_per_layer` routed experts (top-k at batch 1, ExpectedDistinctExperts
// beyond), every weight read once per forward; the doc compares MoE sharding by width and by expert
// with it.
struct RankReadBytes {
  int64_t attention = 0, dense_mlp = 0, routed_experts = 0, shared_experts = 0, routers = 0, lm_head = 0,
          embedding = 0;
  int64_t total() const {
    return attention + dense_mlp + routed_experts + shared_experts + routers + lm_head + embedding;
  }
};
RankReadBytes ReadBytesPerForward(const ModelConfig& config, const TensorParallelPlan& plan, int rank,
                                  double distinct_experts_per_layer, int64_t bytes_per_weight);

// Expected number of distinct experts `tokens` rows touch when each picks top_k of num_experts
// uniformly: E (1 - (1 - k/E)^T).
double ExpectedDistinctExperts(int64_t num_experts, int64_t top_k, int64_t tokens);

// One line per layer kind and rank ("rank 0: sliding q=18 kv=2 gate=18 ..."), for `inspect --tp`.
std::string DescribeTensorParallelPlan(const ModelConfig& config, const TensorParallelPlan& plan);

}  // namespace dl
