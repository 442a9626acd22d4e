// Host sampling: a request's sampling parameters, the logit processors that run before sampling
// (logit_bias, repetition / frequency / presence penalties), the sampler (temperature, min_p, top-k,
// top-p over a counter-based uniform) and logprobs.
//
// Order of operations for one step, the same as vLLM's v1 sampler (vllm/v1/sample/sampler.py), so a
// request means the same here and there; a device sampler must follow it too (docs/api.md):
//   0. logprobs, when asked, come from the raw logits (vLLM's default logprobs_mode raw_logprobs);
//   1. ApplyLogitProcessors, in float32, in this order:
//      a. logit_bias: l[t] += clamp(bias[t], -100, 100);
//      b. repetition penalty r, once per distinct token of prompt + generated:
//         l[t] = l[t] > 0 ? l[t] / r : l[t] * r;
//      c. frequency penalty f: l[t] -= f * (times t was generated);
//      d. presence penalty p: l[t] -= p when t was generated at least once;
//   2. SampleToken: temperature 0 is the argmax of the processed logits (so penalties and
//      logit_bias change greedy output too); otherwise w[i] = exp((l[i] - max l) / temperature), and
//      a. min_p: tokens with w[i] < min_p are dropped (probability < min_p * the top probability);
//      b. top-k: the k largest logits are kept (ties: lower id first);
//      c. top-p: the shortest prefix by descending logit whose mass reaches top_p of what is left;
//      d. one draw u = UniformAt(key, step) over what is left.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

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
  float logprob = 0.0f;             // when SamplingParams.logprobs >= 0
  std::vector<TokenLogprob> top;    // the top N, best first
};

// True when ApplyLogitProcessors would change some logit for these parameters.
bool HasLogitProcessors(const SamplingParams& p);

// Step 1 of the order above, in place. `prompt` and `generated` are the sequence's token ids so far;
// ids outside `logits` are skipped (the scheduler refuses them before).
void ApplyLogitProcessors(std::span<float> logits, const SamplingParams& p,
                          std::span<const int32_t> prompt, std::span<const int32_t> generated);

// Samples a token from `logits` with `p` (temperature 0 = argmax). `step` and `key` make the choice a
// pure function of (seed, step).
int32_t SampleToken(std::span<const float> logits, const SamplingParams& p, uint64_t key, uint64_t step);
// log_softmax(logits)[token] and the top `n` (token, logprob) pairs, best first.
void ComputeLogprobs(std::span<const float> logits, int32_t token, int32_t n, TokenEvent* event);

}  // namespace dl
