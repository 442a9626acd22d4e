#include "model/shard_plan.h"

#include <gtest/gtest.h>

#include "model/shapes.h"
#include "model/synthetic.h"
#include "model/weight_shard.h"

namespace dl {
namespace {

ModelConfig Shape(const char* name) {
  auto c = ShapeConfig(name);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

// Every rank's slices of one dimension, in rank order, tile [0, n) exactly.
void ExpectTiles(const std::vector<Slice>& slices, int64_t n, const std::string& what) {
  int64_t next = 0;
  for (const Slice& s : slices) {
    EXPECT_EQ(s.begin, next) << what;
    EXPECT_GE(s.size, 0) << what;
    next = s.end();
  }
  EXPECT_EQ(next, n) << what;
}

void ExpectConsistent(const ModelConfig& c, const TensorParallelPlan& p) {
  ASSERT_EQ(static_cast<int>(p.ranks.size()), p.tp_size);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    std::vector<Slice> q, ff, expert, shared;
    for (const RankShard& r : p.ranks) {
      const LayerShard& ls = r.layers[l];
      q.push_back(ls.q_heads);
      ff.push_back(ls.dense_ff);
      expert.push_back(ls.expert_ff);
      shared.push_back(ls.shared_ff);
      // The rank's query heads use only the KV heads it holds (GQA: head i uses KV head i / G).
      const int64_t G = c.heads(l) / c.num_key_value_heads;
      EXPECT_GE(ls.q_heads.begin / G, ls.kv_heads.begin) << "layer " << l << " rank " << r.rank;
      EXPECT_LT((ls.q_heads.end() - 1) / G, ls.kv_heads.end()) << "layer " << l << " rank " << r.rank;
      // Split KV heads keep the group size; a shared KV head serves all of the rank's query heads.
      if (p.tp_size <= c.num_key_value_heads) {
        EXPECT_EQ(ls.q_heads.size / ls.kv_heads.size, G);
      } else {
        EXPECT_EQ(ls.kv_heads.size, 1);
      }
    }
    ExpectTiles(q, c.heads(l), "q heads");
    if (c.is_sparse(l)) {
      ExpectTiles(expert, c.moe_intermediate_size, "expert width");
      ExpectTiles(shared, c.shared_expert_intermediate_size, "shared expert width");
    } else {
      ExpectTiles(ff, c.intermediate_size, "dense width");
    }
  }
  std::vector<Slice> vocab;
  for (const RankShard& r : p.ranks) vocab.push_back(r.lm_head_vocab);
  ExpectTiles(vocab, c.vocab_size, "LM head vocabulary");
}

TEST(TensorParallelPlanTest, S21AtTp4HasTheIssuesPerRankShapes) {
  const ModelConfig c = Shape("s21");
  auto p = MakeTensorParallelPlan(c, 4, EmbeddingMode::kReplicated);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ExpectConsistent(c, *p);
  for (const RankShard& r : p->ranks) {
    const LayerShard& full = r.layers[0];     // full attention, dense MLP
    const LayerShard& sliding = r.layers[1];  // sliding attention, sparse MLP
    EXPECT_EQ(full.q_heads.size, 12);
    EXPECT_EQ(full.kv_heads.size, 2);
    EXPECT_EQ(sliding.q_heads.size, 18);
    EXPECT_EQ(sliding.kv_heads.size, 2);
    EXPECT_EQ(sliding.q_heads.begin, 18 * r.rank);
    EXPECT_EQ(sliding.kv_heads.begin, 2 * r.rank);
    EXPECT_EQ(sliding.gate_rows, sliding.q_heads);  // per-head gate
    EXPECT_EQ(full.dense_ff.size, 12288 / 4);
    EXPECT_EQ(sliding.expert_ff.size, 1024 / 4);
    EXPECT_EQ(sliding.shared_ff.size, 1024 / 4);
    EXPECT_EQ(r.lm_head_vocab.size, 100352 / 4);
    EXPECT_EQ(r.embed_vocab, (Slice{0, 100352}));  // replicated
  }
  EXPECT_EQ(p->AllReducesPerForward(c.num_hidden_layers), 2 * 48);
  const std::string text = DescribeTensorParallelPlan(c, *p);
  EXPECT_NE(text.find("rank 3: sliding sparse"), std::string::npos) << text;
  EXPECT_NE(text.find("q=18 heads [54, 72) kv=2 heads [6, 8)"), std::string::npos) << text;
  EXPECT_NE(text.find("q=12 heads [36, 48) kv=2 heads [6, 8)"), std::string::npos) << text;
}

TEST(TensorParallelPlanTest, S21AtTp2And8AndXs2) {
  const ModelConfig s21 = Shape("s21");
  auto p8 = MakeTensorParallelPlan(s21, 8, EmbeddingMode::kVocabParallel);
  ASSERT_TRUE(p8.ok()) << p8.status().ToString();
  ExpectConsistent(s21, *p8);
  EXPECT_EQ(p8->ranks[5].layers[1].q_heads, (Slice{45, 9}));
  EXPECT_EQ(p8->ranks[5].layers[0].q_heads, (Slice{30, 6}));
  EXPECT_EQ(p8->ranks[5].layers[0].kv_heads, (Slice{5, 1}));
  EXPECT_EQ(p8->ranks[5].embed_vocab, p8->ranks[5].lm_head_vocab);  // vocab-parallel
  EXPECT_EQ(p8->AllReducesPerForward(48), 97);  // one more than replicated: the embedding
  auto p2 = MakeTensorParallelPlan(s21, 2, EmbeddingMode::kReplicated);
  ASSERT_TRUE(p2.ok());
  ExpectConsistent(s21, *p2);
  EXPECT_EQ(p2->ranks[1].layers[1].q_heads, (Slice{36, 36}));

  const ModelConfig xs2 = Shape("xs2");
  for (int tp : {1, 2, 4, 8, 16}) {
    SCOPED_TRACE(tp);
    auto p = MakeTensorParallelPlan(xs2, tp, EmbeddingMode::kReplicated);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ExpectConsistent(xs2, *p);
    EXPECT_EQ(p->ranks[0].layers[0].q_heads.size, 48 / tp);
    EXPECT_EQ(p->ranks[0].layers[1].q_heads.size, 64 / tp);
  }
  // tp 16 > K = 8: every KV head is held by the two ranks whose query heads use it.
  auto p16 = MakeTensorParallelPlan(xs2, 16, EmbeddingMode::kReplicated);
  ASSERT_TRUE(p16.ok());
  EXPECT_EQ(p16->ranks[6].layers[1].kv_heads, (Slice{3, 1}));
  EXPECT_EQ(p16->ranks[7].layers[1].kv_heads, (Slice{3, 1}));
  // tp 1: the whole model.
  auto p1 = MakeTensorParallelPlan(xs2, 1, EmbeddingMode::kVocabParallel);
  ASSERT_TRUE(p1.ok());
  EXPECT_EQ(p1->ranks[0].layers[1].q_heads, (Slice{0, 64}));
  EXPECT_EQ(p1->ranks[0].embed_vocab, (Slice{0, 100352}));
  EXPECT_EQ(p1->AllReducesPerForward(40), 0);
}

TEST(TensorParallelPlanTest, HeadCountsThatDoNotDivideAreRefusedNamingTheLayer) {
  const ModelConfig s21 = Shape("s21");
  auto p5 = MakeTensorParallelPlan(s21, 5, EmbeddingMode::kReplicated);
  ASSERT_FALSE(p5.ok());
  EXPECT_EQ(p5.status().code(), StatusCode::kInvalidArgument);
  // K = 8 and 5 are co-prime: the KV heads are named first.
  EXPECT_NE(p5.status().message().find("8 KV heads"), std::string::npos) << p5.status().message();

  ModelConfig c = Shape("tiny");  // heads 4/8, K = 2
  c.num_attention_heads_per_layer = {4, 8, 6, 8, 4};
  c.num_key_value_heads = 2;
  auto p4 = MakeTensorParallelPlan(c, 4, EmbeddingMode::kReplicated);
  ASSERT_FALSE(p4.ok());
  EXPECT_NE(p4.status().message().find("layer 2 (sliding attention) has 6 query heads"), std::string::npos)
      << p4.status().message();
  EXPECT_NE(p4.status().message().find("4 ranks"), std::string::npos);

  auto p0 = MakeTensorParallelPlan(c, 0, EmbeddingMode::kReplicated);
  ASSERT_FALSE(p0.ok());
  EXPECT_NE(p0.status().message().find("--tp must be at least 1"), std::string::npos);
}

TEST(TensorParallelPlanTest, WidthsAndVocabularyThatDoNotDivideAreSplitUnevenly) {
  ModelConfig c = Shape("tiny");
  c.vocab_size = 513;
  c.intermediate_size = 97;
  c.moe_intermediate_size = 33;
  c.shared_expert_intermediate_size = 2;  // fewer than the ranks: some hold none
  auto p = MakeTensorParallelPlan(c, 4, EmbeddingMode::kVocabParallel);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ExpectConsistent(c, *p);
  EXPECT_EQ(p->ranks[0].lm_head_vocab, (Slice{0, 129}));
  EXPECT_EQ(p->ranks[1].lm_head_vocab, (Slice{129, 128}));
  EXPECT_EQ(p->ranks[3].lm_head_vocab, (Slice{385, 128}));
  EXPECT_EQ(p->ranks[0].layers[0].dense_ff, (Slice{0, 25}));
  EXPECT_EQ(p->ranks[1].layers[0].dense_ff, (Slice{25, 24}));
  EXPECT_EQ(p->ranks[0].layers[1].expert_ff, (Slice{0, 9}));
  EXPECT_EQ(p->ranks[3].layers[1].expert_ff, (Slice{25, 8}));
  EXPECT_EQ(p->ranks[1].layers[1].shared_ff, (Slice{1, 1}));
  EXPECT_EQ(p->ranks[2].layers[1].shared_ff, (Slice{2, 0}));
  // tp 4 > K = 2: ranks 0, 1 share KV head 0; ranks 2, 3 KV head 1.
  EXPECT_EQ(p->ranks[1].layers[0].kv_heads, (Slice{0, 1}));
  EXPECT_EQ(p->ranks[2].layers[0].kv_heads, (Slice{1, 1}));
}

// The rank's model (what the CUDA runner sizes its kernels and buffers from) is the plan's slices:
// per-layer query heads, the KV heads held, every width; vocabulary and everything else unchanged.
TEST(TensorParallelPlanTest, RankModelConfigIsThePlansSlices) {
  ModelConfig c = Shape("tiny");
  c.intermediate_size = 97;
  c.moe_intermediate_size = 33;
  c.shared_expert_intermediate_size = 2;
  for (int tp : {1, 2, 4}) {
    auto p = MakeTensorParallelPlan(c, tp, EmbeddingMode::kReplicated);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    int64_t dense = 0, expert = 0, shared = 0;
    for (int r = 0; r < tp; ++r) {
      const ModelConfig rc = RankModelConfig(c, *p, r);
      const RankShard& rs = p->ranks[r];
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        EXPECT_EQ(rc.heads(l), rs.layers[l].q_heads.size) << "tp " << tp << " rank " << r << " layer " << l;
        EXPECT_EQ(rc.heads(l) * tp, c.heads(l));
        EXPECT_EQ(rc.num_key_value_heads, rs.layers[l].kv_heads.size);
        EXPECT_EQ(rc.gate_width(l), rs.layers[l].gate_rows.size);
        if (c.is_sparse(l)) {
          EXPECT_EQ(rc.moe_intermediate_size, rs.layers[l].expert_ff.size);
          EXPECT_EQ(rc.shared_expert_intermediate_size, rs.layers[l].shared_ff.size);
        } else {
          EXPECT_EQ(rc.intermediate_size, rs.layers[l].dense_ff.size);
        }
      }
      dense += rc.intermediate_size;
      expert += rc.moe_intermediate_size;
      shared += rc.shared_expert_intermediate_size;
      EXPECT_EQ(rc.vocab_size, c.vocab_size);
      EXPECT_EQ(rc.hidden_size, c.hidden_size);
      EXPECT_EQ(rc.head_dim, c.head_dim);
      EXPECT_EQ(rc.num_experts, c.num_experts);
      EXPECT_EQ(rc.num_hidden_layers, c.num_hidden_layers);
    }
    EXPECT_EQ(dense, c.intermediate_size) << "tp " << tp;
    EXPECT_EQ(expert, c.moe_intermediate_size) << "tp " << tp;
    EXPECT_EQ(shared, c.shared_expert_intermediate_size) << "tp " << tp;
  }
}

TEST(TensorParallelPlanTest, PerElementGateRowsFollowTheHeads) {
  ModelConfig c = Shape("tiny");
  c.gating = GatingKind::kPerElement;
  auto p = MakeTensorParallelPlan(c, 2, EmbeddingMode::kReplicated);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->ranks[1].layers[1].gate_rows, (Slice{4 * 32, 4 * 32}));
}

