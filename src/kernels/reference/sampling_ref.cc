// The CPU statement of kernels/sampling.h's rule, step by step (the CPU backend samples with it; the
// CUDA sampler's tests compare with it).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "base/rng.h"
#include "kernels/reference/reference.h"

namespace dl::kernels::ref {

int32_t SampleRow(const float* logits, int vocab, const RowSampling& s, bool* finite) {
  std::vector<float> l(logits, logits + vocab);
  *finite = true;
  for (float x : l) {
    if (!std::isfinite(x)) *finite = false;
  }
  for (const LogitAdjustment& a : s.adjustments) {
    float& x = l[a.token];
    x = (x > 0.0f ? x / a.repetition : x * a.repetition) + a.add;
  }
  auto argmax = [&](const std::vector<float>& v, const std::vector<char>* keep) {
    int32_t best = -1;
    for (int i = 0; i < vocab; ++i) {
      if (keep && !(*keep)[i]) continue;
      if (best < 0 || v[i] > v[best]) best = i;
    }
    return std::max(best, 0);
  };
  if (s.greedy()) return argmax(l, nullptr);
  std::vector<float> z(vocab);
  for (int i = 0; i < vocab; ++i) z[i] = l[i] / s.temperature;
  std::vector<char> keep(vocab, 1);
  const float z_max = *std::max_element(z.begin(), z.end());
  if (s.min_p > 0.0f) {
    const float floor = z_max + std::log(s.min_p);
    for (int i = 0; i < vocab; ++i) keep[i] = keep[i] && z[i] >= floor;
  }
  // Values left, descending (ties adjacent).
  auto left_sorted = [&] {
    std::vector<float> v;
    for (int i = 0; i < vocab; ++i) {
      if (keep[i]) v.push_back(z[i]);
    }
    std::sort(v.begin(), v.end(), std::greater<float>());
    return v;
  };
  if (s.top_k > 0) {
    const std::vector<float> v = left_sorted();
    if (static_cast<size_t>(s.top_k) < v.size()) {
      const float kth = v[s.top_k - 1];
      for (int i = 0; i < vocab; ++i) keep[i] = keep[i] && z[i] >= kth;
    }
  }
  if (s.top_p < 1.0f) {
    const std::vector<float> v = left_sorted();
    double total = 0.0;
    for (float x : v) total += std::exp(static_cast<double>(x) - z_max);
    double acc = 0.0;
    float tau = v.back();
    for (float x : v) {
      acc += std::exp(static_cast<double>(x) - z_max);
      if (acc >= s.top_p * total) {
        tau = x;
        break;
      }
    }
    for (int i = 0; i < vocab; ++i) keep[i] = keep[i] && z[i] >= tau;
  }
  const uint64_t row_key = SplitMix64(s.key ^ SplitMix64(s.step));
  std::vector<float> g(vocab);
  for (int i = 0; i < vocab; ++i) {
    g[i] = z[i] - std::log(-std::log(UniformAt(row_key, static_cast<uint64_t>(i))));
  }
  return argmax(g, &keep);
}

}  // namespace dl::kernels::ref
