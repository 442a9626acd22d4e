// The DFlash drafter's forward (shared/design/dflash.md §1.4-1.8, §3.2), written once over the
// operations a backend implements (the sibling of model/laguna_forward.h). Two passes:
//
//  * Context: the target's hidden states after the tapped layers, for positions the target has
//    committed, are fused into one vector per position (Laguna: per-slice RMSNorm; fc; hidden_norm)
//    and turned into each draft layer's context keys/values (Laguna: the layer's input_layernorm
//    first; k_norm and RoPE at the row's absolute position on K, nothing on V), appended to the
//    drafter's own per-sequence cache. Only committed rows are ever appended, so the cache never
//    holds a rejected draft and needs no rollback.
//  * Block: rows [anchor, mask x (B - 1)] at positions s..s+B-1 (embedded with the target's table),
//    through every draft layer: queries of the block attend over the sequence's context K/V plus the
//    block's own K/V (in-block causal or bidirectional per layer; sliding layers see keys within the
//    window); residual, post-attention norm, SwiGLU MLP; the final norm; logits of the output rows
//    through the TARGET's LM head; greedy (argmax, lowest id on ties) draft tokens. The block's K/V
//    are scratch: never stored.
//
// Activation slots are named as in LagunaOps: C rows in the context pass (every context row of the
// batch), N rows in the block pass (B per sequence), R output rows.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "model/dflash.h"
#include "model/weights.h"

namespace dl {

enum class DraftAct : uint8_t {
  kTaps,          // [C, taps * d] concatenated target hidden states (tap order)
  kContext,       // [C, d] fused context vector c_t
  kContextNormed, // [C, d] a layer's input norm of c_t (Laguna)
  kContextKv,     // [C, 2 * K * D] a layer's k and v projections of the context
  kNormed,        // [N, d] a block layer's normed input
  kQkvg,          // [N, H*D + 2*K*D + gate]
  kAttention,     // [N, H*D]
  kDelta,         // [N, d]
  kGateUp,        // [N, 2F]
  kHidden,        // [N, F]
  kOutputNormed,  // [R, d]
  kLogits,        // [R, V]
};

// One drafter forward: context rows to append and/or blocks to draft, for any number of sequences
// (each named by the backend's sequence handle).
struct DraftBatch {
  struct Context {
    uint64_t seq = 0;
    int32_t first_position = 0;  // must equal the sequence's cached context length
    int32_t num_rows = 0;        // rows of `taps`, consecutive
  };
  struct Block {
    uint64_t seq = 0;
    int32_t anchor = 0;       // token at position `position` (committed, not yet run by the target)
    int32_t position = 0;     // must equal the sequence's cached context length
    int32_t num_outputs = 0;  // draft tokens wanted: rows 1..num_outputs of the block
  };
  std::vector<Context> contexts;
  std::vector<float> taps;  // [sum of context rows, taps * d]
  std::vector<Block> blocks;
};

class DflashOps {
 public:
  virtual ~DflashOps() = default;
  // ---- context pass ----
  // kTaps: slice i (width d) of every row = RMSNorm(slice) * weights[i].
  virtual Status NormTapSlices(std::span<const WeightRef> weights) = 0;
  // out = RMSNorm(in) * weight, row by row (in may equal out).
  virtual Status RmsNorm(const WeightRef& weight, DraftAct in, DraftAct out) = 0;
  virtual Status Linear(const LinearWeights& w, DraftAct in, DraftAct out) = 0;
  // kContextKv -> per KV head k_norm and RoPE of k at the row's position; k and v appended to draft
  // layer `layer`'s cache of the row's sequence.
  virtual Status AppendContextKv(int32_t layer, const WeightRef& k_norm) = 0;
  // ---- block pass ----
  // residual[N, d] = table[block tokens] (anchor, then mask_token_id rows).
  virtual Status Embed(const WeightRef& table) = 0;
  // residual += delta (when add_delta); kNormed = RMSNorm(residual) * weight.
  virtual Status AddRmsNorm(const WeightRef& weight, bool add_delta) = 0;
  // kQkvg -> q_norm/k_norm and RoPE of the block rows; each row attends over its sequence's context
  // K/V and the block's K/V it may see (layer's causality and window), times the per-head softplus
  // gate when the drafter has one -> kAttention.
  virtual Status BlockAttention(int32_t layer, const WeightRef& q_norm, const WeightRef& k_norm) = 0;
  virtual Status SiluMul() = 0;
  // residual += delta; kOutputNormed = RMSNorm(residual[output rows]) * weight.
  virtual Status OutputNorm(const WeightRef& weight) = 0;
  // Greedy token of every output row from kLogits.
  virtual Status SelectTokens() = 0;
};

// A backend's drafter: DflashOps over its own weights and per-sequence context caches, run through
// the two passes below. CpuDflashRunner (backend/cpu_dflash.h: FP32, host memory) is the reference;
// CudaDflashRunner (backend/cuda_dflash.h: BF16 activations, the target's device embedding and LM
// head, the context K/V in a paged device cache) the fast one. Their drafts may differ where two
// logits are within rounding of each other; the output never does (every draft is verified).
class DflashRunner {
 public:
  virtual ~DflashRunner() = default;
  // Appends `batch.contexts`, then drafts `batch.blocks`; tokens: per block, its num_outputs drafts.
  virtual Status Run(const DraftBatch& batch, std::vector<std::vector<int32_t>>* tokens) = 0;
  // Context positions cached for `seq` (0 for an unknown sequence).
  virtual int32_t length(uint64_t seq) const = 0;
  // Drops the sequence's context (it finished, failed or was preempted). Nothing else is ever rolled
  // back: only committed rows enter a context.
  virtual void Forget(uint64_t seq) = 0;
  virtual size_t num_sequences() const = 0;
  // "cpu" or "cuda": where the drafter's arithmetic runs (printed with the drafter's name).
  virtual std::string where() const = 0;
  // Tests: keep the last Run's output-row logits ([rows of every block's outputs, V] FP32).
  virtual void set_keep_logits(bool keep) = 0;
  virtual const std::vector<float>& last_logits() const = 0;
};

// Appends `batch.contexts` (runs nothing when there are none).
Status DflashContextForward(const DflashConfig& c, const DflashWeights& w, const DraftBatch& batch, DflashOps& ops);
// Drafts `batch.blocks` through the target's embedding table and LM head.
Status DflashBlockForward(const DflashConfig& c, const DflashWeights& w, const WeightRef& target_embed,
                          const LinearWeights& target_lm_head, const DraftBatch& batch, DflashOps& ops);

}  // namespace dl
