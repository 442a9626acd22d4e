// The CPU reference backend against transformers 5.17.0's FP32 eager goldens (tools/reference/), for
// every committed configuration under tests/data/golden/: greedy tokens equal up to the first step whose
// reference top-2 margin is below 1e-3 (at least 20 steps compared per prompt), last-prompt-position
// logits within 1e-3 relative L2. Then exactness across KV page sizes and prefill chunk sizes.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "tests/common/golden_data.h"

namespace dl {
namespace {

using namespace testing_golden;

std::unique_ptr<Engine> Load(const fs::path& dir, DType kv, int32_t page) {
  return LoadGoldenModel(dir, BackendKind::kCpu, kv, page);
}

TEST(GoldenCpuTest, GoldensArePresent) {
  ASSERT_GE(GoldenDirs().size(), 3u) << "expected tiny, tiny_softcap and tiny_elem under tests/data/golden";
}

TEST(GoldenCpuTest, MatchesTransformersFp32Greedy) {
  for (const auto& dir : GoldenDirs()) {
    SCOPED_TRACE(dir.filename().string());
    auto engine = Load(dir, DType::kF32, 16);
    ASSERT_TRUE(engine);
    for (const auto& g : LoadGoldens(dir / "goldens_fp32.json")) {
      GenerateOptions opts;
      opts.max_tokens = static_cast<int32_t>(g.tokens.size());
      opts.ignore_eos = true;
      auto r = GenerateGreedy(*engine, g.prompt, opts);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_EQ(r->tokens.size(), g.tokens.size());
      size_t compared = 0;
      while (compared < g.tokens.size() && g.margins[compared] >= 1e-3) ++compared;
      EXPECT_GE(compared, 20u) << "golden margin too small early; regenerate goldens";
      for (size_t s = 0; s < compared; ++s) {
        ASSERT_EQ(r->tokens[s], g.tokens[s]) << "step " << s << " prompt len " << g.prompt.size();
      }
      const double rel = RelL2(r->last_prompt_logits, g.last_logits);
      EXPECT_LT(rel, 1e-3) << "last-position logits";
      std::printf("[golden] %s prompt_len=%zu compared=%zu/%zu logits_rel_l2=%.3g\n",
                  dir.filename().c_str(), g.prompt.size(), compared, g.tokens.size(), rel);
    }
  }
}

TEST(GoldenCpuTest, TokensIdenticalAcrossPageSizesAndPrefillChunks) {
  for (const auto& dir : GoldenDirs()) {
    SCOPED_TRACE(dir.filename().string());
    const auto goldens = LoadGoldens(dir / "goldens_fp32.json");
    const auto& g = goldens.back();  // the longest prompt
    std::vector<int32_t> reference;
    for (int32_t page : {16, 32, 64}) {
      auto engine = Load(dir, DType::kBF16, page);
      ASSERT_TRUE(engine);
      for (int32_t chunk : {512, 7, 1}) {
        GenerateOptions opts;
        opts.max_tokens = 24;
        opts.ignore_eos = true;
        opts.prefill_chunk = chunk;
        auto r = GenerateGreedy(*engine, g.prompt, opts);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        if (reference.empty()) reference = r->tokens;
        EXPECT_EQ(r->tokens, reference) << "page " << page << " chunk " << chunk;
      }
    }
  }
}

TEST(GoldenCpuTest, Fp8KvAgreementIsReported) {
  // FP8 KV changes numerics: report how long greedy decoding agrees with the FP32 goldens (no
  // exactness assertion), and check that the scales came from the built-in calibration.
  for (const auto& dir : GoldenDirs()) {
    auto engine = Load(dir, DType::kF8E4M3, 16);
    ASSERT_TRUE(engine);
    EXPECT_EQ(engine->runner->kv_scales().source, "calibration:builtin-v1");
    for (const auto& g : LoadGoldens(dir / "goldens_fp32.json")) {
      GenerateOptions opts;
      opts.max_tokens = static_cast<int32_t>(g.tokens.size());
      opts.ignore_eos = true;
      auto r = GenerateGreedy(*engine, g.prompt, opts);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      size_t agree = 0;
      while (agree < g.tokens.size() && r->tokens[agree] == g.tokens[agree]) ++agree;
      std::printf("[fp8-kv] %s prompt_len=%zu agrees for %zu/%zu steps\n", dir.filename().c_str(),
                  g.prompt.size(), agree, g.tokens.size());
      EXPECT_EQ(r->tokens.size(), g.tokens.size());
    }
  }
}

}  // namespace
}  // namespace dl
