// Streaming detokenisation: feed generated ids one at a time and get back only complete UTF-8 text.
//
// With a ByteLevel decoder every token stands for a fixed byte string and the decoded text is
// from_utf8_lossy(concatenation of those bytes). A character whose bytes are split across tokens
// (CJK, emoji) would come out as U+FFFD if each token were decoded alone, so the decoder keeps the
// bytes of an unfinished multi-byte character (at most 3) and releases them with the token that
// completes it. This is the byte-exact form of vLLM's prefix/read-offset detokenizer and
// llama.cpp's partial-UTF-8 hold-back: the concatenation of everything Add() and Flush() return
// equals Tokenizer::Decode(all ids) exactly, including the U+FFFD a truly invalid sequence gets.
#pragma once

#include <cstdint>
#include <string>

#include "tokenizer/tokenizer.h"

namespace dl {

class IncrementalDecoder {
 public:
  // `tokenizer` must outlive the decoder (a Tokenizer copy is cheap; pass one you keep).
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false)
      : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

  // Text completed by `id`; empty while a character is still incomplete. Unknown ids are ignored,
  // as in Decode.
  std::string Add(int32_t id);

  // End of stream: whatever is held back, converted (an unfinished character becomes U+FFFD).
  std::string Flush();

  // Bytes held back waiting for the rest of a character.
  size_t pending_bytes() const { return pending_.size(); }
  // Number of ids fed since construction or Reset().
  size_t num_tokens() const { return num_tokens_; }
  void Reset() {
    pending_.clear();
    num_tokens_ = 0;
  }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
  size_t num_tokens_ = 0;
};

}  // namespace dl
