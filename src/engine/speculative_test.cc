// Speculative decoding on the CPU reference: whatever a drafter proposes (always right, always wrong,
// randomly corrupted, n-gram lookup, a DFlash drafter reading the model's hidden states), the output
// equals plain decoding token for token and logit for logit, alone (GenerateGreedy) and in a
// scheduler batch beside other sequences, greedy and sampled, with stops and max_tokens cutting
// inside an accepted run, at page sizes 16, 32 and 64.
#include <cmath>

#include <gtest/gtest.h>

#include "backend/cpu_ops.h"
#include "engine/dflash_drafter.h"
#include "engine/drafter.h"
#include "engine/engine.h"
#include "engine/scheduler.h"
#include "model/dflash.h"
#include "model/shapes.h"
#include "tests/common/scheduler_util.h"
#include "tests/common/temp_dir.h"

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

TEST(SpecOptionsTest, ParsesAndValidates) {
  EXPECT_EQ(*SpecOptions::ParseMethod("none"), SpecMethod::kNone);
  EXPECT_EQ(*SpecOptions::ParseMethod("ngram"), SpecMethod::kNgram);
  EXPECT_EQ(*SpecOptions::ParseMethod("dflash"), SpecMethod::kDflash);
  EXPECT_EQ(SpecOptions::ParseMethod("eagle").status().code(), StatusCode::kInvalidArgument);
  // dflash needs --spec-model, and --spec-model needs dflash.
  SpecOptions df;
  df.method = SpecMethod::kDflash;
  EXPECT_NE(df.Validate().message().find("--spec-model"), std::string::npos);
  df.model_dir = "/some/drafter";
  EXPECT_TRUE(df.Validate().ok());
  df.ngram_min = 3;  // an n-gram setting with the DFlash drafter is refused, not ignored
  EXPECT_NE(df.Validate().message().find("--spec-ngram-min"), std::string::npos);
  df.ngram_min = 2;
  df.method = SpecMethod::kNgram;
  EXPECT_NE(df.Validate().message().find("--spec dflash"), std::string::npos);
  df.method = SpecMethod::kNone;
  EXPECT_FALSE(df.Validate().ok());
  // The DFlash drafter needs the loaded model: MakeDrafter alone refuses it.
  df.method = SpecMethod::kDflash;
  EXPECT_FALSE(MakeDrafter(df).ok());
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

// Four requests of 50 tokens each (repetitive and random prompts alternating): more than a KV pool
// for one full-length sequence holds, so steps run short of pages.
std::vector<Req> ShortOfPagesRequests() {
  std::vector<Req> reqs;
  for (int i = 0; i < 4; ++i) {
    Req r;
    r.prompt = i % 2 ? RepetitivePrompt(30 + 5 * i, i) : Prompt(25 + 6 * i, i);
    r.sampling.max_tokens = 50;
    r.sampling.ignore_eos = true;
    reqs.push_back(r);
  }
  return reqs;
}

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
  const std::vector<Req> reqs = ShortOfPagesRequests();
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

// ---- DFlash ----

struct DflashDir : test_util::TempDir {
  DflashDir() : test_util::TempDir("dl_dflash_spec_test") {}
};

// A random DFlash drafter for the tiny shape (Poolside layout unless `zlab`), in `dir`.
std::string WriteTinyDrafter(const DflashDir& dir, const std::string& name, bool zlab, int64_t block = 8) {
  auto target = ShapeConfig("tiny");
  EXPECT_TRUE(target.ok());
  WriteDflashOptions o;
  o.config = DflashConfigFor(*target, 2, block, zlab ? DflashFamily::kZlab : DflashFamily::kLaguna);
  if (zlab) o.layout = DflashLayout::kZlab;
  o.seed = 5;
  o.out_dir = dir / name;
  EXPECT_TRUE(WriteSyntheticDflash(o).ok());
  return o.out_dir;
}

TEST(DflashDrafterTest, RefusesAMismatchedTargetAndTooLargeK) {
  DflashDir dir;
  const std::string path = WriteTinyDrafter(dir, "tiny", false);
  auto engine = TinyEngine(16, 1);
  ASSERT_NE(engine, nullptr);
  EXPECT_TRUE(DflashDrafter::Create(path, *engine->checkpoint, 7).ok());
  // With the CPU target's runner: the CPU backend has no drafter of its own, so the CPU reference
  // drafts, and the name says so without a note.
  auto on_backend = DflashDrafter::Create(path, *engine->checkpoint, 7, engine->runner.get());
  ASSERT_TRUE(on_backend.ok()) << on_backend.status().ToString();
  EXPECT_EQ((*on_backend)->where(), "cpu");
  EXPECT_EQ((*on_backend)->placement_note(), "");
  EXPECT_NE((*on_backend)->name().find(", on cpu]"), std::string::npos) << (*on_backend)->name();
  auto big_k = DflashDrafter::Create(path, *engine->checkpoint, 8);
  ASSERT_FALSE(big_k.ok());
  EXPECT_NE(big_k.status().message().find("block_size"), std::string::npos) << big_k.status().message();
  // A drafter for a target of another width.
  auto other = ShapeConfig("tiny");
  other->hidden_size = 32;
  WriteDflashOptions o;
  o.config = DflashConfigFor(*other, 1, 4);
  o.out_dir = dir / "narrow";
  ASSERT_TRUE(WriteSyntheticDflash(o).ok());
  auto narrow = DflashDrafter::Create(o.out_dir, *engine->checkpoint, 2);
  ASSERT_FALSE(narrow.ok());
  EXPECT_NE(narrow.status().message().find("hidden_size"), std::string::npos) << narrow.status().message();
}

// The tap after the last layer is the residual stream before the final norm (HF hidden_states[L],
// vLLM's aux layer L): final norm + LM head over it gives the forward's own logits, bit for bit.
TEST(DflashDrafterTest, TheLastLayerTapIsThePreNormResidual) {
  auto engine = TinyEngine(16, 1);
  ASSERT_NE(engine, nullptr);
  const ModelConfig& c = engine->config();
  const auto prompt = Prompt(11, 2);
  SequenceKv seq;
  ASSERT_TRUE(engine->kv->Reserve(seq, static_cast<int32_t>(prompt.size())).ok());
  ForwardBatch batch;
  batch.mode = ForwardMode::kPrefill;
  batch.AddSequence(seq, prompt);
  batch.hidden_taps = {1, static_cast<int32_t>(c.num_hidden_layers) - 1};
  batch.AddOutput(static_cast<int32_t>(prompt.size()) - 1).want_logits = true;
  ForwardResult r;
  ASSERT_TRUE(engine->runner->Forward(batch, &r).ok());
  ASSERT_TRUE(engine->kv->Release(seq).ok());
  ASSERT_EQ(r.hidden.size(), 2u);
  ASSERT_EQ(r.hidden[1].size(), prompt.size() * static_cast<size_t>(c.hidden_size));
  const int64_t d = c.hidden_size;
  std::vector<float> normed(static_cast<size_t>(d)), logits(static_cast<size_t>(c.vocab_size));
  const float* last = r.hidden[1].data() + (prompt.size() - 1) * static_cast<size_t>(d);
  const ModelWeights& w = engine->checkpoint->weights();
  cpu::RmsNorm(last, WeightRef(w.final_norm), d, static_cast<float>(c.rms_norm_eps), normed.data());
  cpu::MatVec(WeightRef(w.lm_head), normed.data(), logits.data());
  EXPECT_EQ(logits, r.rows[0].logits);
  EXPECT_NE(r.hidden[0], r.hidden[1]);
}

// The drafter's context cache is a function of the committed positions only: fed in one piece or in
// chunks, it drafts the same tokens; drafting is deterministic; a gap is an error, not a guess.
TEST(DflashDrafterTest, ContextCacheIsChunkingIndependentAndGapsAreErrors) {
  DflashDir dir;
  for (bool zlab : {false, true}) {
    const std::string path = WriteTinyDrafter(dir, zlab ? "zlab" : "poolside", zlab);
    auto engine = TinyEngine(16, 1);
    ASSERT_NE(engine, nullptr);
    auto drafter = DflashDrafter::Create(path, *engine->checkpoint, 7);
    ASSERT_TRUE(drafter.ok()) << drafter.status().message();
    const DflashDrafter& d = **drafter;
    const auto prompt = Prompt(20, 3);
    // One prefill of the prompt with the drafter's taps.
    SequenceKv seq;
    ASSERT_TRUE(engine->kv->Reserve(seq, static_cast<int32_t>(prompt.size())).ok());
    ForwardBatch batch;
    batch.mode = ForwardMode::kPrefill;
    batch.AddSequence(seq, prompt);
    batch.hidden_taps = d.hidden_taps();
    ForwardResult r;
    ASSERT_TRUE(engine->runner->Forward(batch, &r).ok());
    ASSERT_TRUE(engine->kv->Release(seq).ok());
    std::vector<int32_t> context(prompt.begin(), prompt.end());
    context.push_back(77);  // the anchor
    const uint64_t whole = d.NewSequence(), pieces = d.NewSequence();
    ASSERT_TRUE(d.Observe(whole, 0, r, 0, 20).ok());
    ASSERT_TRUE(d.Observe(pieces, 0, r, 0, 7).ok());
    // A gap: positions 8.. before 7 is there.
    Status gap = d.Observe(pieces, 8, r, 8, 3);
    EXPECT_EQ(gap.code(), StatusCode::kFailedPrecondition) << gap.message();
    ASSERT_TRUE(d.Observe(pieces, 7, r, 7, 13).ok());
    EXPECT_EQ(d.context_length(whole), 20);
    EXPECT_EQ(d.context_length(pieces), 20);
    auto a = d.ProposeFor(whole, context, 7);
    auto b = d.ProposeFor(pieces, context, 7);
    auto again = d.ProposeFor(whole, context, 7);
    ASSERT_TRUE(a.ok() && b.ok() && again.ok()) << a.status().message();
    ASSERT_EQ(a->size(), 7u);
    EXPECT_EQ(*a, *b);
    EXPECT_EQ(*a, *again);
    for (int32_t t : *a) EXPECT_TRUE(t >= 0 && t < kTinyVocab);
    // Every block runs all B rows, so fewer drafts are a prefix of more.
    auto three = d.ProposeFor(whole, context, 3);
    ASSERT_TRUE(three.ok());
    EXPECT_EQ(*three, std::vector<int32_t>(a->begin(), a->begin() + 3));
    // A context whose committed part is not what the drafter holds.
    context.push_back(5);
    EXPECT_EQ(d.ProposeFor(whole, context, 3).status().code(), StatusCode::kFailedPrecondition);
    d.Forget(whole);
    d.Forget(pieces);
    EXPECT_EQ(d.num_sequences(), 0u);
  }
}

// The drafter's block forward against a plain re-computation from the design (Poolside family: per-slice
// norms, fc, hidden_norm, input norm on the context, k_norm + RoPE at absolute positions, causal
// block with a sliding window, per-head softplus gate, SwiGLU, final norm, the target's LM head),
// written here with nothing shared but the matrix-vector product and RMSNorm. Drafts must agree
// wherever the reference's top-2 margin is clear of rounding.
TEST(DflashDrafterTest, BlockForwardMatchesAPlainReference) {
  DflashDir dir;
  auto target_cfg = ShapeConfig("tiny");
  ASSERT_TRUE(target_cfg.ok());
  WriteDflashOptions wo;
  wo.config = DflashConfigFor(*target_cfg, 1, 8);
  wo.config.sliding_window = 12;  // shorter than context + block: the window cuts both
  wo.seed = 9;
  wo.out_dir = dir / "ref";
  ASSERT_TRUE(WriteSyntheticDflash(wo).ok());
  auto engine = TinyEngine(16, 1);
  ASSERT_NE(engine, nullptr);
  auto created = DflashDrafter::Create(wo.out_dir, *engine->checkpoint, 7);
  ASSERT_TRUE(created.ok()) << created.status().message();
  const DflashDrafter& drafter = **created;
  auto ck = DflashCheckpoint::Open(wo.out_dir);
  ASSERT_TRUE(ck.ok());
  const DflashConfig& c = ck->config();
  const DflashWeights& w = ck->weights();
  const DflashLayerWeights& L = w.layers[0];
  const ModelWeights& tw = engine->checkpoint->weights();
  const int64_t d = c.hidden_size, H = c.num_attention_heads, K = c.num_key_value_heads, D = c.head_dim;
  const int64_t B = c.block_size, W = c.sliding_window, n_taps = c.num_taps();
  const float eps = static_cast<float>(c.rms_norm_eps);
  auto mv = [](const TensorView& m, const std::vector<float>& x) {
    std::vector<float> y(static_cast<size_t>(m.shape[0]));
    cpu::MatVec(WeightRef(m), x.data(), y.data());
    return y;
  };
  auto norm = [&](std::vector<float> x, const TensorView& wt, int64_t off, int64_t n) {
    cpu::RmsNorm(x.data() + off, WeightRef(wt), n, eps, x.data() + off);
    return x;
  };
  auto rope = [&](float* x, int64_t pos) {
    const int64_t half = D / 2;  // full rotary
    for (int64_t j = 0; j < half; ++j) {
      const double inv = 1.0 / std::pow(c.rope_theta, static_cast<double>(2 * j) / static_cast<double>(D));
      const float a = static_cast<float>(pos) * static_cast<float>(inv);
      const float x0 = x[j], x1 = x[j + half];
      x[j] = x0 * std::cos(a) - x1 * std::sin(a);
      x[j + half] = x1 * std::cos(a) + x0 * std::sin(a);
    }
  };
  // Taps of a 15-token prompt from the target.
  const auto prompt = Prompt(15, 6);
  SequenceKv seq;
  ASSERT_TRUE(engine->kv->Reserve(seq, 15).ok());
  ForwardBatch batch;
  batch.mode = ForwardMode::kPrefill;
  batch.AddSequence(seq, prompt);
  batch.hidden_taps = drafter.hidden_taps();
  ForwardResult r;
  ASSERT_TRUE(engine->runner->Forward(batch, &r).ok());
  ASSERT_TRUE(engine->kv->Release(seq).ok());
  // Reference context K/V.
  std::vector<std::vector<float>> ck_k, ck_v;
  for (int64_t p = 0; p < 15; ++p) {
    std::vector<float> cat;
    for (int64_t t = 0; t < n_taps; ++t) {
      const float* h = r.hidden[static_cast<size_t>(t)].data() + p * d;
      std::vector<float> slice(h, h + d);
      slice = norm(slice, w.aux_norms[static_cast<size_t>(t)], 0, d);
      cat.insert(cat.end(), slice.begin(), slice.end());
    }
    std::vector<float> ctx = norm(mv(w.fc, cat), w.hidden_norm, 0, d);
    std::vector<float> x = norm(ctx, L.input_norm, 0, d);
    std::vector<float> k = mv(L.k, x), v = mv(L.v, x);
    for (int64_t kh = 0; kh < K; ++kh) {
      k = norm(k, L.k_norm, kh * D, D);
      rope(k.data() + kh * D, p);
    }
    ck_k.push_back(k);
    ck_v.push_back(v);
  }
  // Reference block at s = 15, anchor 99.
  const int64_t s = 15;
  std::vector<std::vector<float>> h(static_cast<size_t>(B)), q(h.size()), bk(h.size()), bv(h.size()), g(h.size());
  for (int64_t j = 0; j < B; ++j) {
    const int64_t tok = j == 0 ? 99 : c.mask_token_id;
    h[j].resize(static_cast<size_t>(d));
    for (int64_t e = 0; e < d; ++e) h[j][e] = tw.embed.at(tok * d + e);
    std::vector<float> x = norm(h[j], L.input_norm, 0, d);
    q[j] = mv(L.q, x), bk[j] = mv(L.k, x), bv[j] = mv(L.v, x), g[j] = mv(L.g, x);
    for (int64_t hh = 0; hh < H; ++hh) {
      q[j] = norm(q[j], L.q_norm, hh * D, D);
      rope(q[j].data() + hh * D, s + j);
    }
    for (int64_t kh = 0; kh < K; ++kh) {
      bk[j] = norm(bk[j], L.k_norm, kh * D, D);
      rope(bk[j].data() + kh * D, s + j);
    }
  }
  std::vector<int32_t> want;
  std::vector<float> margins;
  for (int64_t j = 0; j < B; ++j) {
    std::vector<float> attn(static_cast<size_t>(H * D), 0.0f);
    const int64_t qpos = s + j;
    for (int64_t hh = 0; hh < H; ++hh) {
      const int64_t kh = hh / (H / K);
      std::vector<std::pair<const float*, const float*>> kv;  // visible keys and values
      for (int64_t p = 0; p < s; ++p) {
        if (qpos - p < W) kv.emplace_back(ck_k[p].data() + kh * D, ck_v[p].data() + kh * D);
      }
      for (int64_t i = 0; i <= j; ++i) {
        if (j - i < W) kv.emplace_back(bk[i].data() + kh * D, bv[i].data() + kh * D);
      }
      std::vector<double> sc;
      double mx = -1e300, den = 0;
      for (auto& [kk, vv] : kv) {
        double dot = 0;
        for (int64_t e = 0; e < D; ++e) dot += static_cast<double>(q[j][hh * D + e]) * kk[e];
        sc.push_back(dot / std::sqrt(static_cast<double>(D)));
        mx = std::max(mx, sc.back());
      }
      for (double& x : sc) den += (x = std::exp(x - mx));
      const double gate = std::log1p(std::exp(static_cast<double>(g[j][hh])));
      for (size_t i = 0; i < kv.size(); ++i) {
        for (int64_t e = 0; e < D; ++e) attn[hh * D + e] += static_cast<float>(sc[i] / den * kv[i].second[e] * gate);
      }
    }
    std::vector<float> o = mv(L.o, attn);
    for (int64_t e = 0; e < d; ++e) h[j][e] += o[e];
    std::vector<float> x2 = norm(h[j], L.post_attn_norm, 0, d);
    std::vector<float> ga = mv(L.gate, x2), up = mv(L.up, x2);
    for (size_t e = 0; e < ga.size(); ++e) ga[e] = ga[e] / (1.0f + std::exp(-ga[e])) * up[e];
    std::vector<float> dn = mv(L.down, ga);
    for (int64_t e = 0; e < d; ++e) h[j][e] += dn[e];
    if (j == 0) continue;  // the anchor row predicts nothing
    std::vector<float> logits = mv(tw.lm_head, norm(h[j], w.norm, 0, d));
    auto [tok, margin] = ArgmaxWithMargin(logits);
    want.push_back(tok);
    margins.push_back(margin);
  }
  std::vector<int32_t> context(prompt.begin(), prompt.end());
  context.push_back(99);
  const uint64_t id = drafter.NewSequence();
  ASSERT_TRUE(drafter.Observe(id, 0, r, 0, 15).ok());
  auto got = drafter.ProposeFor(id, context, 7);
  drafter.Forget(id);
  ASSERT_TRUE(got.ok()) << got.status().message();
  ASSERT_EQ(got->size(), want.size());
  int compared = 0;
  for (size_t j = 0; j < want.size(); ++j) {
    if (margins[j] < 1e-3f) continue;
    EXPECT_EQ((*got)[j], want[j]) << "block row " << j + 1 << " (margin " << margins[j] << ")";
    ++compared;
  }
  EXPECT_GE(compared, 5);
}

TEST(SpeculativeDflashTest, GenerateEqualsPlainGreedyTokenForTokenAndLogitForLogit) {
  DflashDir dir;
  for (bool zlab : {false, true}) {
    const std::string path = WriteTinyDrafter(dir, zlab ? "zlab" : "poolside", zlab);
    for (int32_t page : {16, 32}) {
      auto engine = TinyEngine(page, 1);
      ASSERT_NE(engine, nullptr);
      auto drafter = DflashDrafter::Create(path, *engine->checkpoint, 7);
      ASSERT_TRUE(drafter.ok()) << drafter.status().message();
      for (const auto& prompt : {Prompt(21, 1), RepetitivePrompt(40, 2)}) {
        GenerateOptions g;
        g.max_tokens = 23;
        g.ignore_eos = true;
        g.prefill_chunk = 16;
        g.keep_step_logits = true;
        auto plain = GenerateGreedy(*engine, prompt, g);
        ASSERT_TRUE(plain.ok()) << plain.status().message();
        for (int32_t k : {1, 4, 7}) {
          GenerateOptions sg = g;
          sg.drafter = drafter->get();
          sg.num_draft_tokens = k;
          auto spec = GenerateGreedy(*engine, prompt, sg);
          ASSERT_TRUE(spec.ok()) << spec.status().message();
          const std::string where = std::string(zlab ? "zlab" : "poolside") + ", k " + std::to_string(k) +
                                    ", page " + std::to_string(page);
          EXPECT_EQ(spec->tokens, plain->tokens) << where;
          EXPECT_EQ(spec->step_logits, plain->step_logits) << where;
          EXPECT_GT(spec->spec.num_drafts, 0u) << where;
          EXPECT_LE(spec->spec.num_draft_tokens, spec->spec.num_drafts * static_cast<uint64_t>(k)) << where;
        }
        EXPECT_EQ(UsedPages(*engine), 0);
      }
      EXPECT_EQ((*drafter)->num_sequences(), 0u) << "GenerateGreedy forgets its drafter state";
    }
  }
}

TEST(SpeculativeDflashTest, EqualsPlainDecodingInASchedulerBatch) {
  DflashDir dir;
  const std::string path = WriteTinyDrafter(dir, "poolside", false);
  for (int32_t page : {16, 32}) {
    auto engine = TinyEngine(page, 4);
    ASSERT_NE(engine, nullptr);
    const auto first = RunScheduler(*engine, MixedRequests(nullptr), 4, nullptr, 0, nullptr);
    const auto reqs = MixedRequests(&first);
    const auto plain = RunScheduler(*engine, reqs, 4, nullptr, 0, nullptr);
    for (int32_t k : {3, 7}) {
      auto drafter = DflashDrafter::Create(path, *engine->checkpoint, k);
      ASSERT_TRUE(drafter.ok()) << drafter.status().message();
      for (int32_t max_batch : {1, 4}) {
        SchedulerStats stats;
        const auto got = RunScheduler(*engine, reqs, max_batch, *drafter, k, &stats);
        const std::string where =
            "dflash, k " + std::to_string(k) + ", batch " + std::to_string(max_batch) + ", page " + std::to_string(page);
        ExpectSameOutputs(plain, got, where);
        EXPECT_GT(stats.spec.num_drafts, 0u) << where;
        EXPECT_FALSE(stats.spec.accepted_per_pos.empty()) << where;
        uint64_t generated = 0;
        for (const auto& c : got) generated += c.tokens.size();
        EXPECT_EQ(stats.generation_tokens_total, generated) << where;
        EXPECT_EQ((*drafter)->num_sequences(), 0u) << where << ": finished sequences leave no drafter state";
      }
    }
  }
}

// Preemption drops a sequence's drafter state; its recomputation feeds the drafter again from
// position 0, and outputs stay exact.
TEST(SpeculativeDflashTest, ShortOfPagesPreemptionRestartsTheDrafterState) {
  DflashDir dir;
  const std::string path = WriteTinyDrafter(dir, "poolside", false);
  auto engine = TinyEngine(16, 1, 128);
  ASSERT_NE(engine, nullptr);
  const std::vector<Req> reqs = ShortOfPagesRequests();
  const auto plain = RunScheduler(*engine, reqs, 4, nullptr, 0, nullptr);
  auto drafter = DflashDrafter::Create(path, *engine->checkpoint, 7);
  ASSERT_TRUE(drafter.ok());
  SchedulerStats stats;
  const auto got = RunScheduler(*engine, reqs, 4, *drafter, 7, &stats);
  ExpectSameOutputs(plain, got, "dflash with a small KV pool");
  EXPECT_GT(stats.spec.num_drafts, 0u);
  EXPECT_GT(stats.preemptions_total, 0u) << "the pool holds one sequence: four must preempt";
  EXPECT_EQ((*drafter)->num_sequences(), 0u);
}

TEST(SpeculativeDflashTest, PrefixCachingIsRefused) {
  DflashDir dir;
  const std::string path = WriteTinyDrafter(dir, "poolside", false);
  auto engine = TinyEngine(16, 2);
  ASSERT_NE(engine, nullptr);
  auto drafter = DflashDrafter::Create(path, *engine->checkpoint, 3);
  ASSERT_TRUE(drafter.ok());
  SchedulerOptions so;
  so.max_batch = 2;
  so.enable_prefix_caching = true;
  so.drafter = *drafter;
  so.num_draft_tokens = 3;
  Scheduler sched(*engine, so);
  sched.Start();
  GenerationRequest r;
  r.prompt = Prompt(20, 1);
  r.sampling.max_tokens = 4;
  auto st = sched.Submit(r);
  sched.Stop();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(st.status().message().find("prefix caching"), std::string::npos);
}

}  // namespace
}  // namespace dl
