// dl::Tokenizer: a Hugging Face tokenizer.json reader and byte-level BPE encoder/decoder that
// reproduces the `tokenizers` library (0.2x) token for token for the structures Laguna uses:
//
//   added tokens   matched first, leftmost-longest, before pre-tokenization, in HF's two passes
//                  (tokens with normalized=false, then normalized=true), honouring special,
//                  single_word, lstrip and rstrip;
//   normalizer     null / absent (anything else is refused: it would change what the model sees);
//   pre_tokenizer  a ByteLevel, or a Sequence of Split steps (Regex or String pattern, any of the
//                  five behaviours, invert) ending in ByteLevel (add_prefix_space, use_regex with
//                  the GPT-2 pattern);
//   model          BPE over the byte-level alphabet: vocab, merges as "a b" strings or [a, b]
//   pairs,
//                  ignore_merges, unk_token/fuse_unk; byte_fallback, dropout, continuing-subword
//                  prefixes and end-of-word suffixes are refused;
//   post_processor null, ByteLevel, TemplateProcessing (single sequence) or a Sequence of those;
//                  only consulted when Encode is asked to add special tokens;
//   decoder        ByteLevel.
//
// The split patterns are read from the file and run by PCRE2 (see regex.h for the few places where
// PCRE2 and HF's Oniguruma could disagree). Laguna's file must be used as shipped: no "Mistral
// regex fix" is applied or offered.
//
// A Tokenizer is cheap to copy (shared immutable state plus a shared, locked BPE cache) and safe to
// use from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace dl {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

class Tokenizer {
 public:
  // `path` is a tokenizer.json file or a directory that holds one.
  static Result<Tokenizer> FromFile(const std::string& path);
  // `origin` names the source in error messages (a file name).
  static Result<Tokenizer> FromJson(std::string_view json_text, const std::string& origin);

  // Text (valid UTF-8) to token ids. add_special_tokens runs the file's post-processor (HF's
  // encode(..., add_special_tokens=True)); chat-templated prompts already hold their special
  // tokens and must be encoded with false.
  Result<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens = false) const;

  // Ids to text exactly as HF's decode(ids, skip_special_tokens): unknown ids are dropped, bytes
  // that do not form valid UTF-8 become U+FFFD.
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // The pieces the pre-tokenizer cuts `text` into (added tokens matched first, as in Encode),
  // as raw UTF-8 text; an added token is one piece. For tests and the trainer.
  Result<std::vector<std::string>> PreTokenize(std::string_view text) const;

  // Token string as stored in the file (byte-level form for vocabulary tokens, content for added
  // tokens), and back.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;

  // The bytes `id` contributes to decoded text (ByteLevel decoder applied to one token); empty for
  // an unknown id.
  std::string_view TokenBytes(int32_t id) const;
  bool IsKnown(int32_t id) const;
  bool IsSpecial(int32_t id) const;

  // One more than the largest id (model vocabulary or added token).
  int32_t vocab_size() const;
  const std::vector<AddedToken>& added_tokens() const;
  size_t num_merges() const;
  const std::string& origin() const;

  struct Impl;  // opaque; public only so that the loader's helpers in tokenizer.cc can fill it

 private:
  explicit Tokenizer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace dl
