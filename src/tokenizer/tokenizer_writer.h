// Writes a small tokenizer with Laguna's exact structure for generated (random-weight) models:
// byte-level BPE, the three-step pre-tokenizer (newline-run split merged with the next piece, the
// Qwen2-style split with single digits, ByteLevel without prefix space), ByteLevel decoder, and
// Laguna-style added tokens at low ids (1 〈|CODE_START|〉, 2 〈|EOS|〉 = BOS = EOS, 9 pad,
// 12 mask, 24 </assistant>, the chat markers), then the 256 byte tokens, then merges learned by
// TrainBytePairMerges over a built-in corpus. Deterministic: same vocab_size, same bytes.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "base/status.h"

namespace dl {

// Laguna's pre-tokenizer patterns (shared/design/laguna-checkpoints.md §3.1). Used as shipped: no
// "Mistral regex fix".
inline constexpr std::string_view kLagunaNewlineRunPattern = R"((?:\r?\n)+(?!\r?\n))";
inline constexpr std::string_view kLagunaSplitPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Token ids shared by Laguna checkpoints and the generated tokenizer (generation_config.json).
inline constexpr int32_t kLagunaBosId = 2;
inline constexpr int32_t kLagunaEosId = 2;
inline constexpr int32_t kLagunaEndOfTurnId = 24;  // </assistant>: stop on 2 AND 24
inline constexpr int32_t kLagunaPadId = 9;
inline constexpr int32_t kLagunaMaskId = 12;  // DFlash mask token

struct AddedTokenSpec {
  int32_t id;
  std::string_view content;
  bool special;  // 〈|...|〉 control tokens are special; chat markers are plain added tokens
};

// The added tokens of the generated tokenizer (ids 0..30, contiguous).
std::span<const AddedTokenSpec> LagunaStyleAddedTokens();

// Smallest vocab_size WriteSmallTokenizer accepts: the added tokens plus the 256 byte tokens.
int32_t MinSmallTokenizerVocabSize();

// tokenizer.json text for a tokenizer whose ids all lie below `vocab_size`.
Result<std::string> BuildSmallTokenizerJson(int32_t vocab_size);

// Writes <dir>/tokenizer.json and <dir>/tokenizer_config.json (creating dir), then loads the
// result back with dl::Tokenizer as a check. The chat template is not written (it ships as its own
// chat_template.jinja); config.json / generation_config.json are the model writer's.
Status WriteSmallTokenizer(const std::string& dir, int32_t vocab_size);

}  // namespace dl
