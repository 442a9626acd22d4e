#include "engine/drafter.h"

#include <algorithm>

#include <fmt/format.h>

#include "base/rng.h"

namespace dl {

const char* SpecMethodName(SpecMethod m) {
  switch (m) {
    case SpecMethod::kNone: return "none";
    case SpecMethod::kNgram: return "ngram";
    case SpecMethod::kDflash: return "dflash";
  }
  return "none";
}

Result<SpecMethod> SpecOptions::ParseMethod(const std::string& name) {
  if (name == "none") return SpecMethod::kNone;
  if (name == "ngram") return SpecMethod::kNgram;
  if (name == "dflash") return SpecMethod::kDflash;
  return InvalidArgument("--spec must be none, ngram or dflash (got \"{}\")", name);
}

Status SpecOptions::Validate() const {
  if (method != SpecMethod::kDflash && !model_dir.empty()) {
    return InvalidArgument("--spec-model is the DFlash drafter's checkpoint: it needs --spec dflash (got --spec {})",
                           SpecMethodName(method));
  }
  if (!enabled()) return Status::Ok();
  if (method == SpecMethod::kDflash && (ngram_min != SpecOptions{}.ngram_min || ngram_max != SpecOptions{}.ngram_max)) {
    return InvalidArgument("--spec-ngram-min and --spec-ngram-max apply to --spec ngram, not dflash (got {} and {})",
                           ngram_min, ngram_max);
  }
  if (method == SpecMethod::kDflash && model_dir.empty()) {
    return InvalidArgument("--spec dflash needs --spec-model DIR (a DFlash drafter checkpoint; `decodelab make-model "
                           "--shape tiny-dflash` or `--dflash-for DIR` writes a random one)");
  }
  if (k < 1 || k > 64) return InvalidArgument("--spec-k must be in [1, 64] (got {})", k);
  if (method == SpecMethod::kNgram) {
    if (ngram_min < 1 || ngram_max > 64 || ngram_min > ngram_max) {
      return InvalidArgument("--spec-ngram-min and --spec-ngram-max need 1 <= min <= max <= 64 (got {} and {})",
                             ngram_min, ngram_max);
    }
  }
  return Status::Ok();
}

std::vector<int32_t> NgramDrafter::Propose(std::span<const int32_t> context, int32_t max_tokens) const {
  const int32_t len = static_cast<int32_t>(context.size());
  if (max_tokens <= 0) return {};
  for (int32_t n = std::min(max_, len - 1); n >= min_; --n) {
    const int32_t suffix = len - n;
    // The most recent earlier occurrence: start j < suffix, so at least one token follows it.
    for (int32_t j = suffix - 1; j >= 0; --j) {
      if (!std::equal(context.begin() + j, context.begin() + j + n, context.begin() + suffix)) continue;
      const int32_t from = j + n;
      const int32_t count = std::min(max_tokens, len - from);
      return std::vector<int32_t>(context.begin() + from, context.begin() + from + count);
    }
  }
  return {};
}

std::string NgramDrafter::name() const { return fmt::format("ngram[{},{}]", min_, max_); }

Result<std::shared_ptr<const Drafter>> MakeDrafter(const SpecOptions& o) {
  DL_RETURN_IF_ERROR(o.Validate());
  switch (o.method) {
    case SpecMethod::kNone: return std::shared_ptr<const Drafter>();
    case SpecMethod::kNgram: return std::shared_ptr<const Drafter>(std::make_shared<NgramDrafter>(o.ngram_min, o.ngram_max));
    case SpecMethod::kDflash:
      return InvalidArgument("the DFlash drafter reads the loaded target's weights: build it with MakeDflashDrafter");
  }
  return InvalidArgument("unknown speculative method");
}

// ---- test drafters ----

void TruthTable::Add(std::vector<int32_t> prompt, std::span<const int32_t> continuation) {
  prompt.insert(prompt.end(), continuation.begin(), continuation.end());
  sequences_.push_back(std::move(prompt));
}

std::span<const int32_t> TruthTable::Truth(std::span<const int32_t> context) const {
  for (const auto& s : sequences_) {
    if (s.size() >= context.size() && std::equal(context.begin(), context.end(), s.begin())) {
      return std::span<const int32_t>(s).subspan(context.size());
    }
  }
  return {};
}

std::vector<int32_t> OracleDrafter::Propose(std::span<const int32_t> context, int32_t max_tokens) const {
  const auto truth = truth_.Truth(context);
  const size_t n = std::min(truth.size(), static_cast<size_t>(std::max(0, max_tokens)));
  return std::vector<int32_t>(truth.begin(), truth.begin() + n);
}

std::vector<int32_t> WrongDrafter::Propose(std::span<const int32_t> context, int32_t max_tokens) const {
  const auto truth = truth_.Truth(context);
  std::vector<int32_t> out;
  for (int32_t i = 0; i < max_tokens; ++i) {
    const int32_t t = i < static_cast<int32_t>(truth.size()) ? truth[i] : 0;
    out.push_back((t + 1) % vocab_);
  }
  return out;
}

std::vector<int32_t> CorruptingDrafter::Propose(std::span<const int32_t> context, int32_t max_tokens) const {
  const auto truth = truth_.Truth(context);
  const uint64_t key = SplitMix64(seed_ ^ SplitMix64(context.size()));
  const int32_t count =
      max_tokens <= 0 ? 0 : static_cast<int32_t>(SplitMix64(key ^ 0x5bd1e995ull) % (static_cast<uint64_t>(max_tokens) + 1));
  std::vector<int32_t> out;
  for (int32_t i = 0; i < count; ++i) {
    const uint64_t r = SplitMix64(key ^ SplitMix64(static_cast<uint64_t>(i) + 1));
    int32_t t = i < static_cast<int32_t>(truth.size()) ? truth[i] : static_cast<int32_t>(r % vocab_);
    if (static_cast<double>(r >> 11) * 0x1.0p-53 < p_) {
      t = (t + 1 + static_cast<int32_t>((r >> 7) % static_cast<uint64_t>(vocab_ - 1))) % vocab_;
    }
    out.push_back(t);
  }
  return out;
}

// ---- stats ----

void SpecStats::Record(int32_t drafted, int32_t accepted) {
  if (drafted <= 0) return;
  ++num_drafts;
  num_draft_tokens += static_cast<uint64_t>(drafted);
  num_accepted_tokens += static_cast<uint64_t>(accepted);
  if (accepted_per_pos.size() < static_cast<size_t>(drafted)) accepted_per_pos.resize(static_cast<size_t>(drafted), 0);
  for (int32_t i = 0; i < accepted; ++i) ++accepted_per_pos[static_cast<size_t>(i)];
}

double SpecStats::mean_acceptance_length() const {
  return num_drafts == 0 ? 0.0 : 1.0 + static_cast<double>(num_accepted_tokens) / static_cast<double>(num_drafts);
}

double SpecStats::acceptance_rate() const {
  return num_draft_tokens == 0 ? 0.0 : static_cast<double>(num_accepted_tokens) / static_cast<double>(num_draft_tokens);
}

}  // namespace dl