TEST(TensorParallelPlanTest, ParseEmbeddingMode) {
  EXPECT_EQ(*ParseEmbeddingMode("replicated"), EmbeddingMode::kReplicated);
  EXPECT_EQ(*ParseEmbeddingMode("vocab-parallel"), EmbeddingMode::kVocabParallel);
  auto bad = ParseEmbeddingMode("vocab_parallel");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("vocab-parallel or replicated"), std::string::npos);
}

// The doc's numbers: what a rank reads per decode step, MoE by intermediate width.
TEST(TensorParallelPlanTest, ReadBytesSplitTheWeightsOverRanks) {
  const ModelConfig c = Shape("s21");
  auto p1 = MakeTensorParallelPlan(c, 1, EmbeddingMode::kReplicated);
  auto p4 = MakeTensorParallelPlan(c, 4, EmbeddingMode::kReplicated);
  ASSERT_TRUE(p1.ok() && p4.ok());
  const RankReadBytes one = ReadBytesPerForward(c, *p1, 0, 10, 2);
  RankReadBytes sum;
  for (int r = 0; r < 4; ++r) {
    const RankReadBytes b = ReadBytesPerForward(c, *p4, r, 10, 2);
    sum.attention += b.attention;
    sum.routed_experts += b.routed_experts;
    sum.lm_head += b.lm_head;
    EXPECT_EQ(b.routers, one.routers);  // replicated
  }
  EXPECT_EQ(sum.attention, one.attention);  // K % tp == 0: no KV head read twice
  EXPECT_EQ(sum.routed_experts, one.routed_experts);
  EXPECT_EQ(sum.lm_head, one.lm_head);
  // 47 sparse layers x 10 experts x 3 x 1024 x 3072 x 2 bytes.
  EXPECT_EQ(one.routed_experts, 47LL * 10 * 3 * 1024 * 3072 * 2);
  EXPECT_NEAR(ExpectedDistinctExperts(256, 10, 1), 10.0, 1e-9);
  EXPECT_NEAR(ExpectedDistinctExperts(256, 10, 64), 236.0, 0.1);
}

