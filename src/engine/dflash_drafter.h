// The DFlash drafter (shared/design/dflash.md, docs/speculative.md): a block drafter conditioned on
// the target's hidden states. Per sequence it keeps the drafter's context K/V of every committed
// position (CpuDflashRunner), fed by Observe with the taps of the target forwards the engine runs
// anyway (prefill chunks, decode rows, the accepted rows of a verify); ProposeFor runs one drafter
// forward over [anchor, mask x (B - 1)] at positions s..s+B-1 and returns the greedy tokens of rows
// 1..K through the target's LM head.
//
// Where it runs: the drafter's operations are implemented on the CPU reference only, reading the
// target's embedding and LM head from host memory. It serves a target on either backend as long as
// the target's weights are on the host (a checkpoint directory; the CUDA `--shape` path keeps them
// only on the device and is refused). Its numerics never touch the output: drafts are verified by
// the target, so speculative output equals plain decoding whatever the drafter proposes.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "backend/cpu_dflash.h"
#include "engine/drafter.h"
#include "model/checkpoint.h"
#include "model/dflash.h"

namespace dl {

class DflashDrafter : public Drafter {
 public:
  // Opens the drafter checkpoint in `dir` and pairs it with `target` (which must outlive the
  // drafter): shapes against the target (DflashConfig::CheckTarget), the target's embedding and LM
  // head on the host, `max_draft_tokens` <= block_size - 1.
  static Result<std::shared_ptr<DflashDrafter>> Create(const std::string& dir, const Checkpoint& target,
                                                       int32_t max_draft_tokens);

  // Without a sequence's state there is nothing to condition on: no drafts (the engine calls
  // ProposeFor).
  std::vector<int32_t> Propose(std::span<const int32_t> context, int32_t max_tokens) const override;
  std::string name() const override;
  std::vector<int32_t> hidden_taps() const override { return taps_; }
  uint64_t NewSequence() const override { return next_seq_.fetch_add(1); }
  Status Observe(uint64_t seq, int32_t position, const ForwardResult& result, int32_t first_row,
                 int32_t rows) const override;
  Result<std::vector<int32_t>> ProposeFor(uint64_t seq, std::span<const int32_t> context,
                                          int32_t max_tokens) const override;
  void Forget(uint64_t seq) const override;

  const DflashConfig& config() const { return checkpoint_->config(); }
  // Positions of `seq` in the drafter's context cache, and sequences held (tests, leak checks).
  int32_t context_length(uint64_t seq) const;
  size_t num_sequences() const;

 private:
  DflashDrafter() = default;
  std::unique_ptr<DflashCheckpoint> checkpoint_;
  std::vector<int32_t> taps_;
  mutable std::mutex mu_;
  mutable std::unique_ptr<CpuDflashRunner> runner_;
  mutable std::atomic<uint64_t> next_seq_{1};
};

// The drafter `options` asks for, for a loaded target (DFlash needs it; the others do not).
Result<std::shared_ptr<const Drafter>> MakeDrafterFor(const SpecOptions& options, const Checkpoint& target);

}  // namespace dl
