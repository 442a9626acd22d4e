#include "model/param_count.h"

#include <gtest/gtest.h>

#include "model/shapes.h"

namespace dl {
namespace {

// Expected values are the spec's hand arithmetic (laguna-architecture §6, laguna-checkpoints §1.5-1.6),
// which also matches the published safetensors index totals.
TEST(ParamCountTest, Xs2MatchesSpec) {
  auto c = ShapeConfig("xs2");
  ASSERT_TRUE(c.ok());
  ParamCounts p = CountParams(*c);
  EXPECT_EQ(p.total, 33'442'617'088);
  EXPECT_EQ(p.total * 2, 66'885'234'176);  // BF16 checkpoint bytes
  EXPECT_EQ(p.active, 2'811'614'976);
  EXPECT_EQ(p.embedding_row, 2048);
  EXPECT_EQ(p.bytes_per_token_bf16(), 5'623'229'952);
  EXPECT_EQ(p.bytes_per_token_fp8_experts(), 4'641'762'816);
  EXPECT_EQ(p.bytes_per_token_fp8_linears(), 3'042'684'416);
  EXPECT_EQ(p.attention, 1'430'988'800);
  EXPECT_EQ(p.embedding, 205'520'896);
  EXPECT_EQ(p.lm_head, 205'520'896);
  EXPECT_EQ(p.dense_mlp, 50'331'648);
  EXPECT_EQ(p.block_norms, 165'888);
  EXPECT_EQ(p.active_routed, 981'467'136);
  EXPECT_EQ(p.routed_experts + p.shared_experts + p.routers + p.correction_biases, 31'550'088'960);
}

TEST(ParamCountTest, S21MatchesSpec) {
  auto c = ShapeConfig("s21");
  ASSERT_TRUE(c.ok());
  ParamCounts p = CountParams(*c);
  EXPECT_EQ(p.total, 117'561'977'600);
  EXPECT_EQ(p.total * 2, 235'123'955'200);
  EXPECT_EQ(p.active, 8'140'974'848);
  EXPECT_EQ(p.bytes_per_token_bf16(), 16'281'949'696);
  EXPECT_EQ(p.attention, 2'803'150'848);
  EXPECT_EQ(p.routed_experts, 113'548'197'888);
  EXPECT_EQ(p.shared_experts, 443'547'648);
  EXPECT_EQ(p.routers, 36'962'304);
  EXPECT_EQ(p.correction_biases, 12'032);
}

// laguna-checkpoints.md §1.6: the current S-2.1-FP8 export reads 12,224,951,296 B per token (routed
// experts FP8 in 43 MoE layers with F32 128x128 scales, all else BF16); every linear FP8 but the LM
// head, routers and g_proj: 8,498,173,696 B.
TEST(ParamCountTest, Fp8BytesPerTokenMatchTheCheckpointDoc) {
  auto c = ShapeConfig("s21");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(ActiveWeightBytes(*c, DType::kBF16).total(), 16'281'949'696);
  Fp8Options f;
  f.layout = Fp8Layout::kExport;
  const WeightBytesPerToken e = ActiveWeightBytes(*c, DType::kBF16, &f);
  EXPECT_EQ(e.total(), 12'224'951'296);
  EXPECT_EQ(e.fp8, 43 * 10 * 3 * 1024 * 3072ll);
  EXPECT_EQ(e.fp8_scales, 43 * 10 * 3 * 8 * 24 * 4ll);
  f.layout = Fp8Layout::kAllLinear;
  EXPECT_EQ(ActiveWeightBytes(*c, DType::kBF16, &f).total(), 8'498'173'696);
  // The loaded tensors give the same count as the layout.
  auto tiny = ShapeConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  auto ck = MakeShapeOnlyCheckpoint(*tiny, &f);
  ASSERT_TRUE(ck.ok());
  const WeightBytesPerToken a = ActiveWeightBytes(*ck), b = ActiveWeightBytes(*tiny, DType::kBF16, &f);
  EXPECT_EQ(a.total(), b.total());
  EXPECT_EQ(a.fp8, b.fp8);
  EXPECT_EQ(a.routed, b.routed);
  EXPECT_GT(a.fp8, 0);
}

TEST(ParamCountTest, KvBytes) {
  auto c = ShapeConfig("xs2");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(KvBytesPerToken(*c, 2), 40 * 4096);  // 4 KiB per layer per token in BF16
  // Spec §6: 80 MiB at T = 512, 220 MiB at 4K (BF16).
  EXPECT_EQ(KvBytesReadPerToken(*c, 512, 2), 80ll << 20);
  EXPECT_EQ(KvBytesReadPerToken(*c, 4096, 2), 220ll << 20);
  EXPECT_EQ(KvBytesReadPerToken(*c, 4096, 1), 110ll << 20);
}

// The closed form against a position-by-position count: XS.2 (W 512) below, at and past the window.
TEST(ParamCountTest, PrefillFlopsCountEveryVisibleKey) {
  auto c = ShapeConfig("xs2");
  ASSERT_TRUE(c.ok());
  const ParamCounts p = CountParams(*c);
  for (int64_t n : {1, 100, 512, 513, 1024, 8192}) {
    double attention = 0;
    for (int64_t l = 0; l < c->num_hidden_layers; ++l) {
      for (int64_t s = 0; s < n; ++s) {
        const int64_t keys = c->is_sliding(l) ? std::min<int64_t>(s + 1, c->sliding_window) : s + 1;
        attention += 4.0 * static_cast<double>(c->heads(l) * c->head_dim * keys);
      }
    }
    const PrefillFlops f = CountPrefillFlops(*c, n);
    EXPECT_DOUBLE_EQ(f.attention, attention) << n;
    EXPECT_DOUBLE_EQ(f.linear, 2.0 * static_cast<double>(p.active - p.lm_head) * n + 2.0 * p.lm_head) << n;
    EXPECT_DOUBLE_EQ(f.total(), f.linear + f.attention);
  }
  // Every row's logits (a scoring prefill): the LM head counts once per row.
  EXPECT_DOUBLE_EQ(CountPrefillFlops(*c, 4, 4).linear, 2.0 * static_cast<double>(p.active) * 4);
  // ~6 TFLOP for a 1,024-token prompt (issue 17's arithmetic).
  EXPECT_NEAR(CountPrefillFlops(*c, 1024).total() / 1e12, 5.86, 0.01);
}

}  // namespace
}  // namespace dl
