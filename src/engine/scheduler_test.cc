#include "engine/scheduler.h"

#include <cmath>
#include <thread>

#include <gtest/gtest.h>

#include "tests/common/scheduler_util.h"

namespace dl {
namespace {

using testing_scheduler::Collected;
using testing_scheduler::Drain;
using testing_scheduler::SubmitAndDrain;
using testing_scheduler::TinyCpuEngine;

std::vector<int32_t> Prompt(int32_t n, int32_t salt) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) p[i] = 30 + (i * 37 + salt * 11) % 400;  // avoids eos ids 2, 24
  return p;
}

int32_t UsedPages(const Engine& e) {
  return e.kv->used_pages(KvGroup::kFull) + e.kv->used_pages(KvGroup::kSliding);
}

// Each prompt alone through GenerateGreedy (greedy, ignore_eos, prefill chunks of 16).
std::vector<std::vector<int32_t>> AloneOutputs(const std::vector<std::vector<int32_t>>& prompts, int32_t max_tokens,
                                               int32_t max_seq_len) {
  auto ref_engine = TinyCpuEngine(1, 16, max_seq_len);
  std::vector<std::vector<int32_t>> out;
  for (const auto& p : prompts) {
    GenerateOptions g;
    g.max_tokens = max_tokens;
    g.ignore_eos = true;
    g.prefill_chunk = 16;
    auto r = GenerateGreedy(*ref_engine, p, g);
    EXPECT_TRUE(r.ok()) << r.status().message();
    out.push_back(r.ok() ? r->tokens : std::vector<int32_t>{});
  }
  return out;
}

// Every prompt submitted at once (greedy, ignore_eos); each one's collected output.
std::vector<Collected> RunTogether(Scheduler& sched, const std::vector<std::vector<int32_t>>& prompts,
                                   int32_t max_tokens) {
  std::vector<GenerationRequest> requests;
  for (const auto& p : prompts) {
    GenerationRequest& r = requests.emplace_back();
    r.prompt = p;
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
  }
  return SubmitAndDrain(sched, std::move(requests));
}

TEST(SchedulerTest, GreedyOutputsEqualGenerateGreedyWhateverElseRuns) {
  // Reference: one sequence at a time through GenerateGreedy.
  std::vector<std::vector<int32_t>> prompts = {Prompt(5, 1), Prompt(40, 2), Prompt(23, 3),
                                               Prompt(70, 4)};
  const auto expected = AloneOutputs(prompts, 12, 256);
  // All at once through the scheduler, batch 3 (one waits), with a long prompt prefilled in chunks
  // while others decode.
  auto engine = TinyCpuEngine(3);
  Scheduler sched(*engine, {.max_batch = 3, .max_waiting = 16, .prefill_chunk = 16});
  sched.Start();
  const auto got = RunTogether(sched, prompts, 12);
  ASSERT_EQ(got.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i].last.reason, FinishReason::kLength);
    EXPECT_EQ(got[i].tokens, expected[i]) << "prompt " << i;
    EXPECT_EQ(got[i].last.prompt_tokens, static_cast<int32_t>(prompts[i].size()));
    EXPECT_EQ(got[i].last.cached_tokens, 0);
  }
  sched.Stop();
  EXPECT_EQ(UsedPages(*engine), 0);
  auto stats = sched.Stats();
  EXPECT_EQ(stats.finished_total["length"], 4u);
  EXPECT_EQ(stats.generation_tokens_total, 48u);
  EXPECT_EQ(stats.ttft.count, 4u);
  EXPECT_EQ(stats.itl.count, 44u);
}

// A KV pool that holds one full-length sequence, four requests at once: steps run out of pages, the
// newest sequences are preempted and recomputed later, and every output still equals its alone run.
TEST(SchedulerTest, PreemptionRecomputesAndKeepsEveryOutput) {
  std::vector<std::vector<int32_t>> prompts = {Prompt(40, 1), Prompt(33, 2), Prompt(47, 3), Prompt(20, 4)};
  const auto expected = AloneOutputs(prompts, 60, 128);
  auto engine = TinyCpuEngine(1, 16, 128);
  Scheduler sched(*engine, {.max_batch = 4, .max_waiting = 8, .prefill_chunk = 16});
  sched.Start();
  const auto got = RunTogether(sched, prompts, 60);
  ASSERT_EQ(got.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i].last.reason, FinishReason::kLength) << got[i].last.error.message();
    EXPECT_EQ(got[i].tokens, expected[i]) << "prompt " << i;
  }
  sched.Stop();
  EXPECT_GT(sched.Stats().preemptions_total, 0u) << "the pool should have run out of pages";
  EXPECT_EQ(UsedPages(*engine), 0);
}

