// A small model with Laguna XS.2's attention geometry (D 128, 48/64 query heads over 8 KV heads,
// window 512), so the XS.2 attention presets run (pages of 16, 32 and 64, at TP 1 and 2), with narrow
// MLPs (hidden 512, 16 experts of 128, 4 per token, shared expert 128, vocabulary 4,096) so it builds
// quickly. Used by the GPU tests of the CUDA backend and of tensor parallelism.
#pragma once

#include <gtest/gtest.h>

#include "model/config.h"
#include "model/shapes.h"

namespace dl::test_util {

inline ModelConfig SmallXs2Geometry(int layers = 4) {
  auto c = ShapeConfig("xs2", layers);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  ModelConfig cfg = c.ok() ? *c : ModelConfig{};
  cfg.hidden_size = 512;
  cfg.intermediate_size = 1024;
  cfg.num_experts = 16;
  cfg.num_experts_per_tok = 4;
  cfg.moe_intermediate_size = 128;
  cfg.shared_expert_intermediate_size = 128;
  cfg.vocab_size = 4096;
  return cfg;
}

}  // namespace dl::test_util
