#include "tokenizer/bpe_trainer.h"

#include <map>
#include <unordered_map>

namespace dl {

std::vector<BpeMerge> TrainBytePairMerges(const std::vector<std::pair<std::string, int64_t>>& words,
                                          size_t max_new_tokens, int64_t min_frequency) {
  // Symbols 0..255 are bytes; later symbols are tokens in creation order.
  std::vector<std::string> symbol_bytes;
  symbol_bytes.reserve(256 + max_new_tokens);
  for (int b = 0; b < 256; ++b) symbol_bytes.emplace_back(1, static_cast<char>(b));
  std::unordered_map<std::string, int32_t> symbol_of;
  for (int b = 0; b < 256; ++b) symbol_of[symbol_bytes[b]] = b;

  struct Word {
    std::vector<int32_t> symbols;
    int64_t count;
  };
  std::vector<Word> corpus;
  corpus.reserve(words.size());
  for (const auto& [text, count] : words) {
    if (text.empty() || count <= 0) continue;
    Word w{{}, count};
    for (char c : text) w.symbols.push_back(static_cast<uint8_t>(c));
    corpus.push_back(std::move(w));
  }

  std::vector<BpeMerge> merges;
  size_t created = 0;
  std::map<std::pair<int32_t, int32_t>, int64_t> counts;  // ordered: deterministic ties
  while (created < max_new_tokens) {
    counts.clear();
    for (const Word& w : corpus) {
      for (size_t i = 0; i + 1 < w.symbols.size(); ++i)
        counts[{w.symbols[i], w.symbols[i + 1]}] += w.count;
    }
    std::pair<int32_t, int32_t> best{-1, -1};
    int64_t best_count = 0;
    for (const auto& [pair, count] : counts) {
      if (count > best_count) {
        best = pair;
        best_count = count;
      }
    }
    if (best_count < min_frequency || best.first < 0) break;

    const std::string merged = symbol_bytes[best.first] + symbol_bytes[best.second];
    int32_t new_symbol;
    bool is_new = false;
    if (auto it = symbol_of.find(merged); it != symbol_of.end()) {
      new_symbol = it->second;
    } else {
      new_symbol = static_cast<int32_t>(symbol_bytes.size());
      symbol_bytes.push_back(merged);
      symbol_of[merged] = new_symbol;
      is_new = true;
      ++created;
    }
    merges.push_back({symbol_bytes[best.first], symbol_bytes[best.second], is_new});
    // Apply left to right, non-overlapping (as BPE encoding will).
    for (Word& w : corpus) {
      std::vector<int32_t>& s = w.symbols;
      size_t out = 0;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == best.first && s[i + 1] == best.second) {
          s[out++] = new_symbol;
          i += 2;
        } else {
          s[out++] = s[i++];
        }
      }
      s.resize(out);
    }
  }
  return merges;
}

}  // namespace dl
