#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/rng.h"
#include "engine/engine.h"

namespace dl {

bool HasLogitProcessors(const SamplingParams& p) {
  return !p.logit_bias.empty() || p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f ||
         p.presence_penalty != 0.0f;
}

void ApplyLogitProcessors(std::span<float> logits, const SamplingParams& p,
                          std::span<const int32_t> prompt, std::span<const int32_t> generated) {
  const int64_t v = static_cast<int64_t>(logits.size());
  auto in_vocab = [v](int32_t t) { return t >= 0 && t < v; };
  for (const auto& [t, bias] : p.logit_bias) {
    if (in_vocab(t)) logits[t] += std::clamp(bias, -100.0f, 100.0f);
  }
  // Sorted copies instead of vocabulary-sized masks: a step touches only the ids it has seen.
  if (p.repetition_penalty != 1.0f) {
    std::vector<int32_t> seen(prompt.begin(), prompt.end());
    seen.insert(seen.end(), generated.begin(), generated.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    const float r = p.repetition_penalty;
    for (int32_t t : seen) {
      if (!in_vocab(t)) continue;
      logits[t] = logits[t] > 0.0f ? logits[t] / r : logits[t] * r;
    }
  }
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
    std::vector<int32_t> out(generated.begin(), generated.end());
    std::sort(out.begin(), out.end());
    for (size_t i = 0; i < out.size();) {
      size_t j = i;
      while (j < out.size() && out[j] == out[i]) ++j;
      const int32_t t = out[i];
      if (in_vocab(t)) {
        logits[t] -= p.frequency_penalty * static_cast<float>(j - i);
        logits[t] -= p.presence_penalty;
      }
      i = j;
    }
  }
}

int32_t SampleToken(std::span<const float> logits, const SamplingParams& p, uint64_t key,
                    uint64_t step) {
  if (p.temperature <= 0.0f) return ArgmaxWithMargin(logits).first;
  const int32_t n = static_cast<int32_t>(logits.size());
  const double inv_t = 1.0 / p.temperature;
  const double u = UniformAt(key, step);
  const bool use_k = p.top_k > 0 && p.top_k < n;
  const bool use_p = p.top_p < 1.0f;
  float max_logit = -INFINITY;
  for (float x : logits) max_logit = std::max(max_logit, x);
  // min_p keeps w = exp((l - max) / t) >= min_p: probability >= min_p * the top probability.
  const bool use_min_p = p.min_p > 0.0f;
  if (!use_k && !use_p && use_min_p) {
    double total = 0.0;
    int32_t last = 0;
    for (int32_t i = 0; i < n; ++i) {
      const double w = std::exp((logits[i] - max_logit) * inv_t);
      if (w >= p.min_p) total += w;
    }
    const double target = u * total;
    double acc = 0.0;
    for (int32_t i = 0; i < n; ++i) {
      const double w = std::exp((logits[i] - max_logit) * inv_t);
      if (w < p.min_p) continue;
      acc += w;
      last = i;
      if (acc >= target) return i;
    }
    return last;
  }
  if (!use_k && !use_p) {
    // The whole distribution in id order: no sort needed.
    double total = 0.0;
    for (int32_t i = 0; i < n; ++i) total += std::exp((logits[i] - max_logit) * inv_t);
    double target = u * total, acc = 0.0;
    for (int32_t i = 0; i < n; ++i) {
      acc += std::exp((logits[i] - max_logit) * inv_t);
      if (acc >= target) return i;
    }
    return n - 1;
  }
  int32_t k = use_k ? p.top_k : n;
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  std::vector<double> prob(static_cast<size_t>(k));
  for (int32_t i = 0; i < k; ++i) prob[i] = std::exp((logits[idx[i]] - max_logit) * inv_t);
  // Descending order: the tokens min_p keeps are a prefix (the first has w = 1 >= min_p).
  if (use_min_p) {
    int32_t m = 1;
    while (m < k && prob[m] >= p.min_p) ++m;
    k = m;
  }
  double total = 0.0;
  for (int32_t i = 0; i < k; ++i) total += prob[i];
  int32_t kept = k;
  if (use_p) {
    double acc = 0.0;
    for (int32_t i = 0; i < k; ++i) {
      acc += prob[i];
      if (acc >= p.top_p * total) {
        kept = i + 1;
        break;
      }
    }
  }
  double kept_total = 0.0;
  for (int32_t i = 0; i < kept; ++i) kept_total += prob[i];
  const double target = u * kept_total;
  double acc = 0.0;
  for (int32_t i = 0; i < kept; ++i) {
    acc += prob[i];
    if (acc >= target) return idx[i];
  }
  return idx[kept - 1];
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
