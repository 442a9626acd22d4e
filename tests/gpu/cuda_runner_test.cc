// The CUDA backend end to end: against transformers' BF16 goldens (teacher-forced), bit-identical
// repeats, identical tokens across KV page sizes, prefill chunkings and graph vs eager launches, and
// the no-silent-fallback rule. Every test skips with the reason where no GPU is usable (CI).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cuda/device.h"
#include "engine/dflash_drafter.h"
#include "engine/drafter.h"
#include "engine/engine.h"
#include "engine/scheduler.h"
#include "backend/cuda_runner.h"
#include "backend/cuda_weights.h"
#include "model/dflash.h"
#include "model/shapes.h"
#include "model/synthetic.h"
#include "tests/common/batch_schedule.h"
#include "tests/common/golden_data.h"
#include "tests/common/scheduler_util.h"
#include "tests/common/small_xs2.h"
#include "tests/common/temp_dir.h"
#include "tests/gpu/gpu_skip.h"

namespace dl {
namespace {

using namespace testing_golden;

std::unique_ptr<Engine> LoadDir(const fs::path& dir, DType kv, int32_t page, bool allow_fallback) {
  return LoadGoldenModel(dir, BackendKind::kCuda, kv, page, allow_fallback);
}

// Greedy decoding of a golden prompt teacher-forced along the golden's tokens.
Result<GenerateResult> TeacherForced(Engine& engine, const GoldenPrompt& gp) {
  GenerateOptions g;
  g.max_tokens = static_cast<int32_t>(gp.tokens.size());
  g.ignore_eos = true;
  g.forced_tokens = gp.tokens;
  return GenerateGreedy(engine, gp.prompt, g);
}

// The prompts as one mixed greedy/sampled batch (MixedSamplingRequests, 20 tokens each) through a
// scheduler (prefill chunks of 64, 128 rows per step) whose drafter proposes k tokens (nullptr, 0:
// plain decoding): (token, logprob) of every event, per request.
std::vector<std::vector<std::pair<int32_t, float>>> RunMixedBatch(Engine& engine,
                                                                   const std::vector<std::vector<int32_t>>& prompts,
                                                                   int32_t batch, std::shared_ptr<const Drafter> drafter,
                                                                   int32_t k) {
  SchedulerOptions so;
  so.max_batch = batch;
  so.prefill_chunk = 64;
  so.max_tokens_per_step = 128;
  so.drafter = std::move(drafter);
  so.num_draft_tokens = k;
  Scheduler sched(engine, so);
  sched.Start();
  auto out = testing_scheduler::SubmitAndDrainLogprobs(
      sched, testing_scheduler::MixedSamplingRequests(prompts, testing_scheduler::AllIndices(prompts.size()), 20));
  sched.Stop();
  return out;
}

// Teacher forcing along transformers' BF16 greedy tokens. tiny has presets; the other two configs' head
// groups are not in the default preset set, so they run the generic kernel, which must then be reported
// as a fallback.
//
// The strict form (every step with a golden top-2 margin >= 3e-2 equal, logits within 2e-2) is
// checked on tiny_fixed_routing (next test); on these three configs this test asserts a looser bound
// on purpose, for a measured reason: these tiny random
// models route each token to 3-4 of 6-16 experts with near-ties (the goldens record router gaps down to
// 1e-4 between the k-th and (k+1)-th biased score), and the reference's eager path rounds attention
// scores/probabilities to BF16 and accumulates experts in a BF16 buffer, where our kernels keep FP32. A
// BF16-level difference then flips an expert, which moves logits by more than the margin. On one H200
// (2026-11-30): 41-48 of 45-48 checked steps agree per prompt, mismatches start at steps whose golden
// router gap is < 6e-3, and last-position logits are within 1.1e-2..4.6e-2 (transformers' own BF16 run
// is 1.5e-2..1.2e-1 from its FP32 run). Bound: >= 80 % of checked steps, >= 20 checked, logits < 6e-2.
// In 7 of the 9 golden prompts a router gap below 1e-3 occurs already at step 0 (the prompt's own
// routing), so no "stop at the first near-tie" rule would leave steps to check: a strict check needs
// goldens from models and prompts without near-ties.
TEST(CudaRunnerTest, TeacherForcedAgainstTransformersBf16) {
  SKIP_WITHOUT_GPU();
  for (const std::string name : {"tiny", "tiny_softcap", "tiny_elem"}) {
    SCOPED_TRACE(name);
    const bool presets_built = name == "tiny";
    auto engine = LoadDir(GoldenDir(name), DType::kBF16, 16, /*allow_fallback=*/!presets_built);
    ASSERT_TRUE(engine);
    EXPECT_EQ(engine->runner->Describe()["fallback"].get<bool>(), !presets_built);
    for (const GoldenPrompt& gp : LoadGoldens(GoldenDir(name) / "goldens_bf16.json")) {
      const auto& prompt = gp.prompt;
      const auto& tokens = gp.tokens;
      const auto& margins = gp.margins;
      const auto& gaps = gp.router_gaps;
      auto r = TeacherForced(*engine, gp);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      int checked = 0, agreed = 0;
      std::string mismatches;
      for (size_t s = 0; s < tokens.size(); ++s) {
        if (margins[s] < 3e-2) continue;
        ++checked;
        if (r->tokens[s] == tokens[s]) {
          ++agreed;
        } else {
          mismatches += fmt::format(" step {} (margin {:.3g}, router gap {:.2g})", s, margins[s], gaps[s]);
        }
      }
      EXPECT_GE(checked, 20);
      EXPECT_GE(agreed * 5, checked * 4) << "mismatches:" << mismatches;
      const double rel = RelL2(r->last_prompt_logits, gp.last_logits);
      EXPECT_LT(rel, 6e-2);
      std::printf("[bf16-golden] %s prompt_len=%zu checked=%d agreed=%d logits_rel_l2=%.3g%s%s\n",
                  name.c_str(), prompt.size(), checked, agreed, rel,
                  mismatches.empty() ? "" : " mismatches:", mismatches.c_str());
    }
  }
}

// The strict form, on the configuration whose routing has no near-ties by construction
// (tools/reference/make_goldens.py, tiny_fixed_routing: correction biases put the top-k experts more
// than the sigmoid range above the rest), teacher-forced along transformers' BF16 greedy tokens. Two
// refinements, both measured on one H200 (2026-11-30, docs/performance.md "Exactness"):
// - The golden margins are differences of BF16 logits, and these models' top logits lie in [8, 16),
//   where BF16 values are 1/16 apart: a margin of 1/16 is one rounding step, a tie at the reference's
//   own resolution. Every step with a margin >= 3e-2 AND above 1/16 must give the golden token (at
//   least 20 per prompt); the one-step margins are counted and printed (3 of 9 disagreed there).
// - Last prompt position logits within 2e-2 relative L2 of the BF16 golden, or, where the reference's
//   BF16 run is itself farther than that from its FP32 run, within that distance (prompt 0: the
//   reference's BF16 is 2.5e-2 from FP32, ours 2.2e-2 from the reference).
TEST(CudaRunnerTest, TeacherForcedStrictWithoutRoutingNearTies) {
  SKIP_WITHOUT_GPU();
  const fs::path dir = GoldenDir("tiny_fixed_routing");
  ASSERT_TRUE(fs::exists(dir / "goldens_bf16.json")) << dir;
  auto engine = LoadDir(dir, DType::kBF16, 16, /*allow_fallback=*/false);
  ASSERT_TRUE(engine);
  const auto bf16 = LoadGoldens(dir / "goldens_bf16.json");
  const auto fp32 = LoadGoldens(dir / "goldens_fp32.json");
  ASSERT_EQ(bf16.size(), fp32.size());
  constexpr double kOneBf16Step = 1.0 / 16;  // spacing of BF16 values in [8, 16)
  for (size_t pi = 0; pi < bf16.size(); ++pi) {
    const GoldenPrompt& gp = bf16[pi];
    ASSERT_EQ(gp.prompt, fp32[pi].prompt);
    for (size_t s = 0; s < gp.router_gaps.size(); ++s) {
      ASSERT_GT(gp.router_gaps[s], 0.5) << "the premise: no routing near-tie (step " << s << ")";
    }
    double top = 0;
    for (float v : gp.last_logits) top = std::max(top, static_cast<double>(v));
    ASSERT_GE(top, 8.0) << "the premise: top logits in [8, 16)";
    ASSERT_LT(top, 16.0) << "the premise: top logits in [8, 16)";
    auto r = TeacherForced(*engine, gp);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    int checked = 0, one_step = 0, one_step_agreed = 0;
    for (size_t s = 0; s < gp.tokens.size(); ++s) {
      if (gp.margins[s] < 3e-2) continue;
      if (gp.margins[s] <= kOneBf16Step) {
        ++one_step;
        one_step_agreed += r->tokens[s] == gp.tokens[s];
        continue;
      }
      ++checked;
      EXPECT_EQ(r->tokens[s], gp.tokens[s]) << "step " << s << " margin " << gp.margins[s];
    }
    EXPECT_GE(checked, 20);
    const double rel = RelL2(r->last_prompt_logits, gp.last_logits);
    const double ours_vs_fp32 = RelL2(r->last_prompt_logits, fp32[pi].last_logits);
    const double reference_bf16_vs_fp32 = RelL2(gp.last_logits, fp32[pi].last_logits);
    EXPECT_LT(rel, std::max(2e-2, reference_bf16_vs_fp32));
    std::printf("[bf16-golden-strict] tiny_fixed_routing prompt_len=%zu checked=%d (all equal: %s) one-step "
                "margins %d/%d equal; logits rel L2 %.3g to the BF16 golden, %.3g to the FP32 golden (the "
                "reference's BF16 run: %.3g)\n",
                gp.prompt.size(), checked, testing::Test::HasFailure() ? "NO" : "yes", one_step_agreed, one_step,
                rel, ours_vs_fp32, reference_bf16_vs_fp32);
  }
}

// FP8 weights (tiny_fp8: every linear layer FP8, transformers' FP8 path dequantised in FP32, issue 18)
// on the GPU, teacher-forced along the FP32 goldens: prompt rows on the tensor-core product's FP8 rule
// (ops.h 5d, the default) and on the CUDA-core FP8 rule (prompt_fp8_mma=0). This model routes with
// near-ties like tiny (TeacherForcedAgainstTransformersBf16 says why), so the same bounds: >= 80 % of
// the steps with a golden margin >= 3e-2 equal, last prompt logits within 6e-2 relative L2.
TEST(CudaRunnerTest, TeacherForcedAgainstTransformersFp8) {
  SKIP_WITHOUT_GPU();
  const fs::path dir = GoldenDir("tiny_fp8");
  ASSERT_TRUE(fs::exists(dir / "goldens_fp32.json")) << dir;
  const auto goldens = LoadGoldens(dir / "goldens_fp32.json");
  for (bool fp8_mma : {true, false}) {
    kernels::Tuning tu;
    tu.prompt_fp8_mma = fp8_mma;
    auto engine = LoadGoldenModel(dir, BackendKind::kCuda, DType::kBF16, 16, /*allow_fallback=*/false, tu);
    ASSERT_TRUE(engine);
    for (const GoldenPrompt& gp : goldens) {
      auto r = TeacherForced(*engine, gp);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      int checked = 0, agreed = 0;
      for (size_t s = 0; s < gp.tokens.size(); ++s) {
        if (gp.margins[s] < 3e-2) continue;
        ++checked;
        agreed += r->tokens[s] == gp.tokens[s];
      }
      EXPECT_GE(checked, 20);
      EXPECT_GE(agreed * 5, checked * 4) << "prompt_fp8_mma=" << fp8_mma;
      const double rel = RelL2(r->last_prompt_logits, gp.last_logits);
      EXPECT_LT(rel, 6e-2) << "prompt_fp8_mma=" << fp8_mma;
      std::printf("[fp8-golden] tiny_fp8 prompt_fp8_mma=%d prompt_len=%zu checked=%d agreed=%d logits_rel_l2=%.3g\n",
                  fp8_mma ? 1 : 0, gp.prompt.size(), checked, agreed, rel);
    }
  }
}

TEST(CudaRunnerTest, MissingPresetIsAnErrorNamingTheKey) {
  SKIP_WITHOUT_GPU();
  EngineOptions o;
  o.model_dir = GoldenDir("tiny_elem").string();
  o.backend = BackendKind::kCuda;
  o.kv_dtype = DType::kBF16;
  auto e = LoadEngine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("attn_d32_g1_p16_bf16"), std::string::npos)
      << e.status().message();
}

using test_util::SmallXs2Geometry;

struct Transcript {
  std::vector<int32_t> tokens;
  std::vector<float> last_logits;   // the last prompt row's
  std::vector<float> final_logits;  // the last generated row's
};

// A KV cache for `sequences` sequences of up to 1,024 tokens (every page of both groups), and fixed
// FP8 scales, for the runners these tests build by hand around a synthetic checkpoint.
KvCacheSpec TestKvSpec(const ModelConfig& c, DType kv, int32_t page, int32_t sequences) {
  KvCacheSpec spec;
  spec.num_layers = static_cast<int32_t>(c.num_hidden_layers);
  spec.num_kv_heads = static_cast<int32_t>(c.num_key_value_heads);
  spec.head_dim = static_cast<int32_t>(c.head_dim);
  spec.page_size = page;
  spec.dtype = kv;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    spec.layer_groups.push_back(c.is_sliding(l) ? KvGroup::kSliding : KvGroup::kFull);
  }
  spec.sliding_window = static_cast<int32_t>(c.sliding_window);
  spec.pages_full = PagesNeededFull(1024, page) * sequences;
  spec.pages_sliding = spec.pages_full;
  return spec;
}
KvScales TestKvScales(int32_t layers) {
  KvScales scales = KvScales::Unit(layers);
  for (auto& s : scales.k) s = 0.05f;
  for (auto& s : scales.v) s = 0.02f;
  return scales;
}

