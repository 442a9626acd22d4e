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

// Until the CUDA FP8 kernels land, an FP8 checkpoint (file or --shape) is refused on CUDA by name,
// never uploaded as something else.
TEST(CudaWeightSupportTest, Fp8WeightsAreRefusedNamingTheTensor) {
  auto c = ShapeConfig("tiny");
  ASSERT_TRUE(c.ok());
  auto bf16 = MakeShapeOnlyCheckpoint(*c);
  ASSERT_TRUE(bf16.ok());
  EXPECT_TRUE(CheckCudaWeightSupport(*bf16).ok());
  Fp8Options f;
  auto fp8 = MakeShapeOnlyCheckpoint(*c, &f);
  ASSERT_TRUE(fp8.ok());
  const Status s = CheckCudaWeightSupport(*fp8);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("model.layers.1.mlp.experts.0.gate_proj.weight"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("--backend cpu"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace dl
