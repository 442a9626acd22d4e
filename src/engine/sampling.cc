#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "base/rng.h"
#include "kernels/reference/reference.h"
#include "engine/engine.h"

namespace dl {

bool HasLogitProcessors(const SamplingParams& p) {
  return !p.logit_bias.empty() || p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f ||
         p.presence_penalty != 0.0f;
}

std::vector<LogitAdjustment> LogitAdjustmentsFor(const SamplingParams& p, std::span<const int32_t> prompt,
                                                 std::span<const int32_t> generated) {
  std::vector<LogitAdjustment> out;
  if (!HasLogitProcessors(p)) return out;
  // One entry per token any processor touches, in id order (sorted copies instead of
  // vocabulary-sized masks: a step touches only the ids it has seen).
  std::map<int32_t, LogitAdjustment> by_token;
  auto entry = [&](int32_t t) -> LogitAdjustment& {
    LogitAdjustment& a = by_token[t];
    a.token = t;
    return a;
  };
  for (const auto& [t, bias] : p.logit_bias) entry(t).bias = std::clamp(bias, -100.0f, 100.0f);
  if (p.repetition_penalty != 1.0f) {
    for (int32_t t : prompt) entry(t).repetition = p.repetition_penalty;
    for (int32_t t : generated) entry(t).repetition = p.repetition_penalty;
  }
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
    std::map<int32_t, int32_t> counts;
    for (int32_t t : generated) ++counts[t];
    for (const auto& [t, n] : counts) {
      entry(t).penalty = p.frequency_penalty * static_cast<float>(n) + p.presence_penalty;
    }
  }
  out.reserve(by_token.size());
  for (const auto& [t, a] : by_token) out.push_back(a);
  return out;
}

RowSampling RowSamplingFor(const SamplingParams& p, uint64_t key, uint64_t step, std::span<const int32_t> prompt,
                           std::span<const int32_t> generated) {
  RowSampling r;
  r.temperature = p.temperature;
  r.top_k = p.top_k > 0 ? p.top_k : 0;
  r.top_p = p.top_p;
  r.min_p = p.min_p;
  r.key = key;
  r.step = step;
  r.adjustments = LogitAdjustmentsFor(p, prompt, generated);
  return r;
}

void ApplyLogitProcessors(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt,
                          std::span<const int32_t> generated) {
  std::vector<LogitAdjustment> adj = LogitAdjustmentsFor(p, prompt, generated);
  const int64_t v = static_cast<int64_t>(logits.size());
  adj.erase(std::remove_if(adj.begin(), adj.end(), [v](const LogitAdjustment& a) { return a.token < 0 || a.token >= v; }),
            adj.end());
  kernels::ref::ApplyLogitAdjustments(logits.data(), adj);
}

int32_t SampleToken(std::span<const float> logits, const SamplingParams& p, uint64_t key, uint64_t step) {
  bool finite = true;
  return kernels::ref::SampleRow(logits.data(), static_cast<int>(logits.size()), RowSamplingFor(p, key, step, {}, {}),
                                 &finite);
}

void ComputeLogprobs(std::span<const float> logits, int32_t token, int32_t n, TokenEvent* event) {
  float max_logit = -INFINITY;
  for (float x : logits) max_logit = std::max(max_logit, x);
  double total = 0.0;
  for (float x : logits) total += std::exp(static_cast<double>(x) - max_logit);
  const double lse = max_logit + std::log(total);
  event->logprob = static_cast<float>(logits[token] - lse);
  event->top.clear();
  const int32_t v = static_cast<int32_t>(logits.size());
  n = std::min(n, v);
  if (n <= 0) return;
  std::vector<int32_t> idx(static_cast<size_t>(v));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int32_t i = 0; i < n; ++i) {
    event->top.push_back({idx[i], static_cast<float>(logits[idx[i]] - lse)});
  }
}

}  // namespace dl
