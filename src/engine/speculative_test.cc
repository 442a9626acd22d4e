// Speculative decoding on the CPU reference: whatever a drafter proposes (always right, always wrong,
// randomly corrupted, n-gram lookup), the output equals plain decoding token for token and logit for
// logit, alone (GenerateGreedy) and in a scheduler batch beside other sequences, greedy and sampled,
// with stops and max_tokens cutting inside an accepted run, at page sizes 16, 32 and 64.
#include <gtest/gtest.h>

#include "engine/drafter.h"
#include "engine/engine.h"
#include "engine/scheduler.h"
#include "tests/common/scheduler_util.h"

namespace dl {
namespace {

using testing_scheduler::Collected;
using testing_scheduler::SubmitAndDrain;

constexpr int32_t kTinyVocab = 512;

std::unique_ptr<Engine> TinyEngine(int32_t page_size, int32_t max_sequences, int32_t max_seq_len = 256,
                                   int32_t max_draft_tokens = 8) {
  EngineOptions o;
  o.shape = "tiny";
  o.seed = 7;
  o.backend = BackendKind::kCpu;
  o.page_size = page_size;
  o.max_sequences = max_sequences;
  o.max_batch = max_sequences;
  o.prefill_chunk = 16;
  o.max_seq_len = max_seq_len;
  o.max_draft_tokens = max_draft_tokens;
  auto e = LoadEngine(o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::vector<int32_t> Prompt(int32_t n, int32_t salt) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) p[i] = 30 + (i * 37 + salt * 11) % 400;  // avoids eos ids 2, 24
  return p;
}

// A code-like prompt: a short pattern repeated, so the n-gram drafter always finds a match.
std::vector<int32_t> RepetitivePrompt(int32_t n, int32_t salt) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) p[i] = 40 + ((i % 6) * 13 + salt) % 300;
  return p;
}

int32_t UsedPages(const Engine& e) {
  return e.kv->used_pages(KvGroup::kFull) + e.kv->used_pages(KvGroup::kSliding);
}

// ---- drafters ----

TEST(NgramDrafterTest, ProposesWhatFollowedTheMostRecentMatchOfTheLongestSuffix) {
  NgramDrafter d(1, 3);
  // Suffix [1, 2, 3] occurs at 0: propose what followed it, clipped to max_tokens.
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 9, 1, 2, 3};
  EXPECT_EQ(d.Propose(a, 2), (std::vector<int32_t>{4, 5}));
  // The most recent earlier occurrence wins: [5, 6] at 0 (then 7) and at 3 (then 8).
  NgramDrafter two(2, 2);
  const std::vector<int32_t> b = {5, 6, 7, 5, 6, 8, 0, 5, 6};
  EXPECT_EQ(two.Propose(b, 3), (std::vector<int32_t>{8, 0, 5}));
  // The longest suffix wins over a more recent shorter one: [2, 3] matches at 5 (then 9) but
  // [1, 2, 3] at 0 (then 4).
  const std::vector<int32_t> c = {1, 2, 3, 4, 0, 2, 3, 9, 1, 2, 3};
  EXPECT_EQ(d.Propose(c, 1), (std::vector<int32_t>{4}));
  // Fewer than max_tokens when the context ends first; the proposal may run into the suffix itself.
  const std::vector<int32_t> e = {7, 7, 7};
  EXPECT_EQ(d.Propose(e, 5), (std::vector<int32_t>{7}));
  // No match of at least ngram_min tokens: nothing.
  NgramDrafter three(3, 4);
  EXPECT_EQ(three.Propose(c, 4), (std::vector<int32_t>{4, 0, 2, 3}));
  const std::vector<int32_t> f = {1, 2, 3, 4, 5, 6, 2, 3};
  EXPECT_TRUE(three.Propose(f, 4).empty());
  EXPECT_EQ(NgramDrafter(2, 2).Propose(f, 4), (std::vector<int32_t>{4, 5, 6, 2}));
  EXPECT_TRUE(d.Propose(std::vector<int32_t>{5}, 4).empty());
  EXPECT_TRUE(d.Propose(a, 0).empty());
}