// An engine over a synthetic BF16 checkpoint of `cfg` (seed 17: the same weights every call), a
// cache of `kv` in 32-token pages for `sequences` sequences, and a CUDA runner built with `co`
// (max_seq_len 1024, as the engine's).
Result<std::unique_ptr<Engine>> SyntheticCudaEngine(const ModelConfig& cfg, DType kv, int32_t sequences,
                                                    CudaRunnerOptions co) {
  auto engine = std::make_unique<Engine>();
  DL_ASSIGN_OR_RETURN(Checkpoint ck, MakeSyntheticCheckpoint(cfg, 17, DType::kBF16));
  engine->checkpoint = std::make_unique<Checkpoint>(std::move(ck));
  const KvCacheSpec spec = TestKvSpec(engine->checkpoint->config(), kv, 32, sequences);
  DL_ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(spec));
  engine->kv = std::make_unique<KvCache>(std::move(cache));
  co.max_seq_len = 1024;
  DL_ASSIGN_OR_RETURN(engine->runner, CudaRunner::Create(*engine->checkpoint, spec, TestKvScales(spec.num_layers), co));
  engine->options.max_seq_len = 1024;
  return engine;
}

// Prefill `prompt` in chunks of `chunk` rows, then `steps` greedy decode rows. recompute_after > 0:
// after that many decode steps the sequence's cache is dropped and recomputed from the prompt and
// the tokens generated so far, as the scheduler does after a preemption (the generated tokens stay
// generated rows: BatchSequence::prompt_length is the prompt's), and decoding goes on.
Transcript Generate(const Checkpoint& ck, DType kv, int32_t page, int32_t chunk, bool graph,
                    const std::vector<int32_t>& prompt, int32_t steps, const kernels::Tuning& tuning = {},
                    int32_t recompute_after = 0) {
  const KvCacheSpec spec = TestKvSpec(ck.config(), kv, page, 1);
  auto kvc = KvCache::Create(spec);
  EXPECT_TRUE(kvc.ok());
  const KvScales scales = TestKvScales(spec.num_layers);
  CudaRunnerOptions co;
  co.max_seq_len = 1024;
  co.max_rows = 512;
  co.max_outputs = 1;
  co.use_graph = graph;
  co.tuning = tuning;
  auto runner = CudaRunner::Create(ck, spec, scales, co);
  EXPECT_TRUE(runner.ok()) << runner.status().ToString();
  Transcript run;
  if (!runner.ok()) return run;
  SequenceKv seq;
  std::vector<float> logits;
  int32_t token = -1;
  auto forward = [&](std::span<const int32_t> t, bool output) {
    EXPECT_TRUE(kvc->Reserve(seq, static_cast<int32_t>(t.size())).ok());
    ForwardBatch b;
    b.AddSequence(seq, t, static_cast<int32_t>(prompt.size()));
    if (output) b.AddOutput(static_cast<int32_t>(t.size()) - 1).want_logits = true;
    ForwardResult r;
    Status st = (*runner)->Forward(b, &r);
    EXPECT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(kvc->Commit(seq, static_cast<int32_t>(t.size())).ok());
    if (output && st.ok()) {
      logits = r.rows[0].logits;
      token = r.rows[0].token;
    }
  };
  for (size_t i = 0; i < prompt.size(); i += chunk) {
    const size_t n = std::min<size_t>(chunk, prompt.size() - i);
    forward(std::span<const int32_t>(prompt).subspan(i, n), i + n == prompt.size());
  }
  run.last_logits = logits;
  for (int32_t s = 0; s < steps; ++s) {
    const int32_t tok = ArgmaxWithMargin(logits).first;
    EXPECT_EQ(token, tok) << "the device's greedy token is the argmax of the logits it returns";
    run.tokens.push_back(tok);
    if (recompute_after > 0 && s + 1 == recompute_after) {
      EXPECT_TRUE(kvc->Release(seq).ok());
      seq = SequenceKv{};
      std::vector<int32_t> context = prompt;
      context.insert(context.end(), run.tokens.begin(), run.tokens.end());
      for (size_t i = 0; i < context.size(); i += chunk) {
        const size_t n = std::min<size_t>(chunk, context.size() - i);
        forward(std::span<const int32_t>(context).subspan(i, n), i + n == context.size());
      }
      continue;
    }
    forward(std::span<const int32_t>(&tok, 1), true);
  }
  run.final_logits = logits;
  return run;
}