// A request that needs the whole KV pool (128 positions of a pool of 128) next to a small one: both
// complete (the pool is sized so that any admissible request fits alone), with the greedy tokens the
// long one gets alone.
TEST(SchedulerTest, ARequestNeedingTheWholePoolCompletesBesideAnother) {
  auto engine = TinyCpuEngine(1, 16, 128);
  Scheduler sched(*engine, {.max_batch = 2, .max_waiting = 8, .prefill_chunk = 16});
  sched.Start();
  GenerationRequest big;
  big.prompt = Prompt(100, 5);
  big.sampling.max_tokens = 28;
  big.sampling.ignore_eos = true;
  GenerationRequest small;
  small.prompt = Prompt(10, 6);
  small.sampling.max_tokens = 5;
  auto a = sched.Submit(big);
  auto b = sched.Submit(small);
  ASSERT_TRUE(a.ok() && b.ok());
  Collected cb = Drain(**b);
  EXPECT_EQ(cb.tokens.size(), 5u);
  Collected ca = Drain(**a);
  EXPECT_EQ(ca.last.reason, FinishReason::kLength) << ca.last.error.message();
  EXPECT_EQ(ca.tokens, AloneOutputs({big.prompt}, 28, 128)[0]);
  sched.Stop();
  EXPECT_EQ(UsedPages(*engine), 0);
}

TEST(SchedulerTest, ValidatesRequests) {
  auto engine = TinyCpuEngine(1, 16, 64);
  Scheduler sched(*engine, {.max_batch = 1, .max_waiting = 4});
  sched.Start();
  GenerationRequest r;
  EXPECT_EQ(sched.Submit(r).status().code(), StatusCode::kInvalidArgument);  // empty
  r.prompt = {5, 600};
  EXPECT_EQ(sched.Submit(r).status().code(), StatusCode::kInvalidArgument);  // out of vocab
  r.prompt = {5, -1};
  EXPECT_EQ(sched.Submit(r).status().code(), StatusCode::kInvalidArgument);
  r.prompt = Prompt(60, 1);
  r.sampling.max_tokens = 5;  // 65 > 64
  EXPECT_EQ(sched.Submit(r).status().code(), StatusCode::kInvalidArgument);
  r.sampling.max_tokens = 0;
  r.prompt = {5};
  EXPECT_EQ(sched.Submit(r).status().code(), StatusCode::kInvalidArgument);
  r.sampling.max_tokens = 1;
  r.sampling.top_p = 0.0f;
  EXPECT_EQ(sched.Submit(r).status().code(), StatusCode::kInvalidArgument);
  r.sampling.top_p = 1.0f;
  auto ok = sched.Submit(r);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(Drain(**ok).tokens.size(), 1u);
}

TEST(SchedulerTest, CancellationAndShutdownReturnEveryPage) {
  auto engine = TinyCpuEngine(2, 16, 256);
  Scheduler sched(*engine, {.max_batch = 2, .max_waiting = 8});
  sched.Start();
  GenerationRequest r;
  r.prompt = Prompt(30, 5);
  r.sampling.max_tokens = 200;
  r.sampling.ignore_eos = true;
  auto a = sched.Submit(r);
  auto b = sched.Submit(r);
  auto c = sched.Submit(r);  // waits: batch 2
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  // Let a few tokens flow, then cancel a (running) and c (queued).
  RequestState::Update u;
  int got = 0;
  while (got < 3) {
    (*a)->Poll(&u, std::chrono::milliseconds(100));
    got += static_cast<int>(u.tokens.size());
  }
  (*a)->Cancel();
  (*c)->Cancel();
  Collected ca = Drain(**a);
  EXPECT_EQ(ca.last.reason, FinishReason::kCancelled);
  Collected cc = Drain(**c);
  EXPECT_EQ(cc.last.reason, FinishReason::kCancelled);
  EXPECT_TRUE(cc.tokens.empty());
  // b still running: shutting down ends it with an error rather than hanging.
  sched.Stop();
  Collected cb = Drain(**b);
  EXPECT_TRUE(cb.last.finished);
  EXPECT_EQ(cb.last.reason, FinishReason::kCancelled);
  EXPECT_EQ(cb.last.error.code(), StatusCode::kUnavailable);
  EXPECT_EQ(UsedPages(*engine), 0);
  EXPECT_EQ(sched.Submit(r).status().code(), StatusCode::kUnavailable);
}

TEST(SchedulerTest, QueueLimitRefusesWithResourceExhausted) {
  auto engine = TinyCpuEngine(1, 16, 512);
  Scheduler sched(*engine, {.max_batch = 1, .max_waiting = 2});
  // Not started: everything stays queued, so the limit is hit deterministically.
  GenerationRequest r;
  r.prompt = Prompt(8, 1);
  r.sampling.max_tokens = 4;
  ASSERT_TRUE(sched.Submit(r).ok());
  ASSERT_TRUE(sched.Submit(r).ok());
  EXPECT_EQ(sched.Submit(r).status().code(), StatusCode::kResourceExhausted);
  sched.Stop();
}

