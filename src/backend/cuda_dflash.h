// The DFlash drafter on the GPU (model/dflash_forward.h's operations over device memory): the
// drafter's weights uploaded as BF16, BF16 activations, and the target's embedding and LM head read
// where the CUDA backend already holds them (BF16 or FP8), so a `--shape` model drafts too. Every
// operation is an existing kernel of the target's forward:
//   - the norms are AddRmsNorm (the per-tap norms through its row stride);
//   - the linear layers are Gemv on the tensor-core product at every row count (FP8 weights: the FP8
//     kernels);
//   - the context keys are QkNormRopeAppend without query heads, into a paged BF16 cache of the
//     drafter's own: a ring of whole pages per sequence, sized window + block when every draft layer
//     is sliding (Poolside's drafters), the full length otherwise;
//   - the block's queries and keys are QkNormRopeAppend too: the block's K/V go into the same pages
//     at positions s..s+B-1 as scratch, which the next committed context rows overwrite;
//   - block attention is the split-KV attention kernel of the layer's preset (one preset table, no
//     silent fallback). Causal blocks are exactly its causal mask over positions; a bidirectional
//     block gives every row the block's last position as its mask position (a bidirectional sliding
//     layer would need another window per row and is refused);
//   - the draft tokens are SampleRows at temperature 0 (argmax, lowest id on ties).
// Its drafts therefore differ from the FP32 CPU reference only where two logits are within BF16
// rounding of each other; the output does not depend on them (every draft is verified).
// The taps arrive as the host FP32 rows the CUDA forward returns (DraftBatch::taps) and go back up
// as one copy per context; drafting runs on the runner's own stream and waits for its tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/tuning.h"
#include "model/dflash.h"
#include "model/dflash_forward.h"
#include "model/weights.h"

namespace dl {

struct CudaDflashOptions {
  int device = 0;
  int32_t max_seq_len = 4096;   // positions a sequence may reach (the target's workspace bound)
  bool allow_fallback = false;  // the generic attention kernel where the drafter's preset is not built
  kernels::Tuning tuning;       // the target's: attention cluster merge, multi-row threshold, GEMV tiles
};

class CudaDflashRunner final : public DflashRunner {
 public:
  // `drafter` must outlive the runner. target_embed ([V, d] BF16) and target_lm_head ([V, d], BF16 or
  // FP8 parts) are DEVICE weights on options.device that must outlive it too.
  static Result<std::unique_ptr<CudaDflashRunner>> Create(const DflashCheckpoint& drafter, WeightRef target_embed,
                                                          LinearWeights target_lm_head,
                                                          const CudaDflashOptions& options);
  ~CudaDflashRunner() override;

  Status Run(const DraftBatch& batch, std::vector<std::vector<int32_t>>* tokens) override;
  int32_t length(uint64_t seq) const override;
  void Forget(uint64_t seq) override;
  size_t num_sequences() const override;
  std::string where() const override;
  void set_keep_logits(bool keep) override;
  const std::vector<float>& last_logits() const override;

  struct Impl;

 private:
  explicit CudaDflashRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dl