std::vector<int32_t> LongPrompt(int n, int64_t vocab) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = static_cast<int32_t>((i * 7919 + 13) % vocab);
  return p;
}

TEST(CudaRunnerTest, BitIdenticalOverRepeats) {
  SKIP_WITHOUT_GPU();
  auto ck = MakeSyntheticCheckpoint(SmallXs2Geometry(), 7, DType::kBF16);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const auto prompt = LongPrompt(600, ck->config().vocab_size);  // longer than the 512 window
  const Transcript first = Generate(*ck, DType::kF8E4M3, 32, 512, true, prompt, 24);
  for (int rep = 0; rep < 9; ++rep) {
    const Transcript again = Generate(*ck, DType::kF8E4M3, 32, 512, true, prompt, 24);
    ASSERT_EQ(again.tokens, first.tokens) << "repeat " << rep;
    ASSERT_EQ(0, std::memcmp(again.last_logits.data(), first.last_logits.data(),
                             first.last_logits.size() * 4))
        << "repeat " << rep;
  }
}

TEST(CudaRunnerTest, TokensIdenticalAcrossPageSizesChunksAndGraphs) {
  SKIP_WITHOUT_GPU();
  auto ck = MakeSyntheticCheckpoint(SmallXs2Geometry(), 11, DType::kBF16);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const auto prompt = LongPrompt(700, ck->config().vocab_size);
  for (DType kv : {DType::kBF16, DType::kF8E4M3}) {
    const Transcript reference = Generate(*ck, kv, 64, 512, true, prompt, 32);
    for (int32_t page : {16, 32, 64}) {
      for (int32_t chunk : {512, 100, 37}) {
        for (bool graph : {true, false}) {
          if (page == 64 && chunk == 512 && graph) continue;
          const Transcript r = Generate(*ck, kv, page, chunk, graph, prompt, 32);
          EXPECT_EQ(r.tokens, reference.tokens)
              << DTypeName(kv) << " page " << page << " chunk " << chunk << " graph " << graph;
          EXPECT_EQ(0, std::memcmp(r.last_logits.data(), reference.last_logits.data(),
                                   reference.last_logits.size() * 4))
              << DTypeName(kv) << " page " << page << " chunk " << chunk << " graph " << graph;
        }
      }
    }
  }
}

