#include "engine/engine.h"

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
