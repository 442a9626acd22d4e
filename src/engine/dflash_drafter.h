// The DFlash drafter (shared/design/dflash.md, docs/speculative.md): a block drafter conditioned on
// the target's hidden states. Per sequence it keeps the drafter's context K/V of every committed
// position (CpuDflashRunner), fed by Observe with the taps of the target forwards the engine runs
// anyway (prefill chunks, decode rows, the accepted rows of a verify); ProposeFor runs one drafter
// forward over [anchor, mask x (B - 1)] at positions s..s+B-1 and returns the greedy tokens of rows
// 1..K through the target's LM head.
//
// Where it runs: on the target's backend when it has a drafter of its own (ModelRunner::
// MakeDflashRunner: the CUDA backend, over its device embedding and LM head, so `--shape` models
// draft too), else on the CPU reference, reading the target's embedding and LM head from host memory
// (a checkpoint directory; a CUDA `--shape` target with no drafter of its own is refused). name()
// says which, and why when the backend's own could not be built. Its numerics never touch the output:
// drafts are verified by the target, so speculative output equals plain decoding whatever the drafter
// proposes.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "backend/cpu_dflash.h"
#include "engine/drafter.h"
#include "model/checkpoint.h"
#include "model/dflash.h"
#include "model/runner.h"

namespace dl {

class DflashDrafter : public Drafter {
 public:
  // Opens the drafter checkpoint in `dir` and pairs it with `target` (which must outlive the
  // drafter): shapes against the target (DflashConfig::CheckTarget), `max_draft_tokens` <=
  // block_size - 1. With `runner` (the target's; it must outlive the drafter) the drafter runs on its
  // backend where that has one; otherwise, and where building it there fails, on the CPU reference,
  // which needs the target's embedding and LM head in host memory.
  static Result<std::shared_ptr<DflashDrafter>> Create(const std::string& dir, const Checkpoint& target,
                                                       int32_t max_draft_tokens, const ModelRunner* runner = nullptr);

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
  // "cpu" or "cuda", and why not the backend's own where it could not be built (empty otherwise).
  std::string where() const { return runner_->where(); }
  const std::string& placement_note() const { return placement_note_; }
  // Tests: the drafter's logits of its last block's output rows ([num_outputs, V] FP32).
  void set_keep_logits(bool keep) const;
  std::vector<float> last_logits() const;
  // Positions of `seq` in the drafter's context cache, and sequences held (tests, leak checks).
  int32_t context_length(uint64_t seq) const;
  size_t num_sequences() const;

 private:
  DflashDrafter() = default;
  std::unique_ptr<DflashCheckpoint> checkpoint_;
  std::vector<int32_t> taps_;
  mutable std::mutex mu_;
  mutable std::unique_ptr<DflashRunner> runner_;
  std::string placement_note_;
  mutable std::atomic<uint64_t> next_seq_{1};
};

// The drafter `options` asks for, for a loaded target (DFlash needs it and, where it has one, its
// runner's backend; the others need neither).
Result<std::shared_ptr<const Drafter>> MakeDrafterFor(const SpecOptions& options, const Checkpoint& target,
                                                      const ModelRunner* runner = nullptr);

}  // namespace dl