// The batch-shaped engine's promise on the GPU, with XS.2's attention geometry (D 128, 48/64 heads, the
// 512 window, which prompts up to 700 tokens wrap): every sequence's tokens and the logits of every
// row that produced one (greedy and seeded top-k/top-p sampling) are bit-identical alone and under
// random schedules of arrivals, subsets, prefill chunk sizes and batch buckets (padding rows
// included), with FP8 and BF16 caches and with graphs or eager launches.
void CheckBatchInvariantUnderRandomSchedules(const kernels::Tuning& tuning) {
  auto ck = MakeSyntheticCheckpoint(SmallXs2Geometry(), 13, DType::kBF16);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  std::vector<std::vector<int32_t>> prompts;
  for (int n : {5, 130, 700, 37, 513, 64, 260}) {
    std::vector<int32_t> p = LongPrompt(n, ck->config().vocab_size);
    for (auto& t : p) t = (t + n) % static_cast<int32_t>(ck->config().vocab_size);
    prompts.push_back(p);
  }
  const int32_t steps = 12;
  for (DType kv : {DType::kF8E4M3, DType::kBF16}) {
    for (bool graph : {true, false}) {
      SCOPED_TRACE(testing::Message() << DTypeName(kv) << (graph ? " graphs" : " eager"));
      auto engine = std::make_unique<Engine>();
      // The engine by hand around the synthetic checkpoint (LoadEngine builds from a shape or a directory).
      const KvCacheSpec spec = TestKvSpec(ck->config(), kv, 32, static_cast<int32_t>(prompts.size()));
      auto kvc = KvCache::Create(spec);
      ASSERT_TRUE(kvc.ok());
      engine->kv = std::make_unique<KvCache>(std::move(*kvc));
      const KvScales scales = TestKvScales(spec.num_layers);
      CudaRunnerOptions co;
      co.max_seq_len = 1024;
      co.max_rows = 96;
      co.max_outputs = static_cast<int32_t>(prompts.size());
      co.use_graph = graph;
      co.tuning = tuning;
      auto runner = CudaRunner::Create(*ck, spec, scales, co);
      ASSERT_TRUE(runner.ok()) << runner.status().ToString();
      engine->runner = std::move(*runner);
      std::vector<testing_batch::SeqTrace> alone;
      for (size_t i = 0; i < prompts.size(); ++i) {
        auto a = testing_batch::RunAlone(*engine, prompts[i], i, steps, 64);
        ASSERT_TRUE(a.ok()) << a.status().ToString();
        alone.push_back(std::move(*a));
      }
      for (uint64_t seed : {1u, 2u}) {
        auto together = testing_batch::RunRandomSchedule(*engine, prompts, steps, seed, 96);
        ASSERT_TRUE(together.ok()) << together.status().ToString();
        for (size_t i = 0; i < prompts.size(); ++i) {
          EXPECT_EQ(testing_batch::Compare(alone[i], (*together)[i]), "") << "sequence " << i << ", seed " << seed;
        }
      }
      EXPECT_EQ(engine->kv->used_pages(KvGroup::kFull) + engine->kv->used_pages(KvGroup::kSliding), 0);
      if (graph) {
        EXPECT_GT(engine->runner->Describe()["graphs"].size(), 3u) << "the schedules should span several buckets";
      }
    }
  }
}
TEST(CudaRunnerTest, BatchInvariantUnderRandomSchedules) {
  SKIP_WITHOUT_GPU();
  CheckBatchInvariantUnderRandomSchedules(kernels::Tuning{});
}

// The tensor-core product for every linear layer (--tune mma_products=1): one product at every row
// count, so the same promises hold as with the CUDA-core kernels: batch invariance under the random
// schedules, and prefill chunking (512, 100, 37 and 1 row at a time: prefill = decode; the tiled and
// the register kernel, the lists and the batch-1 experts), page size and graphs change no token and no
// logit bit. Its bits differ from the CUDA-core product's (another
// summation order): the logits stay close to them.
TEST(CudaRunnerTest, MmaProductsKeepBatchChunkAndPageInvariance) {
  SKIP_WITHOUT_GPU();
  kernels::Tuning mma;
  mma.mma_products = true;
  auto ck = MakeSyntheticCheckpoint(SmallXs2Geometry(), 11, DType::kBF16);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const auto prompt = LongPrompt(600, ck->config().vocab_size);
  for (DType kv : {DType::kBF16, DType::kF8E4M3}) {
    const Transcript reference = Generate(*ck, kv, 32, 512, true, prompt, 24, mma);
    for (auto [page, chunk, graph] : {std::tuple{32, 100, true}, std::tuple{16, 37, false}, std::tuple{64, 1, true},
                                      std::tuple{32, 512, false}}) {
      // A tiled-kernel threshold of 16 rows puts the 37- and 100-row chunks' rows through the tiled kernel.
      kernels::Tuning t = mma;
      t.mma_tiled_min_tokens = chunk == 37 ? 16 : 64;
      const Transcript r = Generate(*ck, kv, page, chunk, graph, prompt, 24, t);
      EXPECT_EQ(r.tokens, reference.tokens) << DTypeName(kv) << " page " << page << " chunk " << chunk;
      EXPECT_EQ(0, std::memcmp(r.last_logits.data(), reference.last_logits.data(), reference.last_logits.size() * 4))
          << DTypeName(kv) << " page " << page << " chunk " << chunk << " graph " << graph;
    }
    const Transcript cuda_cores = Generate(*ck, kv, 32, 512, true, prompt, 24);
    const double rel = RelL2(reference.last_logits, cuda_cores.last_logits);
    // A BF16-level difference can flip a near-tied expert choice (see TeacherForcedAgainstTransformersBf16):
    // the same bound as against transformers' BF16 run.
    EXPECT_LT(rel, 6e-2) << "the two products' last prompt logits";
    std::printf("[mma] %s: last prompt logits %.3g rel L2 from the CUDA-core product's; the first %zu of %zu "
                "greedy tokens equal\n",
                std::string(DTypeName(kv)).c_str(), rel,
                static_cast<size_t>(std::mismatch(reference.tokens.begin(), reference.tokens.end(),
                                                  cuda_cores.tokens.begin()).first - reference.tokens.begin()),
                reference.tokens.size());
  }
  CheckBatchInvariantUnderRandomSchedules(mma);
}

