// The CPU statement of kernels/sampling.h's rule, step by step (the CPU backend samples with it; the
// CUDA sampler's tests compare with it).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "base/rng.h"
#include "kernels/reference/reference.h"

namespace dl::kernels::ref {

void ApplyLogitAdjustments(float* logits, const std::vector<LogitAdjustment>& adjustments) {
  for (const LogitAdjustment& a : adjustments) logits[a.token] = AdjustedLogit(logits[a.token], a);
}

int32_t SampleRow(const float* logits, int vocab, const RowSampling& s, bool* finite) {
  std::vector<float> l(logits, logits + vocab);
  *finite = true;
  for (float x : l) {
    if (!std::isfinite(x)) *finite = false;
  }
  ApplyLogitAdjustments(l.data(), s.adjustments);
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
  // The ids left, by descending value, ties by ascending id.
  auto left_sorted = [&] {
    std::vector<int> ids;
    for (int i = 0; i < vocab; ++i) {
      if (keep[i]) ids.push_back(i);
    }
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return z[a] > z[b]; });
    return ids;
  };
  if (s.top_k > 0) {
    const std::vector<int> ids = left_sorted();
    for (size_t j = static_cast<size_t>(s.top_k); j < ids.size(); ++j) keep[ids[j]] = 0;
  }
  if (s.top_p < 1.0f) {
    // The tokens above tau (the largest value whose tokens and those above it hold top_p of the
    // mass) stay, and of those at tau the lowest ids until the mass reaches the target.
    const std::vector<int> ids = left_sorted();
    double total = 0.0;
    for (int i : ids) total += std::exp(static_cast<double>(z[i]) - z_max);
    const double target = s.top_p * total;
    double acc = 0.0;
    size_t j = 0;
    while (j < ids.size()) {  // over groups of equal values
      size_t e = j;
      double group = 0.0;
      while (e < ids.size() && z[ids[e]] == z[ids[j]]) group += std::exp(static_cast<double>(z[ids[e++]]) - z_max);
      if (acc + group >= target) {
        const double w = std::exp(static_cast<double>(z[ids[j]]) - z_max);
        const size_t ties = std::max<size_t>(1, static_cast<size_t>(std::ceil((target - acc) / w)));
        for (size_t q = j + std::min(ties, e - j); q < ids.size(); ++q) keep[ids[q]] = 0;
        break;
      }
      acc += group;
      j = e;
    }
  }
  const uint64_t row_key = SplitMix64(s.key ^ SplitMix64(s.step));
  std::vector<float> g(vocab);
  for (int i = 0; i < vocab; ++i) {
    g[i] = z[i] - std::log(-std::log(UniformAt(row_key, static_cast<uint64_t>(i))));
  }
  return argmax(g, &keep);
}

}  // namespace dl::kernels::ref
