// Host sampling: a request's sampling parameters, the sampler (temperature, top-k, top-p over a
// counter-based uniform) and logprobs.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace dl {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id on ties, as GenerateGreedy)
  float top_p = 1.0f;        // (0, 1]
  int32_t top_k = 0;         // 0 or -1 = off
  std::optional<uint64_t> seed;  // sampling seed; absent = a fresh random seed per request
  int32_t max_tokens = 16;       // >= 1; exact unless a stop condition ends the sequence first
  bool ignore_eos = false;       // do not stop at the model's eos_token_ids
  std::vector<int32_t> stop_token_ids;  // extra stop ids (honoured even with ignore_eos)
  int32_t logprobs = -1;  // -1: none; N >= 0: the sampled token's logprob and the top N alternatives
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

struct TokenEvent {
  int32_t token = 0;
  float logprob = 0.0f;             // when SamplingParams.logprobs >= 0
  std::vector<TokenLogprob> top;    // the top N, best first
};

// Samples a token from `logits` with `p` (temperature 0 = argmax). `step` and `key` make the choice a
// pure function of (seed, step).
int32_t SampleToken(std::span<const float> logits, const SamplingParams& p, uint64_t key, uint64_t step);
// log_softmax(logits)[token] and the top `n` (token, logprob) pairs, best first.
void ComputeLogprobs(std::span<const float> logits, int32_t token, int32_t n, TokenEvent* event);

}  // namespace dl