// Prompt rows on the tensor-core product (their dense layers on the library GEMM, Tuning::prompt_gemm),
// generated rows on the CUDA-core one (the default Tuning::prompt_mma with mma_products off;
// docs/exactness.md, "Prompt rows and generated rows").
// A row's class is its token's (prompt or generated), so: prompt chunkings (512, 300, 100, 37, 1 row at
// a time), page sizes and graphs change no token and no logit bit; a cache recomputed after a
// preemption (the generated tokens re-run as generated rows inside prefill chunks, beside prompt
// rows) gives the uninterrupted run's tokens and logits bit for bit; batch invariance holds under
// random schedules that mix prompt chunks and decode rows in one step; and the logits track the
// all-CUDA-core run (prompt_mma=0) within the products' BF16-level difference.
TEST(CudaRunnerTest, PromptRowsOnTheTensorCoreProductKeepEveryInvariance) {
  SKIP_WITHOUT_GPU();
  const kernels::Tuning def;
  ASSERT_TRUE(def.prompt_mma && !def.mma_products) << "the test is about the default";
  auto ck = MakeSyntheticCheckpoint(SmallXs2Geometry(), 11, DType::kBF16);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const auto prompt = LongPrompt(600, ck->config().vocab_size);
  for (DType kv : {DType::kBF16, DType::kF8E4M3}) {
    SCOPED_TRACE(DTypeName(kv));
    const Transcript reference = Generate(*ck, kv, 32, 512, true, prompt, 24, def);
    for (auto [page, chunk, graph] : {std::tuple{32, 100, true}, std::tuple{16, 37, false}, std::tuple{64, 1, true},
                                      std::tuple{32, 300, false}}) {
      const Transcript r = Generate(*ck, kv, page, chunk, graph, prompt, 24, def);
      EXPECT_EQ(r.tokens, reference.tokens) << "page " << page << " chunk " << chunk;
      EXPECT_EQ(0, std::memcmp(r.last_logits.data(), reference.last_logits.data(), reference.last_logits.size() * 4))
          << "page " << page << " chunk " << chunk << " graph " << graph;
      EXPECT_EQ(0, std::memcmp(r.final_logits.data(), reference.final_logits.data(),
                               reference.final_logits.size() * 4))
          << "page " << page << " chunk " << chunk << " graph " << graph;
    }
    for (auto [after, chunk] : {std::pair{5, 512}, std::pair{11, 37}}) {
      const Transcript r = Generate(*ck, kv, 32, chunk, true, prompt, 24, def, after);
      EXPECT_EQ(r.tokens, reference.tokens) << "recomputed after " << after << " steps, chunk " << chunk;
      EXPECT_EQ(0, std::memcmp(r.final_logits.data(), reference.final_logits.data(),
                               reference.final_logits.size() * 4))
          << "recomputed after " << after << " steps, chunk " << chunk;
    }
    if (def.prompt_gemm) {  // the dense layers' prompt rows on the library GEMM: other bits, close
      kernels::Tuning mma_dense = def;
      mma_dense.prompt_gemm = false;
      const Transcript r = Generate(*ck, kv, 32, 512, true, prompt, 24, mma_dense);
      const double rel_gemm = RelL2(reference.last_logits, r.last_logits);
      EXPECT_LT(rel_gemm, 6e-2) << "library GEMM against the tensor-core product, last prompt logits";
      std::printf("[prompt-gemm] %s: last prompt logits %.3g rel L2 from prompt_gemm=0's\n",
                  std::string(DTypeName(kv)).c_str(), rel_gemm);
    }
    kernels::Tuning cuda_cores;
    cuda_cores.prompt_mma = false;
    const Transcript all_cuda_cores = Generate(*ck, kv, 32, 512, true, prompt, 24, cuda_cores);
    const double rel = RelL2(reference.last_logits, all_cuda_cores.last_logits);
    EXPECT_LT(rel, 6e-2) << "the two products' last prompt logits (the MmaProducts test's bound)";
    EXPECT_NE(0, std::memcmp(reference.last_logits.data(), all_cuda_cores.last_logits.data(),
                             reference.last_logits.size() * 4))
        << "prompt_mma should change the prompt rows' product";
    std::printf("[prompt-mma] %s: last prompt logits %.3g rel L2 from the all-CUDA-core run's; the first %zu of %zu "
                "greedy tokens equal\n",
                std::string(DTypeName(kv)).c_str(), rel,
                static_cast<size_t>(std::mismatch(reference.tokens.begin(), reference.tokens.end(),
                                                  all_cuda_cores.tokens.begin()).first - reference.tokens.begin()),
                reference.tokens.size());
  }
}

