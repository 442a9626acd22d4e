#include "model/backend_support.h"

#include <string>
#include <utility>

#include <gtest/gtest.h>

#include "model/shapes.h"

namespace dl {
namespace {

TEST(CudaShapeSupportTest, NamesTheWidthThatIsNotAMultipleOfEight) {
  for (const auto& name : ShapeNames()) {
    auto c = ShapeConfig(name);
    ASSERT_TRUE(c.ok());
    EXPECT_TRUE(CheckCudaShapeSupport(*c).ok()) << name;
  }
  auto c = ShapeConfig("tiny");
  ASSERT_TRUE(c.ok());
  const std::pair<const char*, int64_t ModelConfig::*> keys[] = {
      {"moe_intermediate_size", &ModelConfig::moe_intermediate_size},
      {"shared_expert_intermediate_size", &ModelConfig::shared_expert_intermediate_size},
      {"intermediate_size", &ModelConfig::intermediate_size},
      {"hidden_size", &ModelConfig::hidden_size},
      {"head_dim", &ModelConfig::head_dim}};
  for (const auto& [key, member] : keys) {
    ModelConfig bad = *c;
    bad.*member = 106;
    Status st = CheckCudaShapeSupport(bad);
    ASSERT_FALSE(st.ok()) << key;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(std::string(key) + " is 106"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("16-byte"), std::string::npos) << st.message();
  }
  // A width only unused layer types have does not matter: no dense layer, odd dense width.
  ModelConfig all_sparse = *c;
  for (auto& t : all_sparse.mlp_layer_types) t = MlpType::kSparse;
  all_sparse.intermediate_size = 7;
  EXPECT_TRUE(CheckCudaShapeSupport(all_sparse).ok());
}

TEST(BackendSupportTest, CudaFp8WeightsNeedSixteenCodeRowsAndBlocksThatKeepLoadsWhole) {
  EXPECT_TRUE(CheckCudaFp8WeightSupport("w", 2048, 128).ok());   // 128x128 blocks
  EXPECT_TRUE(CheckCudaFp8WeightSupport("w", 400, 128).ok());    // a partial last block
  EXPECT_TRUE(CheckCudaFp8WeightSupport("w", 2064, 2064).ok());  // per channel / per tensor: the whole row
  EXPECT_TRUE(CheckCudaFp8WeightSupport("w", 512, 16).ok());
  for (auto [cols, bc] : {std::pair{2056, 128}, std::pair{2048, 96}, std::pair{2048, 8}, std::pair{2048, 0}}) {
    Status st = CheckCudaFp8WeightSupport("model.layers.0.self_attn.q_proj.weight", cols, bc);
    ASSERT_FALSE(st.ok()) << cols << " " << bc;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("q_proj"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("--backend cpu"), std::string::npos) << st.message();
  }
}

// FP8 checkpoints (file or --shape) pass the CUDA check where every FP8 row can be read 16 codes at a
// time; the BF16 tiny shape passes too.
TEST(CudaWeightSupportTest, Fp8ShapeCheckpointsPassWhereTheKernelsRunThem) {
  auto c = ShapeConfig("tiny");
  ASSERT_TRUE(c.ok());
  auto bf16 = MakeShapeOnlyCheckpoint(*c);
  ASSERT_TRUE(bf16.ok());
  EXPECT_TRUE(CheckCudaWeightSupport(*bf16).ok());
  Fp8Options f;
  auto fp8 = MakeShapeOnlyCheckpoint(*c, &f);
  ASSERT_TRUE(fp8.ok());
  const Status s = CheckCudaWeightSupport(*fp8);
  EXPECT_TRUE(s.ok()) << s.message();
}

}  // namespace
}  // namespace dl
