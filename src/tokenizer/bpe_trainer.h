// A small, deterministic byte-level BPE trainer (the classic algorithm: repeatedly merge the most
// frequent adjacent pair). It exists to give generated test models a real tokenizer; it is not
// meant for large corpora (each merge recounts every pair).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dl {

struct BpeMerge {
  std::string left;   // raw bytes
  std::string right;  // raw bytes
  bool new_token;     // false when left+right already existed (reached by another merge path)
};

// `words`: pre-tokenized pieces (raw bytes) with their counts. Learns merges until `max_new_tokens`
// new tokens exist or no pair occurs at least `min_frequency` times. Ties are broken by the
// smaller (left, right) pair of token ids (bytes first, then tokens in creation order), so the
// result depends only on the input.
std::vector<BpeMerge> TrainBytePairMerges(const std::vector<std::pair<std::string, int64_t>>& words,
                                          size_t max_new_tokens, int64_t min_frequency = 2);

}  // namespace dl
