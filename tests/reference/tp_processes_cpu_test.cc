// CPU tensor parallelism with ranks 1..N-1 as child processes (--tp-transport processes,
// backend/tp_process_ranks.h): tokens and every step's logits bit-identical to the in-process
// transport on the goldens and a --shape model; a child's failure, death or hang ends the group
// naming the rank and how it ended; no child process outlives the group or the runner. The child
// ranks are this test binary re-executed with `__tp-rank` (main() below), as decodelab re-executes
// itself.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cstdio>

#include <gtest/gtest.h>

#include "backend/cpu_tp_runner.h"
#include "comm/process.h"
#include "engine/engine.h"
#include "engine/tp_rank_process.h"
#include "tests/common/golden_data.h"
#include "tests/common/tp_process_util.h"

namespace dl {
namespace {

using namespace testing_golden;
using test_util::ExpectContains;
using test_util::ExpectGone;
using test_util::ForwardOnce;
using Clock = std::chrono::steady_clock;

EngineOptions Options(int tp, EmbeddingMode embedding, const std::string& transport) {
  EngineOptions o = CpuTpOptions(tp, embedding);
  o.tp_transport = transport;
  o.tp_rank_argv_prefix = {"tp_processes_cpu_test", "__tp-rank"};
  o.tp_timeout_s = 60;
  return o;
}

std::unique_ptr<Engine> Load(EngineOptions o) {
  auto e = LoadEngine(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::unique_ptr<Engine> LoadGolden(const fs::path& dir, int tp, EmbeddingMode embedding, const std::string& transport,
                                   double timeout_s = 60) {
  EngineOptions o = Options(tp, embedding, transport);
  o.model_dir = dir.string();
  o.tp_timeout_s = timeout_s;
  return Load(o);
}

CpuTpRunner& Runner(Engine& e) { return dynamic_cast<CpuTpRunner&>(*e.runner); }

bool PlanAllows(const fs::path& dir, int tp) {
  auto c = ModelConfig::FromFile((dir / "config.json").string());
  return c.ok() && MakeTensorParallelPlan(*c, tp, EmbeddingMode::kReplicated).ok();
}

// Greedy tokens and the bits of every step's logits.
struct GreedyRun {
  std::vector<int32_t> tokens;
  std::vector<uint32_t> logit_bits;
};

GreedyRun Generate(Engine& e, const std::vector<int32_t>& prompt, int32_t max_tokens) {
  GenerateOptions opts;
  opts.max_tokens = max_tokens;
  opts.ignore_eos = true;
  opts.keep_step_logits = true;
  auto r = GenerateGreedy(e, prompt, opts);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  GreedyRun run;
  if (!r.ok()) return run;
  run.tokens = r->tokens;
  for (const auto& step : r->step_logits) {
    for (float f : step) run.logit_bits.push_back(std::bit_cast<uint32_t>(f));
  }
  for (float f : r->last_prompt_logits) run.logit_bits.push_back(std::bit_cast<uint32_t>(f));
  return run;
}

// One prefill forward of `prompt` (a fresh sequence) with a greedy output row.
std::vector<pid_t> ChildPids(Engine& e) {
  std::vector<pid_t> pids = test_util::ChildPids<CpuTpRunner>(e);
  EXPECT_EQ(pids.size() + 1, static_cast<size_t>(Runner(e).plan().tp_size));
  return pids;
}

TEST(TpProcessesCpuTest, TokensAndLogitsAreBitIdenticalToInProcessOnTheGoldens) {
  int runs = 0;
  for (const auto& dir : GoldenDirs()) {
    for (int tp : {2, 3, 4}) {
      if (!PlanAllows(dir, tp)) continue;
      // TP=2 on every golden model in both embedding modes; 3 and 4 on tiny (the rendezvous, plan
      // and reply paths with several children).
      if (tp > 2 && dir.filename() != "tiny") continue;
      for (EmbeddingMode mode : {EmbeddingMode::kVocabParallel, EmbeddingMode::kReplicated}) {
        if (tp > 2 && mode == EmbeddingMode::kReplicated) continue;
        SCOPED_TRACE(fmt::format("{} tp={} embedding={}", dir.filename().string(), tp, EmbeddingModeName(mode)));
        auto threads = LoadGolden(dir, tp, mode, "auto");
        auto processes = LoadGolden(dir, tp, mode, "processes");
        ASSERT_TRUE(threads && processes);
        const std::vector<pid_t> pids = ChildPids(*processes);
        ASSERT_EQ(pids.size(), static_cast<size_t>(tp - 1));
        for (const auto& g : LoadGoldens(dir / "goldens_fp32.json")) {
          const GreedyRun want = Generate(*threads, g.prompt, 12);
          const GreedyRun got = Generate(*processes, g.prompt, 12);
          ASSERT_FALSE(want.tokens.empty());
          EXPECT_EQ(got.tokens, want.tokens);
          EXPECT_EQ(got.logit_bits, want.logit_bits) << "logits differ in some bit";
        }
        const nlohmann::json d = processes->runner->Describe()["tensor_parallel"];
        const nlohmann::json t = threads->runner->Describe()["tensor_parallel"];
        EXPECT_EQ(d["transport"], "processes");
        ASSERT_EQ(d["ranks"].size(), static_cast<size_t>(tp));
        for (int r = 0; r < tp; ++r) {
          EXPECT_EQ(d["ranks"][r]["collectives_last_forward"], t["ranks"][r]["collectives_last_forward"]) << r;
          EXPECT_GT(d["ranks"][r]["collectives_last_forward"].get<int64_t>(), 0) << r;
          EXPECT_EQ(d["ranks"][r]["kv_heads"], t["ranks"][r]["kv_heads"]) << r;
          EXPECT_EQ(d["ranks"][r]["lm_head_vocab"], t["ranks"][r]["lm_head_vocab"]) << r;
          EXPECT_EQ(d["ranks"][r]["kv_scales"], t["ranks"][r]["kv_scales"]) << r;
          EXPECT_EQ(d["ranks"][r]["pid"].get<int64_t>(), r == 0 ? ::getpid() : pids[r - 1]) << r;
        }
        processes.reset();
        ExpectGone(pids);
        std::printf("[tp-processes] %s tp=%d embedding=%s: bit-identical to in-process\n", dir.filename().c_str(), tp,
                    EmbeddingModeName(mode));
        ++runs;
      }
    }
  }
  EXPECT_GE(runs, 6);  // tiny at TP 2 (x2), 3 and 4, and at least one more golden model at TP 2
}

// A --shape model: each child generates its own synthetic weights from the same shape and seed.
// BF16 and FP8 --shape weights (an FP8 layout other than the defaults: every field must reach the
// children, or they would build other weights than rank 0's).
TEST(TpProcessesCpuTest, ShapeWeightsAreRebuiltBitIdenticallyInEachChild) {
  Fp8Options fp8;
  fp8.layout = Fp8Layout::kAllLinear;
  fp8.format = WeightQuantFormat::kFp8CompressedTensors;
  fp8.block_rows = fp8.block_cols = 16;
  for (const std::optional<Fp8Options>& shape_fp8 : {std::optional<Fp8Options>{}, std::optional<Fp8Options>{fp8}}) {
    SCOPED_TRACE(shape_fp8 ? "fp8" : "bf16");
    EngineOptions o = Options(2, EmbeddingMode::kVocabParallel, "processes");
    o.shape = "tiny";
    o.seed = 1234;
    o.shape_fp8 = shape_fp8;
    auto processes = Load(o);
    o.tp_transport = "auto";
    auto threads = Load(o);
    ASSERT_TRUE(processes && threads);
    const std::vector<int32_t> prompt = {5, 77, 300, 2, 9, 128, 64, 401};
    const GreedyRun want = Generate(*threads, prompt, 10);
    const GreedyRun got = Generate(*processes, prompt, 10);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.logit_bits, want.logit_bits);
  }
}

// A child that built other weights than rank 0 (here another seed; as well another dtype or FP8
// layout) refuses at setup, and the group does not start: the weights digest in the setup.
TEST(TpProcessesCpuTest, AChildWithOtherWeightsRefusesAtSetup) {
  EngineOptions o = Options(2, EmbeddingMode::kReplicated, "auto");
  o.shape = "tiny";
  o.seed = 1234;
  auto engine = Load(o);
  ASSERT_TRUE(engine);
  o.seed = 99;  // the children's model source
  auto runner = CpuTpRunner::Create(*engine->checkpoint, engine->kv->spec(), {}, 2, EmbeddingMode::kReplicated,
                                    TpTransport::kProcesses, 30, TpProcessOptionsFor(o));
  ASSERT_FALSE(runner.ok());
  ExpectContains(runner.status().message(), "rank 1");
  ExpectContains(runner.status().message(), "built other weights than rank 0");
}

TEST(TpProcessesCpuTest, AChildsForwardFailureEndsTheGroupNamingTheRank) {
  auto engine = LoadGolden(GoldenDir("tiny"), 4, EmbeddingMode::kVocabParallel, "processes");
  ASSERT_TRUE(engine);
  const std::vector<pid_t> pids = ChildPids(*engine);
  ASSERT_TRUE(ForwardOnce(*engine, {3, 4, 5, 6}).ok());
  Runner(*engine).FailNextForwardOnRank(2, Internal("injected failure"));
  const auto t0 = Clock::now();
  Status st = ForwardOnce(*engine, {3, 4, 5, 6});
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 20.0) << "the abort did not end the step";
  ASSERT_FALSE(st.ok());
  std::printf("[tp-processes] %s\n", st.message().c_str());
  ExpectContains(st.message(), "tensor-parallel group of 4 ended");
  ExpectContains(st.message(), "rank 2: INTERNAL: injected failure");
  // The others left their collective because rank 2 closed its sockets.
  ExpectContains(st.message(), "rank 0: ");
  // The group is over: its children are stopped and reaped at once, and later steps are refused.
  ExpectGone(pids);
  Status again = ForwardOnce(*engine, {3, 4, 5, 6});
  ASSERT_FALSE(again.ok());
  ExpectContains(again.message(), "tensor-parallel group of 4 ended");
}

TEST(TpProcessesCpuTest, AKilledChildEndsTheGroupNamingHowItEnded) {
  auto engine = LoadGolden(GoldenDir("tiny"), 2, EmbeddingMode::kReplicated, "processes");
  ASSERT_TRUE(engine);
  test_util::ExpectAKilledChildEndsTheGroup(engine, ChildPids(*engine));
}

// A child that stops answering (SIGSTOP: alive, silent) is bounded by the collective timeout, then
// killed and reaped; the step's error says so.
TEST(TpProcessesCpuTest, AHungChildIsKilledAfterTheCollectiveTimeout) {
  const double timeout_s = 2.0;
  auto engine = LoadGolden(GoldenDir("tiny"), 2, EmbeddingMode::kReplicated, "processes", timeout_s);
  ASSERT_TRUE(engine);
  const std::vector<pid_t> pids = ChildPids(*engine);
  ASSERT_TRUE(ForwardOnce(*engine, {3, 4, 5, 6}).ok());
  ASSERT_EQ(::kill(pids[0], SIGSTOP), 0);
  const auto t0 = Clock::now();
  Status st = ForwardOnce(*engine, {3, 4, 5, 6});
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_FALSE(st.ok());
  std::printf("[tp-processes] %s\n", st.message().c_str());
  // Rank 0's collective waits the timeout, then the child gets the same again to reply.
  EXPECT_GE(s, timeout_s);
  EXPECT_LT(s, 2 * timeout_s + 5);
  ExpectContains(st.message(), "rank 0: DEADLINE_EXCEEDED");
  ExpectContains(st.message(), "rank 1: DEADLINE_EXCEEDED: no reply to its step within 2 s");
  ExpectContains(st.message(), "killed");
  ExpectGone(pids);
}

TEST(TpProcessesCpuTest, DestroyingTheRunnerStopsAndReapsEveryChild) {
  auto engine = LoadGolden(GoldenDir("tiny"), 4, EmbeddingMode::kVocabParallel, "processes");
  ASSERT_TRUE(engine);
  const std::vector<pid_t> pids = ChildPids(*engine);
  ASSERT_EQ(pids.size(), 3u);
  for (pid_t pid : pids) EXPECT_TRUE(comm::ProcessIsRunning(pid));
  ASSERT_TRUE(ForwardOnce(*engine, {3, 4, 5, 6}).ok());
  const auto t0 = Clock::now();
  engine.reset();
  // The children leave on the stop message, well before the kill that would follow the grace.
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 4.0);
  ExpectGone(pids);
}

// A plan the child cannot read (here: not a plan at all) is refused by the child, which says why to
// rank 0 and leaves; nothing is run on a half-read plan.
TEST(TpProcessesCpuTest, AChildRefusesACorruptPlanAndSaysWhy) {
  // The model and cache geometry of a one-rank engine: what rank 0 would send.
  auto one = LoadGolden(GoldenDir("tiny"), 1, EmbeddingMode::kReplicated, "auto");
  ASSERT_TRUE(one);
  const KvCache* kv = one->kv.get();
  TpProcessOptions options;
  options.argv_prefix = {"tp_processes_cpu_test", "__tp-rank", "--model", GoldenDir("tiny").string()};
  const TpRankSetup setup =
      TpRankSetup::ForRankZero(*one->checkpoint, 2, EmbeddingMode::kReplicated, kv->spec(), KvScales{}, TpRankBackend::kCpu);
  auto ranks = TpProcessRanks::Start(options, setup, 30);
  ASSERT_TRUE(ranks.ok()) << ranks.status().ToString();
  ASSERT_TRUE((*ranks)->WaitReady().ok());
  const std::vector<pid_t> pids = {(*ranks)->pid(1)};
  const std::vector<std::byte> garbage(40, std::byte{0x5a});
  InjectedFailures none;
  std::vector<Status> statuses = (*ranks)->SendStep(garbage, none);
  ASSERT_TRUE(statuses[1].ok()) << statuses[1].ToString();
  (*ranks)->CollectReplies(false, &statuses);
  ASSERT_FALSE(statuses[1].ok());
  EXPECT_EQ(statuses[1].code(), StatusCode::kDataLoss) << statuses[1].ToString();
  ExpectContains(statuses[1].message(), "rank 1: step plan: bad magic");
  ranks->reset();
  ExpectGone(pids);
}

TEST(TpProcessesCpuTest, RequestErrorsAreRefusedOnRankZeroWithoutEndingTheGroup) {
  auto engine = LoadGolden(GoldenDir("tiny"), 2, EmbeddingMode::kReplicated, "processes");
  ASSERT_TRUE(engine);
  Status bad = ForwardOnce(*engine, {3, 4, 512});  // token id outside the vocabulary
  ASSERT_FALSE(bad.ok());
  ExpectContains(bad.message(), "outside the vocabulary");
  EXPECT_TRUE(ForwardOnce(*engine, {3, 4, 5}).ok());
}

TEST(TpProcessesCpuTest, RefusalsAreClear) {
  EngineOptions o = Options(1, EmbeddingMode::kReplicated, "processes");
  o.model_dir = GoldenDir("tiny").string();
  auto e = LoadEngine(o);
  ASSERT_FALSE(e.ok());
  ExpectContains(e.status().message(), "--tp-transport processes needs --tp 2 or more");
  o.tp = 2;
  o.tp_transport = "nccl";
  e = LoadEngine(o);
  ASSERT_FALSE(e.ok());
  ExpectContains(e.status().message(), "--tp-transport nccl is a CUDA communicator");
  // A child that cannot be started at all: the rendezvous names how it ended.
  o.tp_transport = "processes";
  o.tp_rank_exe = "/nonexistent/decodelab";
  const auto t0 = Clock::now();
  e = LoadEngine(o);
  ASSERT_FALSE(e.ok());
  ExpectContains(e.status().message(), "rank 1");
  ExpectContains(e.status().message(), "exit code 127");
  std::printf("[tp-processes] %s\n", e.status().message().c_str());
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0) << "waited for the rendezvous deadline";
}

}  // namespace
}  // namespace dl

// The child ranks are this binary: `tp_processes_cpu_test __tp-rank ...`.
int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "__tp-rank") {
    ::_exit(dl::TpRankProcessMain("tp_processes_cpu_test", std::vector<std::string>(argv + 2, argv + argc)));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
