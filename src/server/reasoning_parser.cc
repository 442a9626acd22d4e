#include "server/reasoning_parser.h"

#include <algorithm>

namespace dl::api {

size_t PartialMarkerSuffix(std::string_view text, std::string_view marker) {
  for (size_t k = std::min(marker.size() - 1, text.size()); k > 0; --k) {
    if (text.substr(text.size() - k) == marker.substr(0, k)) return k;
  }
  return 0;
}

ReasoningTokens ReasoningTokens::From(const Tokenizer& tokenizer) {
  ReasoningTokens t;
  t.think = tokenizer.TokenToId(kThinkStart);
  t.end_think = tokenizer.TokenToId(kThinkEnd);
  t.assistant = tokenizer.TokenToId(kAssistantStart);
  return t;
}

ReasoningParser::Mode ReasoningParser::StartMode(std::span<const int32_t> prompt,
                                                 const ReasoningTokens& ids) {
  if (!ids.usable()) return Mode::kContentOnly;
  for (auto it = prompt.rbegin(); it != prompt.rend(); ++it) {
    if (*it == *ids.think) return Mode::kReasoning;
    if (*it == *ids.end_think) return Mode::kContentOnly;
    if (ids.assistant && *it == *ids.assistant) break;
  }
  return Mode::kContent;
}

ReasoningSplit ReasoningParser::Add(std::string_view text) {
  ReasoningSplit out;
  if (mode_ == Mode::kContentOnly) {
    out.content.assign(text);
    return out;
  }
  pending_.append(text);
  while (!pending_.empty()) {
    if (mode_ == Mode::kContentOnly) {
      out.content += pending_;
      pending_.clear();
      break;
    }
    if (mode_ == Mode::kContent) {
      const size_t at = pending_.find(kThinkStart);
      if (at == std::string::npos) {
        const size_t hold = PartialMarkerSuffix(pending_, kThinkStart);
        out.content += pending_.substr(0, pending_.size() - hold);
        pending_.erase(0, pending_.size() - hold);
        break;
      }
      out.content += pending_.substr(0, at);
      pending_.erase(0, at + kThinkStart.size());
      mode_ = Mode::kReasoning;
      continue;
    }
    // Reasoning: the earliest of a (dropped) <think> or the closing </think>.
    const size_t start = pending_.find(kThinkStart);
    const size_t end = pending_.find(kThinkEnd);
    if (end != std::string::npos && (start == std::string::npos || end < start)) {
      out.reasoning += pending_.substr(0, end);
      pending_.erase(0, end + kThinkEnd.size());
      mode_ = Mode::kContentOnly;
      continue;
    }
    if (start != std::string::npos) {
      out.reasoning += pending_.substr(0, start);
      pending_.erase(0, start + kThinkStart.size());
      continue;
    }
    const size_t hold =
        std::max(PartialMarkerSuffix(pending_, kThinkStart), PartialMarkerSuffix(pending_, kThinkEnd));
    out.reasoning += pending_.substr(0, pending_.size() - hold);
    pending_.erase(0, pending_.size() - hold);
    break;
  }
  return out;
}

ReasoningSplit ReasoningParser::Finish() {
  ReasoningSplit out;
  if (mode_ == Mode::kReasoning) {
    out.reasoning = std::move(pending_);
  } else {
    out.content = std::move(pending_);
  }
  pending_.clear();
  return out;
}

ReasoningSplit ReasoningParser::Parse(std::string_view text, Mode start) {
  ReasoningParser p(start);
  ReasoningSplit a = p.Add(text);
  ReasoningSplit b = p.Finish();
  a.reasoning += b.reasoning;
  a.content += b.content;
  return a;
}

}  // namespace dl::api
