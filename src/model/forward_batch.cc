#include "model/forward_batch.h"

#include <cmath>

namespace dl {

const char* ForwardModeName(ForwardMode m) {
  switch (m) {
    case ForwardMode::kPrefill: return "prefill";
    case ForwardMode::kDecode: return "decode";
    case ForwardMode::kVerify: return "verify";
  }
  return "?";
}

int32_t ForwardBatch::AddSequence(const SequenceKv& kv, std::span<const int32_t> rows, int32_t prompt_length) {
  const int32_t first = num_rows();
  tokens.insert(tokens.end(), rows.begin(), rows.end());
  seqs.push_back({&kv, first, static_cast<int32_t>(rows.size()), prompt_length});
  return first;
}

OutputRequest& ForwardBatch::AddOutput(int32_t row) {
  outputs.emplace_back();
  outputs.back().row = row;
  return outputs.back();
}

std::vector<int32_t> ForwardBatch::Positions() const {
  std::vector<int32_t> pos(tokens.size());
  for (const BatchSequence& s : seqs) {
    for (int32_t i = 0; i < s.num_rows; ++i) pos[s.first_row + i] = s.kv->length() + i;
  }
  return pos;
}

Status ForwardBatch::Validate(int64_t vocab_size, int32_t page_size) const {
  if (tokens.empty()) return InvalidArgument("forward of zero rows");
  int32_t next = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const BatchSequence& s = seqs[i];
    if (s.kv == nullptr || s.num_rows < 1 || s.first_row != next) {
      return InvalidArgument("batch sequence {}: rows must be non-empty, consecutive and in order", i);
    }
    if (s.prompt_length < 0) return InvalidArgument("batch sequence {}: negative prompt length {}", i, s.prompt_length);
    next += s.num_rows;
    const int32_t last = s.kv->length() + s.num_rows - 1;
    bool any = false;
    for (KvGroup g : {KvGroup::kFull, KvGroup::kSliding}) {
      const auto& table = s.kv->block_table(g);
      if (table.empty()) continue;
      any = true;
      if (LocatePosition(table, page_size, last).page < 0) {
        return FailedPrecondition("batch sequence {}: no KV page reserved for position {}", i, last);
      }
    }
    if (!any) return FailedPrecondition("batch sequence {}: forward without reserved KV pages", i);
  }
  if (next != num_rows()) return InvalidArgument("batch: sequences cover {} of {} rows", next, num_rows());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      return InvalidArgument("token id {} (row {}) is outside the vocabulary [0, {})", tokens[i], i,
                             vocab_size);
    }
  }
  int32_t prev = -1;
  for (const OutputRequest& o : outputs) {
    if (o.row <= prev || o.row >= num_rows()) {
      return InvalidArgument("batch outputs: rows must be ascending, unique and below {} (row {})",
                             num_rows(), o.row);
    }
    prev = o.row;
    const RowSampling& s = o.sampling;
    if (!(s.temperature >= 0.0f) || !(s.top_p > 0.0f && s.top_p <= 1.0f) || !(s.min_p >= 0.0f && s.min_p <= 1.0f) ||
        s.top_k < 0) {
      return InvalidArgument("batch output row {}: sampling parameters out of range", o.row);
    }
    for (const LogitAdjustment& a : s.adjustments) {
      if (a.token < 0 || a.token >= vocab_size || !(a.repetition > 0.0f) || !std::isfinite(a.bias) ||
          !std::isfinite(a.penalty)) {
        return InvalidArgument("batch output row {}: logit adjustment of token {} invalid", o.row, a.token);
      }
    }
  }
  int32_t prev_tap = -1;
  for (int32_t t : hidden_taps) {
    if (t <= prev_tap) return InvalidArgument("hidden taps must be ascending and unique");
    prev_tap = t;
  }
  return Status::Ok();
}

Status ForwardBatch::ValidateHiddenTaps(int64_t num_layers) const {
  for (int32_t t : hidden_taps) {
    if (t < 0 || t >= num_layers) {
      return InvalidArgument("hidden tap at layer {} is outside the model's {} layers", t, num_layers);
    }
  }
  return Status::Ok();
}

}  // namespace dl