// Every rank's shard of `full` (empty when one fails, which the test reports).
std::vector<std::unique_ptr<HostWeightShard>> ShardEveryRank(const ModelConfig& c, const LagunaWeights& full,
                                                             const TensorParallelPlan& plan) {
  std::vector<std::unique_ptr<HostWeightShard>> shards;
  for (int r = 0; r < plan.tp_size; ++r) {
    auto s = ShardHostWeights(c, full, plan, r);
    EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.status().ToString();
    if (!s.ok()) return {};
    shards.push_back(std::move(s).value());
  }
  return shards;
}

TEST(WeightShardTest, RowSlicesAreViewsAndColumnSlicesReassembleTheMatrix) {
  const ModelConfig c = Shape("tiny");
  auto ck = MakeSyntheticCheckpoint(c, 7, DType::kBF16);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const LagunaWeights full = HostLagunaWeights(ck->weights());
  auto plan = MakeTensorParallelPlan(c, 2, EmbeddingMode::kVocabParallel);
  ASSERT_TRUE(plan.ok());
  const std::vector<std::unique_ptr<HostWeightShard>> shards = ShardEveryRank(c, full, *plan);
  ASSERT_EQ(shards.size(), 2u);
  const int64_t D = c.head_dim, d = c.hidden_size;
  const LagunaLayerWeights& F = full.layers[1];
  const LagunaLayerWeights& R1 = shards[1]->weights.layers[1];
  // q of rank 1: heads [4, 8) of 8, a view into the checkpoint.
  EXPECT_EQ(R1.qkvg.parts[0].rows(), 4 * D);
  EXPECT_EQ(R1.qkvg.parts[0].data, static_cast<const uint8_t*>(F.qkvg.parts[0].data) + 4 * D * d * 2);
  EXPECT_EQ(R1.qkvg.parts[1].rows(), D);  // k: KV head 1 of 2
  EXPECT_EQ(R1.qkvg.parts[3].rows(), 4);  // g: per-head
  // o_proj [d, H*D]: the ranks' column slices side by side are the whole matrix, bit for bit.
  const WeightRef& o = F.o.parts[0];
  for (int64_t row = 0; row < o.rows(); ++row) {
    for (int64_t col = 0; col < o.cols(); ++col) {
      const int r = col < 4 * D ? 0 : 1;
      const WeightRef& part = shards[r]->weights.layers[1].o.parts[0];
      const int64_t local = col - r * 4 * D;
      ASSERT_EQ(LoadAsFloat(part.data, part.dtype, row * part.cols() + local), LoadAsFloat(o.data, o.dtype, row * o.cols() + col));
    }
  }
  // Experts: gate rows and down columns of the same width slice.
  EXPECT_EQ(R1.moe.gate[3].rows(), c.moe_intermediate_size / 2);
  EXPECT_EQ(R1.moe.down[3].cols(), c.moe_intermediate_size / 2);
  EXPECT_EQ(R1.moe.router.data, F.moe.router.data);  // replicated router
  // Vocab-parallel embedding and LM head: rank 1 holds ids [256, 512).
  EXPECT_EQ(shards[1]->weights.embed_vocab_begin, 256);
  EXPECT_TRUE(shards[1]->weights.embed_vocab_parallel);
  EXPECT_EQ(shards[1]->weights.embed.rows(), 256);
  EXPECT_EQ(shards[1]->weights.lm_head_vocab_begin, 256);
}

