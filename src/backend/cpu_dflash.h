// The CPU reference implementation of the DFlash drafter's operations (model/dflash_forward.h):
// FP32 loops over the drafter's weights (and the target's embedding and LM head, read in place from
// host memory), each row on its own in a fixed order. It keeps every sequence's drafter context K/V
// (per draft layer, post k_norm and RoPE, FP32) in host memory.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "model/dflash.h"
#include "model/dflash_forward.h"

namespace dl {

class CpuDflashRunner : public DflashRunner, private DflashOps {
 public:
  // `drafter` must outlive the runner; target_embed / target_lm_head are host weights of the target
  // ([V, d] each) that must outlive it too.
  CpuDflashRunner(const DflashCheckpoint& drafter, WeightRef target_embed, LinearWeights target_lm_head);

  Status Run(const DraftBatch& batch, std::vector<std::vector<int32_t>>* tokens) override;
  int32_t length(uint64_t seq) const override;
  void Forget(uint64_t seq) override { cache_.erase(seq); }
  size_t num_sequences() const override { return cache_.size(); }
  std::string where() const override { return "cpu"; }
  void set_keep_logits(bool keep) override { keep_logits_ = keep; }
  const std::vector<float>& last_logits() const override { return kept_logits_; }

 private:
  Status NormTapSlices(std::span<const WeightRef> weights) override;
  Status RmsNorm(const WeightRef& weight, DraftAct in, DraftAct out) override;
  Status Linear(const LinearWeights& w, DraftAct in, DraftAct out) override;
  Status AppendContextKv(int32_t layer, const WeightRef& k_norm) override;
  Status Embed(const WeightRef& table) override;
  Status AddRmsNorm(const WeightRef& weight, bool add_delta) override;
  Status BlockAttention(int32_t layer, const WeightRef& q_norm, const WeightRef& k_norm) override;
  Status SiluMul() override;
  Status OutputNorm(const WeightRef& weight) override;
  Status SelectTokens() override;

  struct Slot {
    std::vector<float> data;
    int64_t width = 0;
    float* row(int64_t r) { return data.data() + r * width; }
    int64_t rows() const { return width == 0 ? 0 : static_cast<int64_t>(data.size()) / width; }
  };
  Slot& slot(DraftAct a) { return slots_[static_cast<int>(a)]; }
  // In-place k/q-norm and RoPE of one head vector at `position`.
  void NormRope(float* x, const WeightRef& norm, int32_t position) const;

  struct SeqCache {
    int32_t length = 0;
    std::vector<std::vector<float>> k, v;  // per layer: [length, K*D]
  };

  const DflashConfig& cfg_;
  const DflashCheckpoint& drafter_;
  WeightRef target_embed_;
  LinearWeights target_lm_head_;
  std::vector<float> inv_freq_;  // [rotary_dim / 2]
  std::unordered_map<uint64_t, SeqCache> cache_;

  // The batch being run.
  const DraftBatch* batch_ = nullptr;
  std::vector<int32_t> block_tokens_;     // [N]
  std::vector<int32_t> output_rows_;      // [R] block rows with an output
  std::vector<float> residual_;           // [N, d]
  Slot slots_[12];
  std::vector<int32_t> selected_;         // [R]
  bool keep_logits_ = false;
  std::vector<float> kept_logits_;
};

}  // namespace dl
