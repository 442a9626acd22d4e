#include "engine/dflash_drafter.h"

#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace dl {

Result<std::shared_ptr<DflashDrafter>> DflashDrafter::Create(const std::string& dir, const Checkpoint& target,
                                                             int32_t max_draft_tokens, const ModelRunner* runner) {
  std::shared_ptr<DflashDrafter> d(new DflashDrafter());
  auto ck = DflashCheckpoint::Open(dir);
  if (!ck.ok()) return ck.status().WithContext("--spec-model");
  d->checkpoint_ = std::make_unique<DflashCheckpoint>(std::move(ck).value());
  const DflashConfig& c = d->checkpoint_->config();
  DL_RETURN_IF_ERROR(c.CheckTarget(target.config()).WithContext(fmt::format("--spec-model {}", dir)));
  if (max_draft_tokens > c.block_size - 1) {
    return InvalidArgument("--spec-k {} exceeds what the DFlash drafter in {} drafts per block (block_size {} - 1 = {})",
                           max_draft_tokens, dir, c.block_size, c.block_size - 1);
  }
  for (int64_t id : c.target_layer_ids) d->taps_.push_back(static_cast<int32_t>(id));
  if (runner != nullptr) {
    auto own = runner->MakeDflashRunner(*d->checkpoint_);
    if (own.ok()) {
      d->runner_ = std::move(own).value();
      return d;
    }
    if (own.status().code() != StatusCode::kUnimplemented) {
      d->placement_note_ = fmt::format("not on {}: {}", runner->backend_name(), own.status().message());
    }
  }
  const ModelWeights& tw = target.weights();
  if (tw.embed.data == nullptr || tw.lm_head.data == nullptr) {
    return Unimplemented(
        "--spec dflash: the target's embedding and LM head are not in host memory (a --shape model generated on "
        "the device) and the drafter could not run on the target's backend{}; use --model DIR (make-model writes "
        "one) or --backend cpu",
        d->placement_note_.empty() ? "" : " (" + d->placement_note_ + ")");
  }
  d->runner_ = std::make_unique<CpuDflashRunner>(*d->checkpoint_, WeightRef(tw.embed), LinearWeights{{tw.lm_head}});
  return d;
}

std::vector<int32_t> DflashDrafter::Propose(std::span<const int32_t>, int32_t) const { return {}; }

std::string DflashDrafter::name() const {
  const DflashConfig& c = config();
  return fmt::format("dflash[{} layers, block {}, taps {}, on {}{}]", c.num_hidden_layers, c.block_size,
                     fmt::join(c.target_layer_ids, ","), runner_->where(),
                     placement_note_.empty() ? "" : " (" + placement_note_ + ")");
}

Status DflashDrafter::Observe(uint64_t seq, int32_t position, const ForwardResult& result, int32_t first_row,
                              int32_t rows) const {
  if (rows <= 0) return Status::Ok();
  const int64_t d = config().hidden_size;
  if (result.hidden.size() != taps_.size()) {
    return Internal("DFlash drafter: the target forward returned {} hidden-state taps, {} asked for",
                    result.hidden.size(), taps_.size());
  }
  DraftBatch batch;
  batch.contexts.push_back({seq, position, rows});
  // [rows, taps * d]: row r is the concatenation of tap t's row, t in target_layer_ids order.
  batch.taps.resize(static_cast<size_t>(rows) * taps_.size() * static_cast<size_t>(d));
  for (int32_t r = 0; r < rows; ++r) {
    for (size_t t = 0; t < taps_.size(); ++t) {
      const std::vector<float>& h = result.hidden[t];
      const size_t src = static_cast<size_t>(first_row + r) * static_cast<size_t>(d);
      if (src + static_cast<size_t>(d) > h.size()) return Internal("DFlash drafter: tap {} has too few rows", t);
      std::copy_n(h.begin() + static_cast<std::ptrdiff_t>(src), d,
                  batch.taps.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(r) * taps_.size() + t) * d));
    }
  }
  std::lock_guard lock(mu_);
  std::vector<std::vector<int32_t>> none;
  return runner_->Run(batch, &none);
}

Result<std::vector<int32_t>> DflashDrafter::ProposeFor(uint64_t seq, std::span<const int32_t> context,
                                                       int32_t max_tokens) const {
  if (context.empty() || max_tokens <= 0) return std::vector<int32_t>{};
  DraftBatch batch;
  const int32_t k = std::min<int32_t>(max_tokens, static_cast<int32_t>(config().block_size - 1));
  batch.blocks.push_back({seq, context.back(), static_cast<int32_t>(context.size()) - 1, k});
  std::vector<std::vector<int32_t>> tokens;
  std::lock_guard lock(mu_);
  DL_RETURN_IF_ERROR(runner_->Run(batch, &tokens));
  return std::move(tokens[0]);
}

void DflashDrafter::Forget(uint64_t seq) const {
  std::lock_guard lock(mu_);
  runner_->Forget(seq);
}

int32_t DflashDrafter::context_length(uint64_t seq) const {
  std::lock_guard lock(mu_);
  return runner_->length(seq);
}

size_t DflashDrafter::num_sequences() const {
  std::lock_guard lock(mu_);
  return runner_->num_sequences();
}

void DflashDrafter::set_keep_logits(bool keep) const {
  std::lock_guard lock(mu_);
  runner_->set_keep_logits(keep);
}

std::vector<float> DflashDrafter::last_logits() const {
  std::lock_guard lock(mu_);
  return runner_->last_logits();
}

Result<std::shared_ptr<const Drafter>> MakeDrafterFor(const SpecOptions& o, const Checkpoint& target,
                                                      const ModelRunner* runner) {
  DL_RETURN_IF_ERROR(o.Validate());
  if (o.method != SpecMethod::kDflash) return MakeDrafter(o);
  DL_ASSIGN_OR_RETURN(auto d, DflashDrafter::Create(o.model_dir, target, o.k, runner));
  return std::shared_ptr<const Drafter>(std::move(d));
}

}  // namespace dl
