// A compiled PCRE2 pattern (8-bit, UTF, Unicode properties, JIT where available) used for the
// pre-tokenizer's Split steps. Hugging Face tokenizers compiles these patterns with Oniguruma; the
// options here reproduce Oniguruma's behaviour for the patterns tokenizer.json files use
// (`\s`, `\p{L}`, `\p{N}`, `(?i:...)`, look-ahead). Known differences, none of which occurs in the
// Qwen2/Laguna or GPT-2 patterns' usual input: PCRE2 counts U+180E as `\s` (Oniguruma does not),
// `\h` means horizontal space in PCRE2 but a hex digit in Oniguruma, and the two libraries may ship
// different Unicode versions (characters assigned after Unicode 14 can be classified differently).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace dl {

class Regex {
 public:
  // `literal`: match `pattern` as plain text (HF's {"String": ...} split pattern).
  static Result<Regex> Compile(std::string_view pattern, bool literal = false);

  // Appends the [begin, end) byte ranges of the successive non-overlapping matches in `text`
  // (which must be valid UTF-8) to `out`, with Oniguruma's find_iter rules: search resumes at the
  // end of the previous match, and an empty match right where the previous match ended is skipped
  // by moving one character forward.
  Status FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
  std::string pattern_;
};

}  // namespace dl
