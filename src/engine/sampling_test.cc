#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <gtest/gtest.h>

#include "engine/scheduler.h"
#include "tests/common/scheduler_util.h"

namespace dl {
namespace {

using testing_scheduler::Drain;
using testing_scheduler::TinyCpuEngine;

TEST(LogitProcessorsTest, OffByDefault) {
  SamplingParams p;
  EXPECT_FALSE(HasLogitProcessors(p));
  std::vector<float> logits = {1.0f, -2.0f, 3.0f};
  const std::vector<float> before = logits;
  const std::vector<int32_t> prompt = {0, 1}, generated = {2, 2};
  ApplyLogitProcessors(logits, p, prompt, generated);
  EXPECT_EQ(logits, before);
}

TEST(LogitProcessorsTest, BiasIsClampedAndComesBeforeThePenalties) {
  SamplingParams p;
  p.logit_bias = {{0, 500.0f}, {1, -7.5f}, {3, 1.0f}};
  EXPECT_TRUE(HasLogitProcessors(p));
  std::vector<float> logits = {0.5f, 1.0f, 2.0f, 1.0f};
  ApplyLogitProcessors(logits, p, {}, {});
  EXPECT_FLOAT_EQ(logits[0], 100.5f);  // OpenAI's range: [-100, 100]
  EXPECT_FLOAT_EQ(logits[1], -6.5f);
  EXPECT_FLOAT_EQ(logits[2], 2.0f);
  EXPECT_FLOAT_EQ(logits[3], 2.0f);
  // Bias first, then the repetition penalty on the biased value: (1 + 1) / 2, not 1 / 2 + 1.
  p.logit_bias = {{3, 1.0f}};
  p.repetition_penalty = 2.0f;
  logits = {0.5f, 1.0f, 2.0f, 1.0f};
  const std::vector<int32_t> prompt = {3};
  ApplyLogitProcessors(logits, p, prompt, {});
  EXPECT_FLOAT_EQ(logits[3], 1.0f);
}

TEST(LogitProcessorsTest, RepetitionPenaltyOverPromptAndOutputOncePerToken) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  std::vector<float> logits = {4.0f, -4.0f, 4.0f, -4.0f, 4.0f};
  const std::vector<int32_t> prompt = {0, 0, 0, 1};  // repeats count once
  const std::vector<int32_t> generated = {2, 3, 3};
  ApplyLogitProcessors(logits, p, prompt, generated);
  EXPECT_FLOAT_EQ(logits[0], 2.0f);   // positive: divided
  EXPECT_FLOAT_EQ(logits[1], -8.0f);  // negative: multiplied
  EXPECT_FLOAT_EQ(logits[2], 2.0f);
  EXPECT_FLOAT_EQ(logits[3], -8.0f);
  EXPECT_FLOAT_EQ(logits[4], 4.0f);  // never seen
}

TEST(LogitProcessorsTest, FrequencyAndPresenceCountGeneratedTokensOnly) {
  SamplingParams p;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  std::vector<float> logits = {1.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<int32_t> prompt = {0, 0, 0};  // the prompt does not count (vLLM, OpenAI)
  const std::vector<int32_t> generated = {1, 2, 2, 2, 1};
  ApplyLogitProcessors(logits, p, prompt, generated);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);
  EXPECT_FLOAT_EQ(logits[1], 1.0f - 2 * 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(logits[2], 1.0f - 3 * 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(logits[3], 1.0f);
  // Negative values reward repeats.
  p.frequency_penalty = -1.0f;
  p.presence_penalty = 0.0f;
  logits = {1.0f, 1.0f, 1.0f, 1.0f};
  ApplyLogitProcessors(logits, p, prompt, generated);
  EXPECT_FLOAT_EQ(logits[2], 4.0f);
}

TEST(LogitProcessorsTest, PenaltiesChangeGreedyChoices) {
  // Greedy sampling picks from the processed logits, as vLLM does.
  std::vector<float> logits = {3.0f, 2.9f, 0.0f};
  SamplingParams p;  // temperature 0
  EXPECT_EQ(SampleToken(logits, p, 1, 0), 0);
  p.presence_penalty = 0.2f;
  const std::vector<int32_t> generated = {0};
  std::vector<float> processed = logits;
  ApplyLogitProcessors(processed, p, {}, generated);
  EXPECT_EQ(SampleToken(processed, p, 1, 0), 1);
  p = {};
  p.logit_bias = {{2, 10.0f}};
  processed = logits;
  ApplyLogitProcessors(processed, p, {}, {});
  EXPECT_EQ(SampleToken(processed, p, 1, 0), 2);
}

TEST(MinPTest, DropsTokensBelowMinPTimesTheTopProbability) {
  // Probabilities at T = 1 are proportional to exp(l): 1, e^-1, e^-2, e^-3 relative to the top.
  const std::vector<float> logits = {0.0f, -1.0f, -2.0f, -3.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.min_p = 0.2f;  // keeps e^0 and e^-1 (0.37), drops e^-2 (0.135) and e^-3
  for (const bool sorted_path : {false, true}) {
    p.top_k = sorted_path ? 3 : 0;
    std::set<int32_t> seen;
    for (uint64_t step = 0; step < 400; ++step) seen.insert(SampleToken(logits, p, 7, step));
    EXPECT_EQ(seen, (std::set<int32_t>{0, 1})) << "sorted path " << sorted_path;
  }
  // Temperature comes before min_p: at T = 4 the relative probabilities are e^(l/4) = 1, 0.78,
  // 0.61, 0.47, so min_p 0.5 now keeps three tokens.
  p.top_k = 0;
  p.temperature = 4.0f;
  p.min_p = 0.5f;
  std::set<int32_t> seen;
  for (uint64_t step = 0; step < 400; ++step) seen.insert(SampleToken(logits, p, 9, step));
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1, 2}));
  // min_p = 1 keeps only the top token(s).
  p.min_p = 1.0f;
  p.top_p = 0.99f;
  for (uint64_t step = 0; step < 50; ++step) EXPECT_EQ(SampleToken(logits, p, 3, step), 0);
}

TEST(MinPTest, ZeroLeavesSamplingUnchanged) {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i) * 1.7f) * 3;
  SamplingParams a;
  a.temperature = 0.8f;
  a.top_k = 20;
  a.top_p = 0.9f;
  SamplingParams b = a;
  b.min_p = 1e-30f;  // keeps everything a float logit gap can produce here
  for (uint64_t step = 0; step < 200; ++step) {
    EXPECT_EQ(SampleToken(logits, a, 11, step), SampleToken(logits, b, 11, step));
  }
}