TEST(SpecOptionsTest, ParsesValidatesAndRefusesDflash) {
  EXPECT_EQ(*SpecOptions::ParseMethod("none"), SpecMethod::kNone);
  EXPECT_EQ(*SpecOptions::ParseMethod("ngram"), SpecMethod::kNgram);
  auto dflash = SpecOptions::ParseMethod("dflash");
  ASSERT_FALSE(dflash.ok());
  EXPECT_EQ(dflash.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(dflash.status().message().find("not implemented yet"), std::string::npos);
  EXPECT_EQ(SpecOptions::ParseMethod("eagle").status().code(), StatusCode::kInvalidArgument);
  SpecOptions o;
  o.method = SpecMethod::kNgram;
  EXPECT_TRUE(o.Validate().ok());
  o.k = 0;
  EXPECT_FALSE(o.Validate().ok());
  o.k = 4;
  o.ngram_min = 5;
  o.ngram_max = 3;
  EXPECT_FALSE(o.Validate().ok());
  o.ngram_min = 1;
  auto d = MakeDrafter(o);
  ASSERT_TRUE(d.ok());
  ASSERT_NE(*d, nullptr);
  EXPECT_EQ((*d)->name(), "ngram[1,3]");
  EXPECT_EQ(*MakeDrafter(SpecOptions{}), nullptr);
}

TEST(SpecStatsTest, CountsAsVllm) {
  SpecStats s;
  s.Record(4, 2);
  s.Record(3, 3);
  s.Record(0, 0);  // no drafts: not a draft
  EXPECT_EQ(s.num_drafts, 2u);
  EXPECT_EQ(s.num_draft_tokens, 7u);
  EXPECT_EQ(s.num_accepted_tokens, 5u);
  EXPECT_EQ(s.accepted_per_pos, (std::vector<uint64_t>{2, 2, 1, 0}));
  EXPECT_DOUBLE_EQ(s.mean_acceptance_length(), 3.5);
  EXPECT_DOUBLE_EQ(s.acceptance_rate(), 5.0 / 7.0);
}

// ---- the single-sequence path ----

struct DrafterCase {
  std::string name;
  std::shared_ptr<const Drafter> drafter;
};

std::vector<DrafterCase> Drafters(const TruthTable& truth) {
  return {{"oracle", std::make_shared<OracleDrafter>(truth)},
          {"always-wrong", std::make_shared<WrongDrafter>(truth, kTinyVocab)},
          {"random-corrupt", std::make_shared<CorruptingDrafter>(truth, kTinyVocab, 0.3, 11)},
          {"ngram", std::make_shared<NgramDrafter>(1, 3)}};
}

TEST(SpeculativeGenerateTest, EqualsPlainGreedyTokenForTokenAndLogitForLogit) {
  for (int32_t page : {16, 32, 64}) {
    auto engine = TinyEngine(page, 1);
    ASSERT_NE(engine, nullptr);
    for (const auto& prompt : {Prompt(21, 1), RepetitivePrompt(40, 2)}) {
      GenerateOptions g;
      g.max_tokens = 23;
      g.ignore_eos = true;
      g.prefill_chunk = 16;
      g.keep_step_logits = true;
      auto plain = GenerateGreedy(*engine, prompt, g);
      ASSERT_TRUE(plain.ok()) << plain.status().message();
      TruthTable truth;
      truth.Add(prompt, plain->tokens);
      for (const auto& dc : Drafters(truth)) {
        for (int32_t k : {1, 4, 8}) {
          GenerateOptions sg = g;
          sg.drafter = dc.drafter.get();
          sg.num_draft_tokens = k;
          auto spec = GenerateGreedy(*engine, prompt, sg);
          ASSERT_TRUE(spec.ok()) << spec.status().message();
          const std::string where = dc.name + ", k " + std::to_string(k) + ", page " + std::to_string(page);
          EXPECT_EQ(spec->tokens, plain->tokens) << where;
          EXPECT_EQ(spec->step_logits, plain->step_logits) << where;
          EXPECT_EQ(spec->margins, plain->margins) << where;
          EXPECT_EQ(spec->finish_reason, plain->finish_reason) << where;
          int32_t produced = 1;  // the prefill's token
          for (int32_t t : spec->decode_step_tokens) produced += t;
          EXPECT_EQ(produced, static_cast<int32_t>(spec->tokens.size())) << where;
          if (dc.name == "oracle") {
            // Every draft accepted: ceil(22 / (k + 1)) verify steps.
            EXPECT_EQ(spec->spec.num_accepted_tokens, spec->spec.num_draft_tokens) << where;
            EXPECT_EQ(spec->decode_step_tokens.size(), static_cast<size_t>((22 + k) / (k + 1))) << where;
          }
          if (dc.name == "always-wrong") {
            EXPECT_GT(spec->spec.num_drafts, 0u) << where;
            EXPECT_EQ(spec->spec.num_accepted_tokens, 0u) << where;
          }
          if (dc.name == "random-corrupt") EXPECT_GT(spec->spec.num_drafts, 0u) << where;
        }
      }
      EXPECT_EQ(UsedPages(*engine), 0);
    }
  }
}

TEST(SpeculativeGenerateTest, MaxTokensInsideAnAcceptedRunIsExact) {
  auto engine = TinyEngine(16, 1);
  const auto prompt = Prompt(19, 4);
  GenerateOptions g;
  g.max_tokens = 30;
  g.ignore_eos = true;
  auto plain = GenerateGreedy(*engine, prompt, g);
  ASSERT_TRUE(plain.ok());
  TruthTable truth;
  truth.Add(prompt, plain->tokens);
  OracleDrafter oracle(truth);
  for (int32_t max_tokens : {1, 2, 3, 5, 6, 7, 11}) {
    GenerateOptions sg = g;
    sg.max_tokens = max_tokens;
    sg.drafter = &oracle;
    sg.num_draft_tokens = 4;
    auto spec = GenerateGreedy(*engine, prompt, sg);
    ASSERT_TRUE(spec.ok()) << spec.status().message();
    EXPECT_EQ(spec->tokens, std::vector<int32_t>(plain->tokens.begin(), plain->tokens.begin() + max_tokens));
    // Never a draft beyond what max_tokens leaves: every drafted token was accepted.
    EXPECT_EQ(spec->spec.num_accepted_tokens, spec->spec.num_draft_tokens);
  }
  EXPECT_EQ(UsedPages(*engine), 0);
}

// ---- the scheduler ----

struct Req {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

std::vector<Collected> RunScheduler(Engine& engine, const std::vector<Req>& reqs, int32_t max_batch,
                                    std::shared_ptr<const Drafter> drafter, int32_t k, SchedulerStats* stats) {
  SchedulerOptions so;
  so.max_batch = max_batch;
  so.max_waiting = 64;
  so.prefill_chunk = 16;
  so.drafter = std::move(drafter);
  so.num_draft_tokens = k;
  Scheduler sched(engine, so);
  sched.Start();
  std::vector<GenerationRequest> requests;
  for (const Req& r : reqs) requests.push_back({r.prompt, r.sampling});
  std::vector<Collected> out = SubmitAndDrain(sched, std::move(requests));
  sched.Stop();
  if (stats) *stats = sched.Stats();
  EXPECT_EQ(UsedPages(engine), 0);
  return out;
}

void ExpectSameOutputs(const std::vector<Collected>& want, const std::vector<Collected>& got,
                       const std::string& where) {
  ASSERT_EQ(want.size(), got.size()) << where;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].last.reason, want[i].last.reason) << where << ", request " << i << ": "
                                                       << got[i].last.error.message();
    EXPECT_EQ(got[i].tokens, want[i].tokens) << where << ", request " << i;
    ASSERT_EQ(got[i].events.size(), want[i].events.size()) << where;
    for (size_t t = 0; t < want[i].events.size(); ++t) {
      const TokenEvent& a = want[i].events[t];
      const TokenEvent& b = got[i].events[t];
      EXPECT_EQ(a.logprob, b.logprob) << where << ", request " << i << ", token " << t;
      ASSERT_EQ(a.top.size(), b.top.size());
      for (size_t j = 0; j < a.top.size(); ++j) {
        EXPECT_EQ(a.top[j].token, b.top[j].token);
        EXPECT_EQ(a.top[j].logprob, b.top[j].logprob) << where << ", request " << i << ", token " << t;
      }
    }
  }
}