// An FP8 weight's dequantised element (weights.h: code x its block's FP32 scale).
float Dequantised(const WeightRef& w, int64_t row, int64_t col) {
  const int64_t scale_cols = (w.cols() + w.block_cols - 1) / w.block_cols;
  const uint8_t code = static_cast<const uint8_t*>(w.data)[row * w.cols() + col];
  return Fp8E4M3ToFloat(code) * w.scales[(row / w.block_rows) * scale_cols + col / w.block_cols];
}

// FP8 weights are cut with their scales: every rank's slice dequantises to the whole matrix's
// elements, bit for bit, for row slices on a block boundary (q, experts' gate), row slices inside one
// block (the shared expert's 8 of 16 rows), and column slices (o_proj, down). A slice that starts
// inside a block and crosses into the next is refused, naming the tensor.
TEST(WeightShardTest, Fp8SlicesCarryTheirScales) {
  const ModelConfig c = Shape("tiny");
  Fp8Options fp8;
  fp8.layout = Fp8Layout::kAllLinear;
  fp8.block_rows = fp8.block_cols = 16;
  auto ck = MakeSyntheticCheckpoint(c, 7, DType::kBF16, &fp8);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const LagunaWeights full = HostLagunaWeights(ck->weights());
  auto plan = MakeTensorParallelPlan(c, 2, EmbeddingMode::kReplicated);
  ASSERT_TRUE(plan.ok());
  const std::vector<std::unique_ptr<HostWeightShard>> shards = ShardEveryRank(c, full, *plan);
  ASSERT_EQ(shards.size(), 2u);
  // The rank's slice `part` of `whole` starts at (row0, col0) of it.
  auto expect_slice = [](const WeightRef& whole, const WeightRef& part, int64_t row0, int64_t col0) {
    ASSERT_NE(part.scales, nullptr) << part.name;
    for (int64_t i = 0; i < part.rows(); ++i)
      for (int64_t j = 0; j < part.cols(); ++j)
        ASSERT_EQ(Dequantised(part, i, j), Dequantised(whole, row0 + i, col0 + j)) << part.name << " " << i << "," << j;
  };
  const int64_t D = c.head_dim;
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    const LagunaLayerWeights& F = full.layers[1];
    const LagunaLayerWeights& R = shards[r]->weights.layers[1];
    const int64_t q = R.qkvg.parts[0].rows();
    expect_slice(F.qkvg.parts[0], R.qkvg.parts[0], r * q, 0);
    expect_slice(F.o.parts[0], R.o.parts[0], 0, r * q);
    const int64_t f = c.moe_intermediate_size / 2, fs = R.moe.shared_gate.rows();
    expect_slice(F.moe.gate[2], R.moe.gate[2], r * f, 0);
    expect_slice(F.moe.down[2], R.moe.down[2], 0, r * f);
    expect_slice(F.moe.shared_gate, R.moe.shared_gate, r * fs, 0);
    expect_slice(F.moe.shared_down, R.moe.shared_down, 0, r * fs);
    EXPECT_EQ(q % D, 0);
  }
  // Rows 8..40 of q_proj with 16-row blocks start inside block 0 and end in block 2.
  const WeightRef& g = full.layers[1].qkvg.parts[0];
  ASSERT_GE(g.rows(), 40);
  auto crossing = RowSlice(g, Slice{8, 32});
  ASSERT_FALSE(crossing.ok());
  EXPECT_EQ(crossing.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(crossing.status().ToString().find(g.name), std::string::npos) << crossing.status().ToString();
}

}  // namespace
}  // namespace dl
