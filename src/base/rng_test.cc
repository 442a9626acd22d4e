#include "base/rng.h"

#include <cmath>

#include <gtest/gtest.h>

namespace dl {
namespace {

TEST(RngTest, ValuesDependOnlyOnKeyAndIndex) {
  const uint64_t a = StreamKey(42, "model.layers.0.self_attn.q_proj.weight");
  const uint64_t b = StreamKey(42, "model.layers.1.self_attn.q_proj.weight");
  const uint64_t c = StreamKey(43, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(NormalAt(a, 12345), NormalAt(a, 12345));
  EXPECT_NE(NormalAt(a, 12345), NormalAt(b, 12345));
}

TEST(RngTest, NormalHasUnitMomentsAndUniformIsInOpenInterval) {
  const uint64_t key = StreamKey(1, "moments");
  double sum = 0, sum2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = NormalAt(key, i);
    sum += x;
    sum2 += x * x;
    const float u = UniformAt(key, i);
    ASSERT_GT(u, 0.0f);
    ASSERT_LT(u, 1.0f);
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum2 / n, 1.0, 0.02);
}

}  // namespace
}  // namespace dl
