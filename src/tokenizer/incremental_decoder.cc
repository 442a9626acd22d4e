#include "tokenizer/incremental_decoder.h"

#include "tokenizer/utf8.h"

namespace dl {

std::string IncrementalDecoder::Add(int32_t id) {
  ++num_tokens_;
  if (!tokenizer_->IsKnown(id)) return {};
  if (skip_special_tokens_ && tokenizer_->IsSpecial(id)) return {};
  pending_.append(tokenizer_->TokenBytes(id));
  const size_t ready = utf8::CompletePrefix(pending_);
  if (ready == 0) return {};
  std::string text = utf8::Lossy(std::string_view(pending_).substr(0, ready));
  pending_.erase(0, ready);
  return text;
}

std::string IncrementalDecoder::Flush() {
  std::string text = utf8::Lossy(pending_);
  pending_.clear();
  return text;
}

}  // namespace dl