TEST(SchedulerTest, StopTokensAndEos) {
  auto engine = TinyCpuEngine(1);
  Scheduler sched(*engine, {.max_batch = 1});
  sched.Start();
  GenerationRequest r;
  r.prompt = Prompt(9, 2);
  r.sampling.max_tokens = 10;
  r.sampling.ignore_eos = true;
  auto first = sched.Submit(r);
  ASSERT_TRUE(first.ok());
  Collected full = Drain(**first);
  ASSERT_EQ(full.tokens.size(), 10u);
  // Stop at the 4th token's id: the output ends at its first occurrence, reason stop.
  r.sampling.stop_token_ids = {full.tokens[3]};
  auto second = sched.Submit(r);
  ASSERT_TRUE(second.ok());
  Collected stopped = Drain(**second);
  EXPECT_EQ(stopped.last.reason, FinishReason::kStop);
  size_t first_at = 0;
  while (full.tokens[first_at] != full.tokens[3]) ++first_at;
  EXPECT_EQ(stopped.tokens,
            std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + first_at + 1));
}

TEST(SchedulerTest, SeededSamplingIsReproducibleAndLogprobsAreNormalised) {
  auto engine = TinyCpuEngine(2);
  Scheduler sched(*engine, {.max_batch = 2});
  sched.Start();
  GenerationRequest r;
  r.prompt = Prompt(12, 9);
  r.sampling.max_tokens = 16;
  r.sampling.ignore_eos = true;
  r.sampling.temperature = 1.5f;
  r.sampling.top_k = 50;
  r.sampling.top_p = 0.9f;
  r.sampling.seed = 1234;
  r.sampling.logprobs = 3;
  auto a = sched.Submit(r);
  auto b = sched.Submit(r);
  ASSERT_TRUE(a.ok() && b.ok());
  Collected ca = Drain(**a), cb = Drain(**b);
  EXPECT_EQ(ca.tokens, cb.tokens);
  ASSERT_EQ(ca.events.size(), 16u);
  for (const auto& e : ca.events) {
    ASSERT_EQ(e.top.size(), 3u);
    EXPECT_LE(e.logprob, 0.0f);
    EXPECT_GE(e.top[0].logprob, e.top[1].logprob);
    EXPECT_GE(e.top[0].logprob, e.logprob);
  }
  r.sampling.seed = 99;
  auto c = sched.Submit(r);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(Drain(**c).tokens, ca.tokens);  // 16 draws at T=1.5: a collision is astronomically rare
}

TEST(SamplingTest, TopKOneIsGreedyAndLogprobsSumToOne) {
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 1;
  for (uint64_t step = 0; step < 20; ++step) EXPECT_EQ(SampleToken(logits, p, 42, step), 1);
  p.top_k = 0;
  p.top_p = 1e-6f;  // only the most likely token survives
  for (uint64_t step = 0; step < 20; ++step) EXPECT_EQ(SampleToken(logits, p, 42, step), 1);
  TokenEvent ev;
  ComputeLogprobs(logits, 4, 5, &ev);
  double total = 0;
  for (const auto& t : ev.top) total += std::exp(t.logprob);
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_EQ(ev.top[0].token, 1);  // tie with 3 goes to the lower id
  EXPECT_EQ(ev.top[1].token, 3);
  EXPECT_NEAR(ev.logprob, ev.top[2].logprob, 1e-7);  // token 4 (logit 1.0) is third
}

TEST(SchedulerPrefixCacheTest, SharedPrefixLongerThanTheWindowGivesIdenticalOutputs) {
  // Tiny: sliding window 8, pages of 16. Prefix of 50 tokens: 3 whole pages are reusable.
  std::vector<int32_t> prefix = Prompt(50, 3);
  std::vector<int32_t> a = prefix, b = prefix;
  for (int i = 0; i < 7; ++i) a.push_back(100 + i);
  for (int i = 0; i < 11; ++i) b.push_back(200 + i);
  auto run = [&](bool caching, std::vector<int32_t>* cached_b) {
    // Pools for 4 sequences: room for the cache's pages beside the running one (as serve does).
    auto engine = TinyCpuEngine(4, 16, 256);
    Scheduler sched(*engine, {.max_batch = 1, .prefill_chunk = 16, .enable_prefix_caching = caching});
    sched.Start();
    std::vector<std::vector<int32_t>> outs;
    for (const auto* p : {&a, &b}) {
      GenerationRequest r;
      r.prompt = *p;
      r.sampling.max_tokens = 10;
      r.sampling.ignore_eos = true;
      auto st = sched.Submit(r);
      EXPECT_TRUE(st.ok());
      Collected c = Drain(**st);
      outs.push_back(c.tokens);
      cached_b->push_back(c.last.cached_tokens);
    }
    // Idle: the only pages still held are the cache's.
    EXPECT_EQ(UsedPages(*engine), sched.prefix_cache_pages());
    sched.ClearPrefixCache();
    for (int i = 0; i < 100 && UsedPages(*engine) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(UsedPages(*engine), 0);
    sched.Stop();
    return outs;
  };
  std::vector<int32_t> cached_off, cached_on;
  auto off = run(false, &cached_off);
  auto on = run(true, &cached_on);
  EXPECT_EQ(off, on);
  EXPECT_EQ(cached_off, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(cached_on, (std::vector<int32_t>{0, 48}));
}

}  // namespace
}  // namespace dl