// Greedy, seeded sampling, sampling with penalties over the generated tokens (their per-row state
// includes the earlier drafts), a stop token inside the run, and max_tokens of 1: all in one batch.
std::vector<Req> MixedRequests(const std::vector<Collected>* plain_for_stop) {
  std::vector<Req> reqs(8);
  reqs[0].prompt = Prompt(21, 1);
  reqs[0].sampling.max_tokens = 20;
  reqs[0].sampling.ignore_eos = true;
  reqs[0].sampling.logprobs = 3;
  reqs[1].prompt = RepetitivePrompt(45, 2);
  reqs[1].sampling.max_tokens = 17;
  reqs[1].sampling.ignore_eos = true;
  reqs[2].prompt = Prompt(9, 3);
  reqs[2].sampling.max_tokens = 18;
  reqs[2].sampling.ignore_eos = true;
  reqs[2].sampling.temperature = 0.8f;
  reqs[2].sampling.top_k = 40;
  reqs[2].sampling.seed = 1234;
  reqs[2].sampling.logprobs = 2;
  reqs[3].prompt = RepetitivePrompt(30, 4);
  reqs[3].sampling.max_tokens = 16;
  reqs[3].sampling.ignore_eos = true;
  reqs[3].sampling.temperature = 1.0f;
  reqs[3].sampling.seed = 77;
  reqs[3].sampling.frequency_penalty = 0.7f;
  reqs[3].sampling.presence_penalty = 0.3f;
  reqs[3].sampling.repetition_penalty = 1.2f;
  reqs[4].prompt = Prompt(33, 5);
  reqs[4].sampling.max_tokens = 16;
  reqs[4].sampling.ignore_eos = true;
  reqs[5].prompt = Prompt(12, 6);
  reqs[5].sampling.max_tokens = 1;
  // Penalties over the generated tokens strong enough to change greedy choices: a verify row that
  // did not count the drafts before it as generated would choose differently.
  reqs[6].prompt = Prompt(14, 7);
  reqs[6].sampling.max_tokens = 30;
  reqs[6].sampling.ignore_eos = true;
  reqs[6].sampling.presence_penalty = 2.0f;
  reqs[6].sampling.frequency_penalty = 1.0f;
  reqs[7].prompt = RepetitivePrompt(24, 8);
  reqs[7].sampling.max_tokens = 30;
  reqs[7].sampling.ignore_eos = true;
  reqs[7].sampling.temperature = 0.5f;
  reqs[7].sampling.seed = 3;
  reqs[7].sampling.presence_penalty = 2.0f;
  reqs[7].sampling.repetition_penalty = 1.5f;
  if (plain_for_stop != nullptr) {
    // Request 4 again with a stop id: the token at index 6 of its plain output, cut at its first
    // occurrence (inside an oracle's accepted run).
    const auto& t = (*plain_for_stop)[4].tokens;
    reqs[4].sampling.stop_token_ids = {t[6]};
  }
  return reqs;
}