// Speculative decoding on the GPU: a verify row computes bit-identically to the decode row at its
// position (the same small-M kernels), so with any drafter the output equals plain decoding token for
// token and logit for logit, alone (GenerateGreedy, every step's logits) and in a scheduler batch
// (greedy and seeded sampling, logprobs), with FP8 and BF16 caches, graphs and eager launches.
TEST(CudaRunnerTest, SpeculativeEqualsPlainDecodingTokenForTokenAndLogitForLogit) {
  SKIP_WITHOUT_GPU();
  auto ck = MakeSyntheticCheckpoint(SmallXs2Geometry(), 17, DType::kBF16);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const int32_t vocab = static_cast<int32_t>(ck->config().vocab_size);
  std::vector<std::vector<int32_t>> prompts;
  for (int n : {40, 600, 9, 130}) {
    std::vector<int32_t> p = LongPrompt(n, vocab);
    for (auto& t : p) t = (t + 3 * n) % vocab;
    prompts.push_back(p);
  }
  const int32_t k_max = 8, batch = static_cast<int32_t>(prompts.size());
  for (DType kv : {DType::kF8E4M3, DType::kBF16}) {
    for (bool graph : {true, false}) {
      SCOPED_TRACE(testing::Message() << DTypeName(kv) << (graph ? " graphs" : " eager"));
      CudaRunnerOptions co;
      co.max_rows = 128;
      co.max_outputs = batch * (1 + k_max);
      co.use_graph = graph;
      auto made = SyntheticCudaEngine(SmallXs2Geometry(), kv, batch, co);  // the same weights every time
      ASSERT_TRUE(made.ok()) << made.status().ToString();
      Engine& engine = **made;
      // Alone: every step's logits.
      TruthTable truth;
      std::vector<GenerateResult> plain;
      GenerateOptions g;
      g.max_tokens = 24;
      g.ignore_eos = true;
      g.prefill_chunk = 128;
      g.keep_step_logits = true;
      for (const auto& p : prompts) {
        auto r = GenerateGreedy(engine, p, g);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        truth.Add(p, r->tokens);
        plain.push_back(std::move(*r));
      }
      const std::vector<std::shared_ptr<const Drafter>> drafters = {
          std::make_shared<OracleDrafter>(truth), std::make_shared<WrongDrafter>(truth, vocab),
          std::make_shared<CorruptingDrafter>(truth, vocab, 0.3, 5), std::make_shared<NgramDrafter>(1, 3)};
      for (const auto& d : drafters) {
        for (int32_t k : {2, 8}) {
          GenerateOptions sg = g;
          sg.drafter = d.get();
          sg.num_draft_tokens = k;
          for (size_t i = 0; i < prompts.size(); ++i) {
            auto r = GenerateGreedy(engine, prompts[i], sg);
            ASSERT_TRUE(r.ok()) << r.status().ToString();
            EXPECT_EQ(r->tokens, plain[i].tokens) << d->name() << " k " << k << " prompt " << i;
            ASSERT_EQ(r->step_logits.size(), plain[i].step_logits.size());
            for (size_t s = 0; s < plain[i].step_logits.size(); ++s) {
              ASSERT_EQ(0, std::memcmp(r->step_logits[s].data(), plain[i].step_logits[s].data(),
                                       plain[i].step_logits[s].size() * 4))
                  << d->name() << " k " << k << " prompt " << i << " step " << s;
            }
          }
        }
      }
      // In a scheduler batch: greedy and seeded sampling with logprobs.
      auto run_batch = [&](std::shared_ptr<const Drafter> drafter, int32_t k) {
        return RunMixedBatch(engine, prompts, batch, std::move(drafter), k);
      };
      const auto want = run_batch(nullptr, 0);
      TruthTable sampled_truth;
      for (size_t i = 0; i < prompts.size(); ++i) {
        std::vector<int32_t> t;
        for (const auto& [tok, lp] : want[i]) t.push_back(tok);
        ASSERT_EQ(t.size(), 20u);
        sampled_truth.Add(prompts[i], t);
      }
      for (const auto& d : {std::shared_ptr<const Drafter>(std::make_shared<OracleDrafter>(sampled_truth)),
                            std::shared_ptr<const Drafter>(std::make_shared<CorruptingDrafter>(sampled_truth, vocab, 0.3, 9))}) {
        EXPECT_EQ(run_batch(d, 4), want) << d->name();
      }
      EXPECT_EQ(engine.kv->used_pages(KvGroup::kFull) + engine.kv->used_pages(KvGroup::kSliding), 0);
    }
  }
}

// DFlash on the GPU: the target runs on CUDA and returns the drafter's hidden-state taps (the
// workspace sized by CudaRunnerOptions::max_taps; forwards with taps run eagerly); the drafter
// proposes blocks, on the GPU (backend/cuda_dflash.h, over the target's device embedding and LM head)
// or on the CPU reference (host weights). With random drafter weights few drafts are accepted; what
// is checked is that the output equals plain decoding token for token and logit for logit, alone and
// in a scheduler batch (greedy and seeded sampling), whatever is accepted or rolled back.
TEST(CudaRunnerTest, DflashSpeculativeEqualsPlainDecoding) {
  SKIP_WITHOUT_GPU();
  const ModelConfig cfg = SmallXs2Geometry();
  test_util::TempDir dir("dl_gpu_dflash");
  WriteDflashOptions wo;
  wo.config = DflashConfigFor(cfg, 2, 8);
  wo.seed = 3;
  wo.out_dir = dir / "drafter";
  ASSERT_TRUE(WriteSyntheticDflash(wo).ok());
  const int32_t vocab = static_cast<int32_t>(cfg.vocab_size);
  std::vector<std::vector<int32_t>> prompts;
  for (int n : {40, 300, 9}) {
    std::vector<int32_t> p = LongPrompt(n, vocab);
    for (auto& t : p) t = (t + 5 * n) % vocab;
    prompts.push_back(p);
  }
  const int32_t k_max = 7, batch = static_cast<int32_t>(prompts.size());
  for (DType kv : {DType::kF8E4M3, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(kv));
    CudaRunnerOptions co;
    co.max_rows = 128;
    co.max_outputs = batch * (1 + k_max);
    co.max_taps = static_cast<int32_t>(wo.config.num_taps());
    auto made = SyntheticCudaEngine(cfg, kv, batch, co);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    Engine& engine = **made;
    for (bool on_gpu : {true, false}) {
    SCOPED_TRACE(on_gpu ? "drafter on cuda" : "drafter on cpu");
    auto drafter = DflashDrafter::Create(wo.out_dir, *engine.checkpoint, k_max, on_gpu ? engine.runner.get() : nullptr);
    ASSERT_TRUE(drafter.ok()) << drafter.status().ToString();
    EXPECT_EQ((*drafter)->where(), on_gpu ? "cuda" : "cpu") << (*drafter)->name();
    EXPECT_EQ((*drafter)->placement_note(), "");
    GenerateOptions g;
    g.max_tokens = 24;
    g.ignore_eos = true;
    g.prefill_chunk = 128;
    g.keep_step_logits = true;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto plain = GenerateGreedy(engine, prompts[i], g);
      ASSERT_TRUE(plain.ok()) << plain.status().ToString();
      for (int32_t k : {3, 7}) {
        GenerateOptions sg = g;
        sg.drafter = drafter->get();
        sg.num_draft_tokens = k;
        auto r = GenerateGreedy(engine, prompts[i], sg);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        EXPECT_EQ(r->tokens, plain->tokens) << "k " << k << " prompt " << i;
        EXPECT_GT(r->spec.num_drafts, 0u);
        ASSERT_EQ(r->step_logits.size(), plain->step_logits.size());
        for (size_t s = 0; s < plain->step_logits.size(); ++s) {
          ASSERT_EQ(0, std::memcmp(r->step_logits[s].data(), plain->step_logits[s].data(),
                                   plain->step_logits[s].size() * 4))
              << "k " << k << " prompt " << i << " step " << s;
        }
        std::printf("dflash %s on %s k %d prompt %zu: %llu drafts, %llu of %llu draft tokens accepted\n",
                    DTypeName(kv).data(), (*drafter)->where().c_str(), k, i,
                    static_cast<unsigned long long>(r->spec.num_drafts),
                    static_cast<unsigned long long>(r->spec.num_accepted_tokens),
                    static_cast<unsigned long long>(r->spec.num_draft_tokens));
      }
    }
    auto run_batch = [&](std::shared_ptr<const Drafter> d, int32_t k) {
      return RunMixedBatch(engine, prompts, batch, std::move(d), k);
    };
    const auto want = run_batch(nullptr, 0);
    EXPECT_EQ(run_batch(*drafter, 7), want);
    EXPECT_EQ((*drafter)->num_sequences(), 0u);
    EXPECT_EQ(engine.kv->used_pages(KvGroup::kFull) + engine.kv->used_pages(KvGroup::kSliding), 0);
    }
  }
}

