// One tensor-parallel rank's weights on the host: the full model's LagunaWeights cut down to the
// rank's part of a TensorParallelPlan. Row slices (q/k/v/g, gate/up, experts' gate/up, LM head, a
// vocab-parallel embedding) are views into the checkpoint's memory, so the rank touches only its
// rows; column slices (o_proj, the down projections) are copied into buffers the shard owns. At tp 1
// every weight is the checkpoint's own view, unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "base/status.h"
#include "model/config.h"
#include "model/shard_plan.h"
#include "model/weights.h"

namespace dl {

struct HostWeightShard {
  int rank = 0;
  LagunaWeights weights;
  std::vector<std::vector<uint8_t>> owned;  // backing of the column slices
};

// `full`: the whole model over host memory (HostLagunaWeights). FP8 weights are cut with their
// scales: a slice must start on a scale block's boundary or lie inside one block (else Unimplemented
// naming the tensor); row slices view the scales, column slices copy them.
Result<std::unique_ptr<HostWeightShard>> ShardHostWeights(const ModelConfig& config,
                                                          const LagunaWeights& full,
                                                          const TensorParallelPlan& plan, int rank);

// Rows [rows.begin, rows.end()) of a matrix, as a view (an FP8 weight's scales too).
Result<WeightRef> RowSlice(const WeightRef& w, Slice rows);

}  // namespace dl
