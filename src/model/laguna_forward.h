// The Laguna forward, written once over the operations every backend implements (CTranslate2's
// layers, llama.cpp's graph builders): the CPU reference implements them as plain FP32 loops (the
// oracle), the CUDA backend as fused kernels recorded into CUDA graphs. Fusions are the backend's
// business: an op may be deferred and folded into the next (the CUDA backend folds the add + RMSNorm
// before the MLP into the MoE router), but the sequence of operations and what each means lives here
// and nowhere else (laguna-architecture.md §3).
//
// Activations are named slots the backend owns, each [rows, width] for the batch being run: T rows
// (every token row of the ForwardBatch) except kOutputNormed and kLogits, which hold R rows (the
// batch's output rows, in ForwardBatch::outputs order).
#pragma once

#include <cstdint>

#include "base/status.h"
#include "model/config.h"
#include "model/forward_batch.h"
#include "model/weights.h"

namespace dl {

enum class Act : uint8_t {
  kNormed,        // [T, d] RMSNorm output fed to the next projection
  kQkvg,          // [T, H*D + 2*K*D + gate width]
  kAttention,     // [T, H*D] gated attention output
  kDelta,         // [T, d] the block's output, added to the residual by the next AddRmsNorm
  kGateUp,        // [T, 2*F_d] dense MLP gate and up
  kHidden,        // [T, F_d] SwiGLU
  kOutputNormed,  // [R, d] final norm of the output rows
  kLogits,        // [R, V]
};

// Values that are partial sums over tensor-parallel ranks until all-reduced (model/shard_plan.h).
enum class PartialSum : uint8_t {
  kEmbedding,  // the residual after Embed of a vocab-parallel table (other ranks' tokens' rows are 0)
  kDelta,      // kDelta after a row-parallel projection: o_proj, the dense MLP's down, the MoE
};

class LagunaOps {
 public:
  virtual ~LagunaOps() = default;
  // residual[T, d] = table[tokens].
  virtual Status Embed(const WeightRef& table) = 0;
  // residual += delta (when add_delta); kNormed = RMSNorm(residual) * weight.
  virtual Status AddRmsNorm(const WeightRef& weight, bool add_delta) = 0;
  // out = in W^T over every row of `in`.
  virtual Status Linear(const LinearWeights& w, Act in, Act out) = 0;
  // kQkvg -> QK-norm and RoPE of q (kept for Attention) and k; k and v appended to the layer's
  // paged cache at each row's position.
  virtual Status QkNormRopeAppend(int32_t layer, const LagunaLayerWeights& w) = 0;
  // Causal (sliding-window on sliding layers) attention of each row over its sequence's cache,
  // times the softplus output gate from kQkvg -> kAttention.
  virtual Status Attention(int32_t layer) = 0;
  // kGateUp -> kHidden = silu(gate) * up.
  virtual Status SiluMul() = 0;
  // kNormed -> kDelta = alpha * sum_j w_j SwiGLU_j(x) + SwiGLU_shared(x) over the router's top-k.
  virtual Status Moe(int32_t layer, const MoeWeights& w) = 0;
  // The hidden state leaving the current layer (residual + delta) into tap slot `tap`.
  virtual Status TapHidden(int32_t tap) = 0;
  // residual += delta; kOutputNormed = RMSNorm(residual[output rows]) * weight.
  virtual Status OutputNorm(const WeightRef& weight) = 0;
  // Chooses each output row's token from kLogits (ForwardBatch::outputs' sampling). Under tensor
  // parallelism kLogits holds the rank's vocabulary slice; the backend combines the ranks' choices.
  virtual Status SelectTokens() = 0;
  // Sums `what` over the tensor-parallel ranks in a fixed rank order, so every rank gets the same
  // bits, run to run. A backend holding the whole model on one rank has nothing to reduce: the
  // default is that no-op.
  virtual Status AllReduce(PartialSum what) {
    (void)what;
    return Status::Ok();
  }
};

// Runs the whole model over `batch` through `ops` (which has been given the batch by its backend).
Status LagunaForward(const ModelConfig& config, const LagunaWeights& weights, const ForwardBatch& batch,
                     LagunaOps& ops);

}  // namespace dl