// Runs two DFlash drafters side by side on the same sequence (the same taps, the same blocks) and
// compares the GPU drafter's logits of every block with the CPU reference's; proposes the GPU's drafts.
class TeeDflashDrafter : public Drafter {
 public:
  TeeDflashDrafter(std::shared_ptr<DflashDrafter> gpu, std::shared_ptr<DflashDrafter> cpu)
      : gpu_(std::move(gpu)), cpu_(std::move(cpu)) {
    gpu_->set_keep_logits(true);
    cpu_->set_keep_logits(true);
  }
  std::vector<int32_t> Propose(std::span<const int32_t>, int32_t) const override { return {}; }
  std::string name() const override { return "tee(" + gpu_->name() + ", " + cpu_->name() + ")"; }
  std::vector<int32_t> hidden_taps() const override { return gpu_->hidden_taps(); }
  uint64_t NewSequence() const override { return next_++; }
  Status Observe(uint64_t seq, int32_t position, const ForwardResult& result, int32_t first_row,
                 int32_t rows) const override {
    DL_RETURN_IF_ERROR(gpu_->Observe(seq, position, result, first_row, rows));
    return cpu_->Observe(seq, position, result, first_row, rows);
  }
  Result<std::vector<int32_t>> ProposeFor(uint64_t seq, std::span<const int32_t> context,
                                          int32_t max_tokens) const override {
    DL_ASSIGN_OR_RETURN(auto g, gpu_->ProposeFor(seq, context, max_tokens));
    DL_ASSIGN_OR_RETURN(auto c, cpu_->ProposeFor(seq, context, max_tokens));
    const std::vector<float> lg = gpu_->last_logits(), lc = cpu_->last_logits();
    if (lg.size() != lc.size() || g.size() != c.size()) return Internal("the drafters' outputs differ in size");
    const size_t V = lg.size() / std::max<size_t>(1, g.size());
    for (size_t r = 0; r < g.size(); ++r) {
      double err = 0, ref = 0;
      float top1 = -INFINITY, top2 = -INFINITY;
      for (size_t i = 0; i < V; ++i) {
        const double e = static_cast<double>(lg[r * V + i]) - lc[r * V + i];
        err += e * e;
        ref += static_cast<double>(lc[r * V + i]) * lc[r * V + i];
        const float x = lc[r * V + i];
        if (x > top1) {
          top2 = top1, top1 = x;
        } else if (x > top2) {
          top2 = x;
        }
      }
      worst_rel_l2 = std::max(worst_rel_l2, std::sqrt(err / std::max(ref, 1e-30)));
      ++rows;
      // A token may differ only where the reference's two best logits are within the GPU's rounding:
      // closer than 8 times the row's RMS difference.
      if (g[r] == c[r]) {
        ++same;
      } else if (top1 - top2 > 8.0 * std::sqrt(err / static_cast<double>(V))) {
        ++clear_mismatches;
      }
    }
    return g;
  }
  void Forget(uint64_t seq) const override {
    gpu_->Forget(seq);
    cpu_->Forget(seq);
  }
  mutable double worst_rel_l2 = 0;
  mutable int rows = 0, same = 0, clear_mismatches = 0;

 private:
  std::shared_ptr<DflashDrafter> gpu_, cpu_;
  mutable uint64_t next_ = 1;
};

// The GPU drafter against the CPU reference on the same taps and blocks: logits within BF16
// activations' error of the FP32 reference, and the same draft token wherever the reference's choice
// is clear. Laguna family (causal sliding blocks, per-head gate, per-tap norms) and z-lab family
// (bidirectional full-attention blocks), over a prompt longer than the drafter's window (its ring),
// prefill chunks of 128 rows.
TEST(CudaRunnerTest, DflashDrafterOnGpuMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  const ModelConfig cfg = SmallXs2Geometry();
  test_util::TempDir dir("dl_gpu_dflash_ref");
  const int32_t vocab = static_cast<int32_t>(cfg.vocab_size);
  for (DflashFamily family : {DflashFamily::kLaguna, DflashFamily::kZlab}) {
    SCOPED_TRACE(DflashFamilyName(family));
    WriteDflashOptions wo;
    wo.config = DflashConfigFor(cfg, 2, 8, family);
    // z-lab's full-attention layers: the global layers' heads (G 6), whose presets are built.
    if (family == DflashFamily::kZlab) wo.config.num_attention_heads = cfg.num_attention_heads;
    wo.seed = 5;
    wo.out_dir = dir / DflashFamilyName(family);
    ASSERT_TRUE(WriteSyntheticDflash(wo).ok());
    CudaRunnerOptions co;
    co.max_rows = 128;
    co.max_outputs = 8;
    co.max_taps = static_cast<int32_t>(wo.config.num_taps());
    auto made = SyntheticCudaEngine(cfg, DType::kBF16, 1, co);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    Engine& engine = **made;
    auto gpu = DflashDrafter::Create(wo.out_dir, *engine.checkpoint, 7, engine.runner.get());
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    auto cpu = DflashDrafter::Create(wo.out_dir, *engine.checkpoint, 7);
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    ASSERT_EQ((*gpu)->where(), "cuda");
    ASSERT_EQ((*cpu)->where(), "cpu");
    TeeDflashDrafter tee(*gpu, *cpu);
    std::vector<int32_t> prompt = LongPrompt(700, vocab);
    GenerateOptions g;
    g.max_tokens = 24;
    g.ignore_eos = true;
    g.prefill_chunk = 128;
    auto plain = GenerateGreedy(engine, prompt, g);
    ASSERT_TRUE(plain.ok()) << plain.status().ToString();
    g.drafter = &tee;
    g.num_draft_tokens = 7;
    auto r = GenerateGreedy(engine, prompt, g);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tokens, plain->tokens);
    std::printf("dflash gpu vs cpu (%s): %d draft rows, %d same tokens, %d clear mismatches, worst relative L2 %.4f\n",
                DflashFamilyName(family), tee.rows, tee.same, tee.clear_mismatches, tee.worst_rel_l2);
    EXPECT_GT(tee.rows, 0);
    EXPECT_EQ(tee.clear_mismatches, 0);
    EXPECT_LT(tee.worst_rel_l2, 0.05);
    EXPECT_EQ((*gpu)->num_sequences(), 0u);
  }
}

