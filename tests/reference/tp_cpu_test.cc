// Tensor parallelism on the CPU reference (docs/tensor-parallel.md): TP=2 and TP=4 over in-process
// ranks against TP=1 on every committed golden model, with the margin rule of the CPU golden tests
// (tokens equal up to the first step whose transformers top-2 margin is below 1e-3); both embedding
// modes bit-identical; in-process and TCP transports bit-identical; the distributed greedy argmax
// equal to the argmax of the gathered row; uneven splits; a failing rank ending the group; refusals.
#include <cmath>
#include <cstdio>

#include <gtest/gtest.h>

#include "backend/cpu_tp_runner.h"
#include "engine/engine.h"
#include "kernels/reference/reference.h"
#include "model/shapes.h"
#include "tests/common/golden_data.h"

namespace dl {
namespace {

using namespace testing_golden;

std::unique_ptr<Engine> LoadTp(const fs::path& dir, int tp, EmbeddingMode embedding) {
  EngineOptions o = CpuTpOptions(tp, embedding);
  o.model_dir = dir.string();
  auto e = LoadEngine(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

bool PlanAllows(const fs::path& dir, int tp) {
  auto c = ModelConfig::FromFile((dir / "config.json").string());
  return c.ok() && MakeTensorParallelPlan(*c, tp, EmbeddingMode::kReplicated).ok();
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<uint32_t>(v[i]);
  return b;
}

TEST(TpCpuTest, GreedyTokensOnTheGoldensEqualTp1UpToTheMarginRule) {
  int runs = 0;
  for (const auto& dir : GoldenDirs()) {
    SCOPED_TRACE(dir.filename().string());
    const auto goldens = LoadGoldens(dir / "goldens_fp32.json");
    auto base = LoadTp(dir, 1, EmbeddingMode::kReplicated);
    ASSERT_TRUE(base);
    for (int tp : {2, 4}) {
      if (!PlanAllows(dir, tp)) {
        // tiny_softcap has 2 query heads on its full layers: TP=4 is refused (checked below).
        std::printf("[tp] %s tp=%d refused by the shard plan\n", dir.filename().c_str(), tp);
        continue;
      }
      std::vector<std::vector<int32_t>> tokens_by_mode;
      std::vector<std::vector<uint32_t>> logits_by_mode;
      for (EmbeddingMode mode : {EmbeddingMode::kVocabParallel, EmbeddingMode::kReplicated}) {
        auto engine = LoadTp(dir, tp, mode);
        ASSERT_TRUE(engine);
        std::vector<int32_t> all_tokens;
        std::vector<uint32_t> all_logits;
        for (const auto& g : goldens) {
          GenerateOptions opts;
          opts.max_tokens = static_cast<int32_t>(g.tokens.size());
          opts.ignore_eos = true;
          auto want = GenerateGreedy(*base, g.prompt, opts);
          auto got = GenerateGreedy(*engine, g.prompt, opts);
          ASSERT_TRUE(want.ok()) << want.status().ToString();
          ASSERT_TRUE(got.ok()) << got.status().ToString();
          size_t compared = 0;
          while (compared < g.tokens.size() && g.margins[compared] >= 1e-3) ++compared;
          ASSERT_GE(compared, 20u);
          for (size_t s = 0; s < compared; ++s) {
            ASSERT_EQ(got->tokens[s], want->tokens[s]) << "tp " << tp << " step " << s;
            ASSERT_EQ(got->tokens[s], g.tokens[s]) << "tp " << tp << " step " << s;
          }
          // Same arithmetic up to the order of the partial sums: FP32 rounding only.
          const double rel = RelL2(got->last_prompt_logits, want->last_prompt_logits);
          EXPECT_LT(rel, 1e-5) << "tp " << tp;
          std::printf("[tp] %s tp=%d embedding=%s prompt_len=%zu compared=%zu/%zu rel_l2_vs_tp1=%.3g\n",
                      dir.filename().c_str(), tp, EmbeddingModeName(mode), g.prompt.size(), compared,
                      g.tokens.size(), rel);
          all_tokens.insert(all_tokens.end(), got->tokens.begin(), got->tokens.end());
          const auto b = Bits(got->last_prompt_logits);
          all_logits.insert(all_logits.end(), b.begin(), b.end());
        }
        tokens_by_mode.push_back(all_tokens);
        logits_by_mode.push_back(all_logits);
        ++runs;
      }
      // Both embedding modes: the same tokens, and the same logits bit for bit (x + 0 is exact).
      EXPECT_EQ(tokens_by_mode[0], tokens_by_mode[1]) << "tp " << tp;
      EXPECT_EQ(logits_by_mode[0], logits_by_mode[1]) << "tp " << tp;
    }
  }
  EXPECT_GE(runs, 12);  // 4 models at TP=2 and 2 modes, 3 at TP=4
}

TEST(TpCpuTest, RunToRunAndTransportsAreBitIdentical) {
  const fs::path dir = GoldenDir("tiny");
  const auto g = LoadGoldens(dir / "goldens_fp32.json").back();
  auto c = ModelConfig::FromFile((dir / "config.json").string());
  ASSERT_TRUE(c.ok());
  GenerateOptions opts;
  opts.max_tokens = 16;
  opts.ignore_eos = true;
  opts.keep_step_logits = true;
  std::vector<std::vector<uint32_t>> runs;
  for (TpTransport transport : {TpTransport::kInProcess, TpTransport::kInProcess, TpTransport::kTcpLoopback}) {
    auto engine = LoadTp(dir, 2, EmbeddingMode::kVocabParallel);
    ASSERT_TRUE(engine);
    // Swap in a runner over the requested transport (LoadEngine's is in-process).
    auto runner = CpuTpRunner::Create(*engine->checkpoint, engine->kv->spec(), KvScales::Unit(5), 2,
                                      EmbeddingMode::kVocabParallel, transport);
    ASSERT_TRUE(runner.ok()) << runner.status().ToString();
    engine->runner = std::move(runner).value();
    auto r = GenerateGreedy(*engine, g.prompt, opts);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::vector<uint32_t> bits;
    for (const auto& step : r->step_logits) {
      const auto b = Bits(step);
      bits.insert(bits.end(), b.begin(), b.end());
    }
    runs.push_back(bits);
    const nlohmann::json d = engine->runner->Describe();
    EXPECT_EQ(d["tensor_parallel"]["transport"], TpTransportName(transport));
    // Per rank per decode step: 2 all-reduces per layer, 1 for the embedding, 1 gather of the row.
    for (const auto& rank : d["tensor_parallel"]["ranks"]) {
      EXPECT_EQ(rank["collectives_last_forward"].get<int64_t>(), 2 * c->num_hidden_layers + 1 + 1);
    }
  }
  EXPECT_EQ(runs[0], runs[1]) << "run to run";
  EXPECT_EQ(runs[0], runs[2]) << "in-process vs tcp";
}

// One forward of `prompt` (a fresh sequence) with one output row; returns its result.
Result<RowResult> ForwardOnce(Engine& e, const std::vector<int32_t>& prompt, const OutputRequest& req) {
  SequenceKv seq;
  DL_RETURN_IF_ERROR(e.kv->Reserve(seq, static_cast<int32_t>(prompt.size())));
  ForwardBatch batch;
  batch.mode = ForwardMode::kPrefill;
  batch.AddSequence(seq, prompt);
  OutputRequest& out = batch.AddOutput(static_cast<int32_t>(prompt.size()) - 1);
  out.sample = req.sample;
  out.sampling = req.sampling;
  out.want_logits = req.want_logits;
  ForwardResult result;
  Status st = e.runner->Forward(batch, &result);
  DL_RETURN_IF_ERROR(e.kv->Release(seq));
  DL_RETURN_IF_ERROR(st);
  return result.rows[0];
}

TEST(TpCpuTest, DistributedGreedyArgmaxEqualsTheArgmaxOfTheWholeRow) {
  const fs::path dir = GoldenDir("tiny");
  const auto goldens = LoadGoldens(dir / "goldens_fp32.json");
  auto tp4 = LoadTp(dir, 4, EmbeddingMode::kReplicated);
  auto tp1 = LoadTp(dir, 1, EmbeddingMode::kReplicated);
  ASSERT_TRUE(tp4 && tp1);
  for (const auto& g : goldens) {
    OutputRequest logits_req;
    logits_req.want_logits = true;
    auto whole = ForwardOnce(*tp4, g.prompt, logits_req);
    ASSERT_TRUE(whole.ok()) << whole.status().ToString();
    const int32_t argmax = ArgmaxWithMargin(whole->logits).first;
    EXPECT_EQ(whole->token, argmax);
    OutputRequest greedy;  // no logits back: the distributed argmax path
    auto r = ForwardOnce(*tp4, g.prompt, greedy);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(r->logits.empty());
    EXPECT_TRUE(r->finite);
    EXPECT_EQ(r->token, argmax);
    // A logit_bias on a token of the last rank's slice makes it the greedy choice.
    OutputRequest biased;
    biased.sampling.adjustments.push_back({.token = 500, .bias = 1000.0f});
    auto b = ForwardOnce(*tp4, g.prompt, biased);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->token, 500);
    // A sampled row gathers the whole row and applies the reference rule: the same token as TP=1's
    // rule over the gathered logits.
    OutputRequest sampled;
    sampled.sampling.temperature = 0.8f;
    sampled.sampling.top_k = 20;
    sampled.sampling.key = 1234;
    sampled.want_logits = true;
    auto s = ForwardOnce(*tp4, g.prompt, sampled);
    ASSERT_TRUE(s.ok());
    bool finite = false;
    EXPECT_EQ(s->token, kernels::ref::SampleRow(s->logits.data(), static_cast<int>(s->logits.size()),
                                                sampled.sampling, &finite));
    auto s1 = ForwardOnce(*tp1, g.prompt, sampled);
    ASSERT_TRUE(s1.ok());
    EXPECT_EQ(s->token, s1->token) << "sampled token vs TP=1";
  }
}

// A sequence's logits at TP=2 do not depend on what else is in the batch: alone, and prefilled in
// one forward beside another sequence, bit for bit.
TEST(TpCpuTest, BatchInvariantUnderTensorParallelism) {
  auto engine = LoadTp(GoldenDir("tiny"), 2, EmbeddingMode::kVocabParallel);
  ASSERT_TRUE(engine);
  const std::vector<int32_t> a = {7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
  const std::vector<int32_t> b = {100, 200, 300, 400, 5};
  OutputRequest req;
  req.want_logits = true;
  auto alone = ForwardOnce(*engine, a, req);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  SequenceKv sa, sb;
  ASSERT_TRUE(engine->kv->Reserve(sb, static_cast<int32_t>(b.size())).ok());
  ASSERT_TRUE(engine->kv->Reserve(sa, static_cast<int32_t>(a.size())).ok());
  ForwardBatch batch;
  batch.mode = ForwardMode::kPrefill;
  batch.AddSequence(sb, b);
  const int32_t first_a = batch.AddSequence(sa, a);
  batch.AddOutput(static_cast<int32_t>(b.size()) - 1);  // a greedy row beside it
  batch.AddOutput(first_a + static_cast<int32_t>(a.size()) - 1).want_logits = true;
  ForwardResult together;
  ASSERT_TRUE(engine->runner->Forward(batch, &together).ok());
  ASSERT_TRUE(engine->kv->Release(sa).ok());
  ASSERT_TRUE(engine->kv->Release(sb).ok());
  EXPECT_EQ(Bits(together.rows[1].logits), Bits(alone->logits));
  EXPECT_EQ(together.rows[1].token, alone->token);
}

TEST(TpCpuTest, UnevenWidthsAndVocabularyAtTp3MatchTp1) {
  // A tiny-like model whose vocabulary and every MLP width leave a remainder over 3 ranks.
  auto cfg = ShapeConfig("tiny");
  ASSERT_TRUE(cfg.ok());
  cfg->vocab_size = 511;
  cfg->num_attention_heads_per_layer = {6, 12, 12, 12, 6};
  cfg->num_attention_heads = 6;
  cfg->num_key_value_heads = 3;
  cfg->intermediate_size = 97;
  cfg->moe_intermediate_size = 31;
  cfg->shared_expert_intermediate_size = 17;
  auto make = [&](int tp) {
    auto e = std::make_unique<Engine>();
    e->checkpoint = std::make_unique<Checkpoint>(std::move(MakeSyntheticCheckpoint(*cfg, 11, DType::kBF16)).value());
    KvCacheSpec s;
    s.num_layers = 5;
    s.num_kv_heads = 3;
    s.head_dim = static_cast<int32_t>(cfg->head_dim);
    s.page_size = 16;
    s.dtype = DType::kF32;
    for (int64_t l = 0; l < 5; ++l) s.layer_groups.push_back(cfg->is_sliding(l) ? KvGroup::kSliding : KvGroup::kFull);
    s.sliding_window = static_cast<int32_t>(cfg->sliding_window);
    s.pages_full = 8;
    s.pages_sliding = 8;
    auto kv = KvCache::Create(s);
    EXPECT_TRUE(kv.ok());
    e->kv = std::make_unique<KvCache>(std::move(kv).value());
    e->options.max_seq_len = 128;
    if (tp == 1) {
      e->runner = std::move(CpuRunner::Create(*e->checkpoint, e->kv->spec(), {})).value();
    } else {
      auto r = CpuTpRunner::Create(*e->checkpoint, e->kv->spec(), {}, tp, EmbeddingMode::kVocabParallel);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      e->runner = std::move(r).value();
    }
    return e;
  };
  auto one = make(1);
  auto three = make(3);
  const std::vector<int32_t> prompt = {5, 77, 300, 510, 2, 9, 128, 64, 401, 256, 17};
  GenerateOptions opts;
  opts.max_tokens = 24;
  opts.ignore_eos = true;
  auto a = GenerateGreedy(*one, prompt, opts);
  auto b = GenerateGreedy(*three, prompt, opts);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  // The margin rule against TP=1's own margins.
  size_t compared = 0;
  while (compared < a->tokens.size() && a->margins[compared] >= 1e-3) ++compared;
  EXPECT_GE(compared, 8u);
  for (size_t s = 0; s < compared; ++s) ASSERT_EQ(b->tokens[s], a->tokens[s]) << "step " << s;
  EXPECT_LT(RelL2(b->last_prompt_logits, a->last_prompt_logits), 1e-5);
  std::printf("[tp] uneven tp=3 compared=%zu/%zu\n", compared, a->tokens.size());
}

TEST(TpCpuTest, AFailingRankEndsTheGroupWithItsError) {
  auto engine = LoadTp(GoldenDir("tiny"), 4, EmbeddingMode::kVocabParallel);
  ASSERT_TRUE(engine);
  auto* runner = dynamic_cast<CpuTpRunner*>(engine->runner.get());
  ASSERT_NE(runner, nullptr);
  const std::vector<int32_t> prompt = {3, 4, 5, 6};
  OutputRequest greedy;
  ASSERT_TRUE(ForwardOnce(*engine, prompt, greedy).ok());
  runner->FailNextForwardOnRank(2, Internal("injected failure"));
  auto r = ForwardOnce(*engine, prompt, greedy);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("rank 2: INTERNAL: injected failure"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("aborted by rank 2"), std::string::npos) << r.status().message();
  // The group is gone: later steps are refused with the same error, not run on three ranks.
  auto again = ForwardOnce(*engine, prompt, greedy);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("tensor-parallel group of 4 ended"), std::string::npos);
}

TEST(TpCpuTest, RequestErrorsAreRefusedOnRankZeroWithoutEndingTheGroup) {
  auto engine = LoadTp(GoldenDir("tiny"), 2, EmbeddingMode::kReplicated);
  ASSERT_TRUE(engine);
  OutputRequest greedy;
  auto bad = ForwardOnce(*engine, {3, 4, 512}, greedy);  // token id outside the vocabulary
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(ForwardOnce(*engine, {3, 4, 5}, greedy).ok());
}

TEST(TpCpuTest, RefusalsAreClear) {
  EngineOptions o;
  o.model_dir = GoldenDir("tiny_softcap").string();
  o.backend = BackendKind::kCpu;
  o.tp = 4;
  auto e = LoadEngine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("layer 0 (full attention) has 2 query heads"), std::string::npos)
      << e.status().message();
  o.model_dir = GoldenDir("tiny").string();
  o.tp = 0;
  e = LoadEngine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--tp must be at least 1"), std::string::npos);
  // The CUDA backend takes --tp (backend/cuda_tp_runner.h); its own refusals name what is wrong: no
  // usable GPU here (CI), or on a GPU machine a shard its kernels cannot run (tiny's shared expert
  // of 16 over 4 ranks is 4 wide).
  o.tp = 4;
  o.backend = BackendKind::kCuda;
  e = LoadEngine(o);
  ASSERT_FALSE(e.ok());
  const std::string why = e.status().message();
  EXPECT_TRUE(why.find("no usable GPU") != std::string::npos ||
              why.find("shared_expert_intermediate_size is 4") != std::string::npos)
      << why;
}

}  // namespace
}  // namespace dl
