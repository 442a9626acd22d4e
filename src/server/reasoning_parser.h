// Splits a chat completion's text into reasoning (`<think>…</think>`) and content, as vLLM's
// `poolside_v1` reasoning parser does for Laguna (a DeepSeek-R1 style parser whose look-back over
// the prompt stops at the current `<assistant>` token):
//
//  * The prompt decides how the output starts. Walking the prompt's ids backwards from its end to
//    the current `<assistant>` token (or the start): a `<think>` first means the template opened
//    reasoning (Laguna's generation prompt with enable_thinking, the default): the output starts as
//    reasoning; a `</think>` first means reasoning is already over (enable_thinking false): the whole
//    output is content and nothing is parsed; neither means the output starts as content and a
//    `<think>` in it opens reasoning.
//  * While reasoning, `<think>` markers are dropped and the first `</think>` ends reasoning; from then
//    on everything, markers included, is content (vLLM partitions at the first `</think>`).
//  * Text that could be the start of a marker is held back until it is known not to be, so
//    streamed pieces concatenate to exactly what a whole-text parse gives.
//
// One difference from vLLM, on purpose: vLLM picks its parser from chat_template_kwargs
// (enable_thinking absent means no parsing, so `…</think>answer` arrives as content although
// Laguna's template defaults to thinking); here the prompt itself decides, which gives vLLM's result
// whenever enable_thinking is passed explicitly.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "tokenizer/tokenizer.h"

namespace dl::api {

inline constexpr std::string_view kThinkStart = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";
inline constexpr std::string_view kAssistantStart = "<assistant>";

// The marker ids of a tokenizer; reasoning is parsed only when both think markers are single
// tokens (vLLM's parser refuses to start otherwise).
struct ReasoningTokens {
  std::optional<int32_t> think, end_think, assistant;
  static ReasoningTokens From(const Tokenizer& tokenizer);
  bool usable() const { return think.has_value() && end_think.has_value(); }
};

struct ReasoningSplit {
  std::string reasoning;
  std::string content;
};

class ReasoningParser {
 public:
  enum class Mode {
    kReasoning,    // inside <think>…: text is reasoning until </think>
    kContent,      // no reasoning yet: a <think> opens it
    kContentOnly,  // reasoning is over (or off): everything is content
  };
  // How the output of `prompt` starts (see the file comment).
  static Mode StartMode(std::span<const int32_t> prompt, const ReasoningTokens& ids);

  explicit ReasoningParser(Mode start) : mode_(start) {}
  // The part of `text` that can be classified now.
  ReasoningSplit Add(std::string_view text);
  // End of output: whatever was held back.
  ReasoningSplit Finish();
  Mode mode() const { return mode_; }

  // Whole text at once: Add + Finish.
  static ReasoningSplit Parse(std::string_view text, Mode start);

 private:
  Mode mode_;
  std::string pending_;
};

// The length of the longest suffix of `text` that is a proper prefix of `marker` (text that must be
// held back because the marker may still be completing).
size_t PartialMarkerSuffix(std::string_view text, std::string_view marker);

}  // namespace dl::api
