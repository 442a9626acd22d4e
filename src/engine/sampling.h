// A request's sampling parameters (OpenAI/vLLM fields), how they become the backend's per-row
// sampling (kernels/sampling.h: RowSampling with its logit adjustments), and logprobs.
//
// Order of operations for one step, the same as vLLM's v1 sampler (vllm/v1/sample/sampler.py), so a
// request means the same here and there (docs/api.md):
//   0. logprobs, when asked, come from the raw logits (vLLM's default logprobs_mode raw_logprobs);
//   1. the logit processors, in float32, in this order (LogitAdjustmentsFor; the backend applies
//      them: kernels::AdjustedLogit):
//      a. logit_bias: l[t] += clamp(bias[t], -100, 100);
//      b. repetition penalty r, once per distinct token of prompt + generated:
//         l[t] = l[t] > 0 ? l[t] / r : l[t] * r;
//      c. frequency penalty f: l[t] -= f * (times t was generated);
//      d. presence penalty p: l[t] -= p when t was generated at least once;
//   2. the token (kernels/sampling.h, on the device for CUDA): temperature 0 is the argmax of the
//      processed logits (so penalties and logit_bias change greedy output too); otherwise, over
//      z = l / temperature, min_p drops tokens below min_p times the top probability, top-k keeps
//      the k largest (ties at the k-th value all stay), top-p the smallest set of largest values
//      whose mass reaches top_p of what is left (ties at its edge all stay), and the token is an
//      exact draw from softmax(z) over what is left (Gumbel-max with counter-based uniforms of
//      (key, step): the same (logits, parameters, seed, step) give the same token in any batch).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "model/forward_batch.h"

namespace dl {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id on ties, as GenerateGreedy)
  float top_p = 1.0f;        // (0, 1]
  int32_t top_k = 0;         // 0 or -1 = off
  float min_p = 0.0f;        // [0, 1]; 0 = off
  float presence_penalty = 0.0f;    // over generated tokens; 0 = off
  float frequency_penalty = 0.0f;   // over generated tokens, times their count; 0 = off
  float repetition_penalty = 1.0f;  // > 0, over prompt + generated tokens; 1 = off
  std::map<int32_t, float> logit_bias;  // token id -> bias, applied clamped to [-100, 100]
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
  std::chrono::steady_clock::time_point emitted{};  // when the engine thread produced it
  float logprob = 0.0f;             // when SamplingParams.logprobs >= 0
  std::vector<TokenLogprob> top;    // the top N, best first
};

// True when ApplyLogitProcessors would change some logit for these parameters.
bool HasLogitProcessors(const SamplingParams& p);

// Step 1 of the order above as per-token adjustments, one per token a processor touches (ascending
// id). `prompt` and `generated` are the sequence's token ids so far.
std::vector<LogitAdjustment> LogitAdjustmentsFor(const SamplingParams& p, std::span<const int32_t> prompt,
                                                 std::span<const int32_t> generated);
// The backend's parameters for the row that chooses the sequence's token number `step`.
RowSampling RowSamplingFor(const SamplingParams& p, uint64_t key, uint64_t step, std::span<const int32_t> prompt,
                           std::span<const int32_t> generated);
// Step 1 applied on the host, in place (ids outside `logits` are skipped).
void ApplyLogitProcessors(std::span<float> logits, const SamplingParams& p,
                          std::span<const int32_t> prompt, std::span<const int32_t> generated);
// Step 2 on the host (kernels::ref::SampleRow) for already processed logits: the token the backend
// chooses for such logits with `p`, seed key `key`, token number `step`.
int32_t SampleToken(std::span<const float> logits, const SamplingParams& p, uint64_t key, uint64_t step);
// log_softmax(logits)[token] and the top `n` (token, logprob) pairs, best first.
void ComputeLogprobs(std::span<const float> logits, int32_t token, int32_t n, TokenEvent* event);

}  // namespace dl