TEST(CudaRunnerTest, ReportsGraphTopologyAndPresets) {
  SKIP_WITHOUT_GPU();
  auto engine = LoadDir(GoldenDir("tiny"), DType::kF8E4M3, 16, false);
  ASSERT_TRUE(engine);
  GenerateOptions g;
  g.max_tokens = 4;
  g.ignore_eos = true;
  auto r = GenerateGreedy(*engine, std::vector<int32_t>{3, 4, 5}, g);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto d = engine->runner->Describe();
  std::printf("%s\n", d.dump().c_str());
  EXPECT_EQ(d["fallback"].get<bool>(), false);
  // The prompt rows ran on the library GEMM (the default): its algorithms are part of the description.
  ASSERT_TRUE(d["library_gemm"].is_array());
  EXPECT_FALSE(d["library_gemm"].empty());
  for (const auto& a : d["library_gemm"]) EXPECT_NE(a.get<std::string>().find("cuBLASLt"), std::string::npos) << a;
  const int nodes = d["topology"][0]["kernel_nodes"].get<int>();
  EXPECT_GT(nodes, 0);
  EXPECT_EQ(d["topology"][0]["signature"].get<std::string>(), std::to_string(nodes) + "/0");
  EXPECT_EQ(d["layer_presets"].size(), 5u);
}

// bench --skip-ops: an unknown name is an error that lists the known ones; a skipped family leaves
// the captured step (fewer kernel nodes) and is reported by Describe.
TEST(CudaRunnerTest, SkipOpsAreValidatedAndReported) {
  SKIP_WITHOUT_GPU();
  auto make = [](std::vector<std::string> skip) {
    EngineOptions o;
    o.model_dir = GoldenDir("tiny").string();
    o.backend = BackendKind::kCuda;
    o.kv_dtype = DType::kBF16;
    o.max_seq_len = 64;
    o.skip_ops = std::move(skip);
    return LoadEngine(o);
  };
  auto bad = make({"moe", "attn"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unknown op 'attn'"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("attention"), std::string::npos) << bad.status().message();
  int nodes[2] = {0, 0};
  for (int skip = 0; skip < 2; ++skip) {
    auto e = make(skip ? std::vector<std::string>{"moe"} : std::vector<std::string>{});
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    GenerateOptions g;
    g.max_tokens = 3;
    g.ignore_eos = true;
    ASSERT_TRUE(GenerateGreedy(**e, std::vector<int32_t>{3, 4, 5}, g).ok());
    const auto d = (*e)->runner->Describe();
    nodes[skip] = d["topology"][0]["kernel_nodes"].get<int>();
    EXPECT_EQ(d["skipped_ops"].size(), static_cast<size_t>(skip));
  }
  EXPECT_LT(nodes[1], nodes[0]) << "skipping the MoE must remove its kernels from the step";
}

// FP8 weights generated on the device for a shape-only checkpoint (the FP8 contract's quantisation) in
// the `all-linear` layout and the export's (routed experts only: FP8 experts beside a BF16 shared
// expert and BF16 attention): the prompt's logits and the greedy tokens are bit-identical across
// prefill chunkings (the FP8 GEMV and MoE at different T: batched, grouped and batch-1 streaming
// paths), page sizes and graph vs eager, and run to run; and the model is the BF16 one up to FP8
// rounding (the logits' cosine similarity with the BF16 weights' run).
TEST(CudaRunnerTest, Fp8WeightsKeepEveryInvarianceAndTrackBf16) {
  SKIP_WITHOUT_GPU();
  auto ck = MakeShapeOnlyCheckpoint(SmallXs2Geometry());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const auto prompt = LongPrompt(600, ck->config().vocab_size);
  const Transcript bf16 = Generate(*ck, DType::kF8E4M3, 32, 512, true, prompt, 16);
  ASSERT_FALSE(bf16.last_logits.empty());
  // The layouts of model/fp8_layout.h, as `--shape-dtype fp8 --fp8-layout` builds them.
  for (const Fp8Layout layout : {Fp8Layout::kAllLinear, Fp8Layout::kExport}) {
    SCOPED_TRACE(Fp8LayoutName(layout));
    Fp8Options fp8;
    fp8.layout = layout;
    auto fck = MakeShapeOnlyCheckpoint(SmallXs2Geometry(), &fp8);
    ASSERT_TRUE(fck.ok()) << fck.status().ToString();
    const Transcript reference = Generate(*fck, DType::kF8E4M3, 32, 512, true, prompt, 16);
    ASSERT_EQ(reference.last_logits.size(), bf16.last_logits.size());
    double dot = 0, a2 = 0, b2 = 0;
    for (size_t i = 0; i < bf16.last_logits.size(); ++i) {
      dot += double(reference.last_logits[i]) * bf16.last_logits[i];
      a2 += double(reference.last_logits[i]) * reference.last_logits[i];
      b2 += double(bf16.last_logits[i]) * bf16.last_logits[i];
    }
    const double cosine = dot / std::sqrt(a2 * b2);
    EXPECT_GT(cosine, 0.9) << "FP8 weights should give nearly the BF16 model's logits";
    EXPECT_LT(cosine, 1.0) << "FP8 weights should not be the BF16 weights";
    for (auto [page, chunk, graph] : {std::tuple{32, 512, true}, std::tuple{16, 37, true}, std::tuple{64, 100, false},
                                      std::tuple{32, 7, false}}) {
      const Transcript r = Generate(*fck, DType::kF8E4M3, page, chunk, graph, prompt, 16);
      EXPECT_EQ(r.tokens, reference.tokens) << "page " << page << " chunk " << chunk << " graph " << graph;
      EXPECT_EQ(0, std::memcmp(r.last_logits.data(), reference.last_logits.data(), reference.last_logits.size() * 4))
          << "page " << page << " chunk " << chunk << " graph " << graph;
    }
    // Prompt rows' FP8 weights on the tensor-core product (the default) against the CUDA-core FP8 rule:
    // other bits, close.
    kernels::Tuning cuda_core_fp8;
    cuda_core_fp8.prompt_fp8_mma = false;
    const Transcript r = Generate(*fck, DType::kF8E4M3, 32, 512, true, prompt, 16, cuda_core_fp8);
    const double rel = RelL2(reference.last_logits, r.last_logits);
    EXPECT_LT(rel, 6e-2) << "prompt_fp8_mma=1 against 0, last prompt logits";
    EXPECT_NE(0, std::memcmp(r.last_logits.data(), reference.last_logits.data(), reference.last_logits.size() * 4))
        << "prompt_fp8_mma should change the prompt rows' product";
    std::printf("[prompt-fp8-mma] %s: last prompt logits %.3g rel L2 from prompt_fp8_mma=0's\n",
                std::string(Fp8LayoutName(layout)).c_str(), rel);
  }
}

}  // namespace
}  // namespace dl
