// Helpers shared by the GPU kernel tests (kernels_gpu_test.cc, kernels_fp8_gpu_test.cc): the visible
// skip where no CUDA device is usable, status assertions, random BF16 data, device buffers to and from
// the host, and the element-wise tolerance check every kernel comparison uses.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "base/rng.h"
#include "cuda/buffer.h"
#include "cuda/device.h"
#include "kernels/common.h"
#include "kernels/ops.h"

#define SKIP_WITHOUT_GPU()                                                  \
  do {                                                                      \
    std::string why;                                                        \
    if (dl::cuda::DeviceCount(&why) == 0) GTEST_SKIP() << "no CUDA device: " << why; \
  } while (0)

#define ASSERT_OK(expr)                                          \
  do {                                                           \
    const ::dl::Status s_ = (expr);                              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.message();       \
  } while (0)

namespace dl::kernels::gpu_test {

inline std::vector<bf16> RandomBf16(size_t n, uint64_t key, float scale = 1.0f) {
  std::vector<bf16> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = FloatToBf16(scale * NormalAt(key, i));
  return v;
}

template <typename T>
cuda::DeviceBuffer Upload(const std::vector<T>& v) {
  auto b = cuda::DeviceBuffer::Create(std::max<size_t>(v.size() * sizeof(T), 16));
  EXPECT_TRUE(b.ok()) << b.status().message();
  if (!v.empty()) EXPECT_TRUE(b->CopyFromHost(v.data(), v.size() * sizeof(T)).ok());
  return std::move(b).value();
}
template <typename T>
std::vector<T> Download(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  EXPECT_TRUE(b.CopyToHost(v.data(), n * sizeof(T)).ok());
  return v;
}
inline cuda::DeviceBuffer Alloc(size_t bytes, int poison = 0xff) {
  auto b = cuda::DeviceBuffer::Create(std::max<size_t>(bytes, 16));
  EXPECT_TRUE(b.ok()) << b.status().message();
  EXPECT_TRUE(b->Fill(poison).ok());
  return std::move(b).value();
}
inline void Sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }
inline std::vector<bf16> Rows(const std::vector<bf16>& v, size_t row_elems, int first, int n) {
  return std::vector<bf16>(v.begin() + first * row_elems, v.begin() + (first + n) * row_elems);
}
// |got - want| <= atol + rtol * |want| for every element; NaN (poison left unwritten) never passes.
inline void ExpectClose(const std::vector<bf16>& got, const std::vector<bf16>& want, float atol, float rtol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0, first = 0;
  float worst = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = Bf16ToFloat(got[i]), w = Bf16ToFloat(want[i]);
    const float err = std::fabs(g - w);
    if (!(err <= atol + rtol * std::fabs(w))) {
      if (bad++ == 0) first = i;
    }
    if (err > worst || std::isnan(err)) worst = err;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                     << " elements outside tolerance; first at " << first << " got "
                     << Bf16ToFloat(got[first]) << " want " << Bf16ToFloat(want[first])
                     << "; max abs err " << worst;
}

// A shuffled subset (T / 2 + 1 of the T tokens, order from `seed`) of a MoE launch's tokens, run as a
// batch of its own with the same parameters, gives each token the row it got among all T (y_all:
// [T, d]): the grouping never changes a token's bits.
inline void ExpectShuffledSubsetGivesTheSameRows(const MoeParams& p, const std::vector<bf16>& x,
                                                 const std::vector<bf16>& y_all, uint32_t seed) {
  const int T = p.num_tokens, d = p.d;
  std::vector<int> pick(T);
  std::iota(pick.begin(), pick.end(), 0);
  std::shuffle(pick.begin(), pick.end(), std::mt19937(seed));
  pick.resize(T / 2 + 1);
  std::vector<bf16> xs;
  for (int t : pick) xs.insert(xs.end(), x.begin() + static_cast<size_t>(t) * d, x.begin() + static_cast<size_t>(t + 1) * d);
  auto d_xs = Upload(xs);
  const int n = static_cast<int>(pick.size());
  auto d_ys = Alloc(static_cast<size_t>(n) * d * 2), d_idss = Alloc(static_cast<size_t>(n) * p.top_k * 4);
  MoeParams sub = p;
  sub.num_tokens = n, sub.x = d_xs.as<bf16>(), sub.y = d_ys.as<bf16>(), sub.topk_ids = d_idss.as<int32_t>();
  ASSERT_OK(Moe(sub, nullptr));
  Sync();
  const auto ys = Download<bf16>(d_ys, static_cast<size_t>(n) * d);
  for (int i = 0; i < n; ++i) EXPECT_EQ(Rows(ys, d, i, 1), Rows(y_all, d, pick[i], 1)) << "token " << pick[i];
}

}  // namespace dl::kernels::gpu_test