TEST(SpeculativeSchedulerTest, EqualsPlainDecodingInABatchWithEveryDrafter) {
  for (int32_t page : {16, 32, 64}) {
    auto engine = TinyEngine(page, 4);
    ASSERT_NE(engine, nullptr);
    const auto base = MixedRequests(nullptr);
    const auto first = RunScheduler(*engine, base, 4, nullptr, 0, nullptr);
    const auto reqs = MixedRequests(&first);
    const auto plain = RunScheduler(*engine, reqs, 4, nullptr, 0, nullptr);
    // The stop cut request 4 short, at the stop token's first occurrence.
    ASSERT_EQ(plain[4].last.reason, FinishReason::kStop);
    ASSERT_LE(plain[4].tokens.size(), 7u);
    ASSERT_EQ(plain[5].tokens.size(), 1u);
    TruthTable truth;
    for (size_t i = 0; i < reqs.size(); ++i) truth.Add(reqs[i].prompt, first[i].tokens);
    for (const auto& dc : Drafters(truth)) {
      for (int32_t k : {2, 5}) {
        for (int32_t max_batch : {1, 4}) {
          SchedulerStats stats;
          const auto got = RunScheduler(*engine, reqs, max_batch, dc.drafter, k, &stats);
          const std::string where = dc.name + ", k " + std::to_string(k) + ", batch " + std::to_string(max_batch) +
                                    ", page " + std::to_string(page);
          ExpectSameOutputs(plain, got, where);
          EXPECT_GT(stats.spec.num_drafts, 0u) << where;
          if (dc.name == "oracle") {
            EXPECT_EQ(stats.spec.num_accepted_tokens, stats.spec.num_draft_tokens) << where;
            EXPECT_GT(stats.spec.mean_acceptance_length(), 2.0) << where;
          }
          if (dc.name == "always-wrong") EXPECT_EQ(stats.spec.num_accepted_tokens, 0u) << where;
          uint64_t generated = 0;
          for (const auto& c : got) generated += c.tokens.size();
          EXPECT_EQ(stats.generation_tokens_total, generated) << where;
        }
      }
    }
  }
}

// A KV pool for one full-length sequence and four requests with long drafts: steps run short of
// pages, drafts shrink instead of failing, and every output still equals plain decoding's.
TEST(SpeculativeSchedulerTest, ShortOfPagesDraftsShrinkAndOutputsStayExact) {
  auto engine = TinyEngine(16, 1, 128);
  std::vector<Req> reqs;
  for (int i = 0; i < 4; ++i) {
    Req r;
    r.prompt = i % 2 ? RepetitivePrompt(30 + 5 * i, i) : Prompt(25 + 6 * i, i);
    r.sampling.max_tokens = 50;
    r.sampling.ignore_eos = true;
    reqs.push_back(r);
  }
  const auto plain = RunScheduler(*engine, reqs, 4, nullptr, 0, nullptr);
  TruthTable truth;
  for (size_t i = 0; i < reqs.size(); ++i) truth.Add(reqs[i].prompt, plain[i].tokens);
  for (const auto& dc : Drafters(truth)) {
    SchedulerStats stats;
    const auto got = RunScheduler(*engine, reqs, 4, dc.drafter, 8, &stats);
    ExpectSameOutputs(plain, got, dc.name + " with a small KV pool");
    EXPECT_GT(stats.spec.num_drafts, 0u) << dc.name;
  }
}

}  // namespace
}  // namespace dl
