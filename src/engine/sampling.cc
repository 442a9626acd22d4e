#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/rng.h"
#include "engine/engine.h"

namespace dl {

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
  const int32_t k = use_k ? p.top_k : n;
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  std::vector<double> prob(static_cast<size_t>(k));
  double total = 0.0;
  for (int32_t i = 0; i < k; ++i) {
    prob[i] = std::exp((logits[idx[i]] - max_logit) * inv_t);
    total += prob[i];
  }
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
