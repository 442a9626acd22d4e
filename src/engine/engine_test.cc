#include "engine/engine.h"

#include <limits>

#include <gtest/gtest.h>

namespace dl {
namespace {

// --skip-ops is a CUDA timing experiment: on the CPU backend (chosen or the auto fallback) it is an
// error, never silently ignored (a bench would otherwise label a full run as one with ops left out).
TEST(EngineTest, SkipOpsIsRefusedOnTheCpuBackend) {
  EngineOptions o;
  o.shape = "tiny";
  o.backend = BackendKind::kCpu;
  o.max_seq_len = 64;
  o.skip_ops = {"moe"};
  auto e = LoadEngine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("--skip-ops"), std::string::npos) << e.status().message();
  o.skip_ops.clear();
  EXPECT_TRUE(LoadEngine(o).ok());
}

}  // namespace
}  // namespace dl

namespace dl {
namespace {

TEST(EngineTest, NonFiniteLogitsAreAnError) {
  std::vector<float> logits = {0.5f, 1.0f, -2.0f};
  EXPECT_TRUE(CheckFiniteLogits(logits, "step 0").ok());
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    logits[1] = bad;
    Status st = CheckFiniteLogits(logits, "step 3");
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kDataLoss);
    EXPECT_NE(st.message().find("step 3: logit 1 of 3"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace dl
