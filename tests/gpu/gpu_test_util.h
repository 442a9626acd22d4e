// Helpers shared by the GPU kernel tests (kernels_gpu_test.cc, kernels_fp8_gpu_test.cc): the visible
// skip where no CUDA device is usable, status assertions, random BF16 data, device buffers to and from
// the host, and the element-wise tolerance check every kernel comparison uses.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "base/rng.h"
#include "cuda/buffer.h"
#include "cuda/device.h"
#include "kernels/common.h"

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

}  // namespace dl::kernels::gpu_test