// ---- through the scheduler ----


// One sequence decoded by hand: prefill in chunks of 16, then per step the raw logits back from the
// backend, processors + sampler on the host.
std::vector<int32_t> ReferenceDecode(Engine& e, const std::vector<int32_t>& prompt,
                                     const SamplingParams& p, int n) {
  SequenceKv seq;
  std::vector<float> logits;
  auto run = [&](std::span<const int32_t> chunk, bool output) {
    EXPECT_TRUE(e.kv->Reserve(seq, static_cast<int32_t>(chunk.size())).ok());
    ForwardBatch b;
    b.AddSequence(seq, chunk);
    if (output) b.AddOutput(static_cast<int32_t>(chunk.size()) - 1).want_logits = true;
    ForwardResult r;
    EXPECT_TRUE(e.runner->Forward(b, &r).ok());
    if (output) logits = r.rows[0].logits;
    EXPECT_TRUE(e.kv->Commit(seq, static_cast<int32_t>(chunk.size())).ok());
  };
  for (size_t i = 0; i < prompt.size(); i += 16) {
    const size_t m = std::min<size_t>(16, prompt.size() - i);
    run(std::span<const int32_t>(prompt).subspan(i, m), i + m == prompt.size());
  }
  std::vector<int32_t> out;
  for (int step = 0; step < n; ++step) {
    std::vector<float> processed = logits;
    ApplyLogitProcessors(processed, p, prompt, out);
    out.push_back(SampleToken(processed, p, 0, static_cast<uint64_t>(step)));
    if (step + 1 < n) run(std::span<const int32_t>(&out.back(), 1), true);
  }
  EXPECT_TRUE(e.kv->Release(seq).ok());
  return out;
}

TEST(SchedulerSamplingTest, GreedyPenaltiesSeeThePromptAndEveryGeneratedToken) {
  auto engine = TinyCpuEngine(2, 16, 128);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 20; ++i) prompt.push_back(40 + (i * 13) % 300);
  SamplingParams p;
  p.max_tokens = 24;
  p.ignore_eos = true;
  p.repetition_penalty = 1.8f;
  p.frequency_penalty = 0.7f;
  p.presence_penalty = 0.4f;
  p.logit_bias = {{prompt[3], 2.5f}};
  const std::vector<int32_t> expected = ReferenceDecode(*engine, prompt, p, p.max_tokens);
  SamplingParams plain;
  plain.max_tokens = p.max_tokens;
  plain.ignore_eos = true;
  const std::vector<int32_t> unpenalised = ReferenceDecode(*engine, prompt, plain, p.max_tokens);
  ASSERT_NE(expected, unpenalised) << "the penalties must matter for this prompt";

  Scheduler sched(*engine, {.max_batch = 2, .max_waiting = 4, .prefill_chunk = 16});
  sched.Start();
  auto a = sched.Submit({prompt, p});
  auto b = sched.Submit({prompt, plain});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(Drain(**a).tokens, expected);
  EXPECT_EQ(Drain(**b).tokens, unpenalised);
}

TEST(SchedulerSamplingTest, RefusesOutOfRangeValues) {
  auto engine = TinyCpuEngine(2, 16, 128);
  Scheduler sched(*engine, {.max_batch = 1, .max_waiting = 4});
  auto bad = [&](auto set) {
    GenerationRequest r;
    r.prompt = {5, 6};
    r.sampling.max_tokens = 1;
    set(r.sampling);
    return sched.Submit(r).status();
  };
  for (auto st : {bad([](SamplingParams& s) { s.min_p = 1.5f; }),
                  bad([](SamplingParams& s) { s.min_p = -0.1f; }),
                  bad([](SamplingParams& s) { s.presence_penalty = 2.5f; }),
                  bad([](SamplingParams& s) { s.frequency_penalty = -3.0f; }),
                  bad([](SamplingParams& s) { s.repetition_penalty = 0.0f; }),
                  bad([](SamplingParams& s) { s.repetition_penalty = NAN; }),
                  bad([](SamplingParams& s) { s.logit_bias = {{512, 1.0f}}; }),
                  bad([](SamplingParams& s) { s.logit_bias = {{-1, 1.0f}}; }),
                  bad([](SamplingParams& s) { s.logit_bias = {{3, NAN}}; })}) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  }
  sched.Stop();
}

}  // namespace
}  // namespace dl
