// Probe tests. The ranks are this test binary re-executed with `__probe-rank` (see main() below),
// so the whole supervisor - launch, markers, kills, reaping, classification - runs for real on the
// sim transport, with no GPU. Each hang case costs about timeout + grace = 3 s.
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "comm/tcp_group.h"
#include "cuda/device.h"
#include "lab/probe.h"
#include "lab/probe_markers.h"

namespace dl::lab {
namespace {

// ---- classification table (pure) ----

RankOutcome Ok(int rank) {
  RankOutcome r;
  r.rank = rank;
  r.started = true;
  r.has.fill(true);
  r.result = "ok";
  r.exit.exited = true;
  r.exit.code = 0;
  return r;
}

RankOutcome UpTo(int rank, Stage last, int code) {
  RankOutcome r = Ok(rank);
  r.has.fill(false);
  for (int i = 0; i <= static_cast<int>(last); ++i) r.has[i] = true;
  if (!r.Has(Stage::kResultChecked)) r.result.clear();
  r.exit.code = code;
  return r;
}

TEST(Classify, AllOkIsPass) {
  Classification c = Classify({Ok(0), Ok(1), Ok(2), Ok(3)});
  EXPECT_EQ(c.cls, ProbeClass::kPass);
  EXPECT_EQ(c.clean_teardowns, 4);
}

TEST(Classify, EachRowAndItsExitCode) {
  RankOutcome silent = Ok(1);
  silent.has.fill(false);
  silent.result.clear();
  EXPECT_EQ(Classify({Ok(0), silent}).cls, ProbeClass::kNotExecuted);
  RankOutcome never = Ok(1);
  never.has.fill(false);
  never.started = false;
  never.exit = {};
  EXPECT_EQ(Classify({Ok(0), never}).cls, ProbeClass::kLaunchFailure);
  EXPECT_EQ(Classify({Ok(0), UpTo(1, Stage::kDeviceSet, 1)}).cls, ProbeClass::kInitStageFailure);
  EXPECT_EQ(Classify({Ok(0), UpTo(1, Stage::kTensorAllocated, 124)}).cls,
            ProbeClass::kCollectiveStageFailure);
  RankOutcome mismatch = Ok(1);
  mismatch.result = "mismatch";
  EXPECT_EQ(Classify({Ok(0), mismatch}).cls, ProbeClass::kResultMismatch);
  EXPECT_EQ(Classify({Ok(0), UpTo(1, Stage::kAllReduceDone, 1)}).cls, ProbeClass::kTeardownFailure);
  EXPECT_EQ(Classify({Ok(0), UpTo(1, Stage::kResultChecked, 0)}).cls, ProbeClass::kTeardownFailure);
  // Exit codes from lab.md §4.
  EXPECT_EQ(ProbeExitCode(ProbeClass::kNotExecuted), 8);
  EXPECT_EQ(ProbeExitCode(ProbeClass::kLaunchFailure), 2);
  EXPECT_EQ(ProbeExitCode(ProbeClass::kInitStageFailure), 3);
  EXPECT_EQ(ProbeExitCode(ProbeClass::kCollectiveStageFailure), 4);
  EXPECT_EQ(ProbeExitCode(ProbeClass::kResultMismatch), 5);
  EXPECT_EQ(ProbeExitCode(ProbeClass::kTeardownFailure), 6);
  EXPECT_EQ(ProbeExitCode(ProbeClass::kPass), 0);
}

TEST(Classify, FirstMatchingRowWins) {
  // A rank that never got past import-done outranks one stuck in the collective (row 2 before 4).
  Classification c = Classify({UpTo(0, Stage::kAllReduceStart, 124), UpTo(1, Stage::kImportDone, 1),
                               UpTo(2, Stage::kDeviceSet, 1)});
  EXPECT_EQ(c.cls, ProbeClass::kInitStageFailure);
  EXPECT_NE(c.reason.find("rank 1"), std::string::npos) << c.reason;
  EXPECT_NE(c.reason.find("rank 2"), std::string::npos) << c.reason;
  // A rank with no markers that exited 0 beats everything, even a launch failure elsewhere.
  RankOutcome silent = Ok(0);
  silent.has.fill(false);
  RankOutcome crashed = UpTo(1, Stage::kImportDone, 0);
  crashed.has.fill(false);
  crashed.exit.exited = false;
  crashed.exit.signal = 9;
  EXPECT_EQ(Classify({silent, crashed}).cls, ProbeClass::kNotExecuted);
  // A killed rank with no markers is a launch failure, not "not executed".
  EXPECT_EQ(Classify({Ok(0), crashed}).cls, ProbeClass::kLaunchFailure);
  // A mismatch outranks a missing teardown (row 5 before 6).
  RankOutcome mismatch = UpTo(0, Stage::kResultChecked, 124);
  mismatch.result = "mismatch";
  EXPECT_EQ(Classify({mismatch, UpTo(1, Stage::kResultChecked, 1)}).cls,
            ProbeClass::kResultMismatch);
}

TEST(Classify, CleanTeardownsNeedMarkerAndOwnExitZero) {
  RankOutcome killed = Ok(1);
  killed.killed_by_supervisor = true;
  killed.exit.exited = false;
  killed.exit.signal = 9;
  RankOutcome nonzero = Ok(2);
  nonzero.exit.code = 1;
  Classification c = Classify({Ok(0), killed, nonzero});
  EXPECT_EQ(c.clean_teardowns, 1);
}

TEST(Injection, ParsesAndRejects) {
  auto a = ParseInjection("all_reduce-done:1:hang");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->stage, Stage::kAllReduceDone);
  EXPECT_EQ(a->rank, 1);
  EXPECT_EQ(a->kind, InjectKind::kHang);
  EXPECT_EQ(a->ToString(), "all_reduce-done:1:hang");
  auto b = ParseInjection("import-done:12:no-markers");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->kind, InjectKind::kNoMarkers);
  EXPECT_FALSE(ParseInjection("all_reduce-done:1").ok());
  EXPECT_FALSE(ParseInjection("allreduce-done:1:hang").ok());
  EXPECT_FALSE(ParseInjection("all_reduce-done:-1:hang").ok());
  EXPECT_FALSE(ParseInjection("all_reduce-done:1:explode").ok());
  EXPECT_FALSE(ParseInjection("all_reduce-done:1:hang:x").ok());
}

TEST(RankArgs, RoundTrip) {
  RankOptions o;
  o.rank = 3;
  o.world_size = 4;
  o.local_rank = 1;
  o.transport = Transport::kNccl;
  o.timeout_s = 2.5;
  o.bytes = 4096;
  o.iters = 7;
  o.marker_file = "/tmp/x/rank3.markers.jsonl";
  o.rdzv = {"10.1.2.3", 29500};
  o.injections = {*ParseInjection("teardown-done:3:exit")};
  o.run_id = "probe-x";
  auto p = ParseRankArgs(RankArgs(o));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->rank, 3);
  EXPECT_EQ(p->world_size, 4);
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_EQ(p->transport, Transport::kNccl);
  EXPECT_DOUBLE_EQ(p->timeout_s, 2.5);
  EXPECT_EQ(p->bytes, 4096u);
  EXPECT_EQ(p->iters, 7);
  EXPECT_EQ(p->marker_file, o.marker_file);
  EXPECT_EQ(p->rdzv.ToString(), "10.1.2.3:29500");
  ASSERT_EQ(p->injections.size(), 1u);
  EXPECT_EQ(p->injections[0].ToString(), "teardown-done:3:exit");
  EXPECT_FALSE(ParseRankArgs({"--rank", "0", "--world-size", "2", "--bogus", "1"}).ok());
}

// ---- the supervisor end to end (sim transport) ----

bool EnvironHasRunId(pid_t pid, const std::string& run_id) {
  std::ifstream f(fmt::format("/proc/{}/environ", pid), std::ios::binary);
  std::string env(std::istreambuf_iterator<char>(f), {});
  return env.find("DL_PROBE_RUN_ID=" + run_id) != std::string::npos;
}

// Processes (not zombies) whose environment carries this run's marker.
std::vector<pid_t> ProcessesOfRun(const std::string& run_id) {
  std::vector<pid_t> out;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    if (EnvironHasRunId(static_cast<pid_t>(pid), run_id) &&
        comm::ProcessIsRunning(static_cast<pid_t>(pid))) {
      out.push_back(static_cast<pid_t>(pid));
    }
  }
  ::closedir(d);
  return out;
}

class ProbeSimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("dl_probe_test_{}_{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }

  ProbeOptions Options(int ranks, std::vector<std::string> injections = {}) {
    ProbeOptions o;
    o.ranks = ranks;
    o.transport = Transport::kSim;
    o.timeout_s = kTimeout;
    o.bytes = 4096;
    o.iters = 3;
    o.log_dir = dir_.string();
    o.rank_exe = "/proc/self/exe";
    o.rank_argv_prefix = {"probe_test", "__probe-rank"};
    o.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    for (const std::string& s : injections) o.injections.push_back(*ParseInjection(s));
    return o;
  }

  // Runs the probe and checks what every run must satisfy: bounded time, every rank reaped, no
  // process of the run alive, a probe.json that agrees with the report, every rank log kept.
  ProbeReport Run(const ProbeOptions& o) {
    auto t0 = std::chrono::steady_clock::now();
    Result<ProbeReport> r = RunProbe(o);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return {};
    // Stage timeouts bound the run: at most one kill (timeout + grace) plus start-up.
    EXPECT_LT(s, 2 * kTimeout + 6) << "the probe took too long";
    EXPECT_EQ(r->pids.size(), static_cast<size_t>(o.ranks));
    for (pid_t pid : r->pids) {
      EXPECT_FALSE(comm::ProcessExists(pid))
          << "rank pid " << pid << " still exists (orphan/zombie)";
      int status = 0;
      EXPECT_EQ(::waitpid(pid, &status, WNOHANG), -1) << "pid " << pid << " was not reaped";
    }
    EXPECT_TRUE(ProcessesOfRun(r->run_id).empty())
        << "a process of run " << r->run_id << " is alive";
    std::ifstream f(dir_ / "probe.json");
    nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
    EXPECT_TRUE(j.is_object()) << "probe.json is missing or malformed";
    if (j.is_object()) {
      EXPECT_EQ(j.value("result", ""), ProbeClassName(r->cls));
      EXPECT_EQ(j.value("exit_code", -1), ProbeExitCode(r->cls));
      EXPECT_EQ(j.value("clean_teardowns", -1), r->clean_teardowns);
      EXPECT_EQ(j.value("transport", ""), "sim");
      EXPECT_EQ(j.value("result_line", ""), ResultLine(*r));
      EXPECT_EQ(j["rank_detail"].size(), static_cast<size_t>(o.ranks));
    }
    for (int rank = 0; rank < o.ranks; ++rank) {
      EXPECT_TRUE(std::filesystem::exists(dir_ / fmt::format("rank{}.log", rank)));
    }
    return *r;
  }

  void ExpectClass(const ProbeReport& r, ProbeClass cls, int exit_code, int clean, int n) {
    EXPECT_EQ(r.cls, cls) << r.reason;
    EXPECT_EQ(r.exit_code, exit_code);
    EXPECT_EQ(ResultLine(r), fmt::format("PROBE_RESULT={} clean_teardowns={}/{} transport=sim",
                                         ProbeClassName(cls), clean, n));
  }

  static constexpr double kTimeout = 2.0;
  std::filesystem::path dir_;
};

TEST_F(ProbeSimTest, Pass) {
  ProbeReport r = Run(Options(3));
  ExpectClass(r, ProbeClass::kPass, 0, 3, 3);
  // Every rank wrote all eight markers, in order, with non-decreasing monotonic time.
  for (int rank = 0; rank < 3; ++rank) {
    MarkerLog log = ReadMarkerLog((dir_ / fmt::format("rank{}.markers.jsonl", rank)).string());
    ASSERT_EQ(log.markers.size(), static_cast<size_t>(kNumStages)) << "rank " << rank;
    for (int k = 0; k < kNumStages; ++k) {
      EXPECT_EQ(log.markers[k].stage, static_cast<Stage>(k));
      if (k > 0) {
        EXPECT_GE(log.markers[k].t_mono_ns, log.markers[k - 1].t_mono_ns);
      }
    }
    EXPECT_EQ(log.markers[static_cast<int>(Stage::kResultChecked)].detail.value("result", ""),
              "ok");
    EXPECT_EQ(log.markers[0].detail.value("NCCL_NVLS_ENABLE", ""), "0");
  }
  EXPECT_TRUE(r.stats.measured);
  EXPECT_EQ(r.stats.wrong, 0);
  EXPECT_EQ(r.stats.count, 1024u);
  EXPECT_GT(r.stats.time_us, 0);
  // busbw = algbw * 2(n-1)/n.
  EXPECT_NEAR(r.stats.busbw_gbs, r.stats.algbw_gbs * 4.0 / 3.0, 1e-9);
}

TEST_F(ProbeSimTest, NotExecuted) {
  ExpectClass(Run(Options(2, {"import-done:1:no-markers"})), ProbeClass::kNotExecuted, 8, 1, 2);
}

TEST_F(ProbeSimTest, LaunchFailure) {
  ProbeReport r = Run(Options(2, {"import-done:1:exit"}));
  ExpectClass(r, ProbeClass::kLaunchFailure, 2, 0, 2);
  EXPECT_NE(r.reason.find("rank 1"), std::string::npos) << r.reason;
}

TEST_F(ProbeSimTest, LaunchFailureWhenTheRankBinaryIsMissing) {
  ProbeOptions o = Options(2);
  o.rank_exe = (dir_ / "no-such-binary").string();
  ExpectClass(Run(o), ProbeClass::kLaunchFailure, 2, 0, 2);
}

TEST_F(ProbeSimTest, InitStageFailureByHang) {
  ProbeReport r = Run(Options(2, {"comm-initialised:1:hang"}));
  ExpectClass(r, ProbeClass::kInitStageFailure, 3, 0, 2);
  EXPECT_TRUE(r.outcomes[1].killed_by_supervisor);
  EXPECT_EQ(r.outcomes[0].exit.code, kRankTimeoutExitCode);  // rank 0 gave up waiting by itself
}

TEST_F(ProbeSimTest, InitStageFailureByExit) {
  ExpectClass(Run(Options(2, {"comm-initialised:0:exit"})), ProbeClass::kInitStageFailure, 3, 0, 2);
}

TEST_F(ProbeSimTest, CollectiveStageFailure) {
  ProbeReport r = Run(Options(2, {"all_reduce-done:1:hang"}));
  ExpectClass(r, ProbeClass::kCollectiveStageFailure, 4, 0, 2);
  // "All started, none finished": both ranks reached all_reduce-start, neither all_reduce-done.
  for (const RankOutcome& o : r.outcomes) {
    EXPECT_TRUE(o.Has(Stage::kAllReduceStart));
    EXPECT_FALSE(o.Has(Stage::kAllReduceDone));
  }
  EXPECT_TRUE(r.outcomes[1].killed_by_supervisor);
  EXPECT_FALSE(r.stats.measured);
}

TEST_F(ProbeSimTest, ResultMismatch) {
  ProbeReport r = Run(Options(2, {"all_reduce-done:0:wrong-value"}));
  ExpectClass(r, ProbeClass::kResultMismatch, 5, 2, 2);
  EXPECT_EQ(r.stats.wrong, 2 * 1024);  // every element, on both ranks
}

TEST_F(ProbeSimTest, TeardownFailureByHang) {
  ProbeReport r = Run(Options(2, {"teardown-done:1:hang"}));
  ExpectClass(r, ProbeClass::kTeardownFailure, 6, 1, 2);
  EXPECT_TRUE(r.outcomes[1].killed_by_supervisor);
}

TEST_F(ProbeSimTest, TeardownFailureByExit) {
  ExpectClass(Run(Options(2, {"teardown-done:0:exit"})), ProbeClass::kTeardownFailure, 6, 1, 2);
}

TEST_F(ProbeSimTest, StaleMarkersFromAnEarlierRunAreIgnored) {
  std::filesystem::create_directories(dir_);
  {
    std::ofstream stale(dir_ / "rank1.markers.jsonl");
    for (int k = 0; k < kNumStages; ++k) {
      stale << fmt::format(R"({{"event":"marker","stage":"{}","rank":1,"t_mono_ns":1}})",
                           StageName(static_cast<Stage>(k)))
            << "\n";
    }
  }
  ExpectClass(Run(Options(2, {"import-done:1:exit"})), ProbeClass::kLaunchFailure, 2, 0, 2);
}

TEST_F(ProbeSimTest, RejectsBadOptions) {
  ProbeOptions o = Options(0);
  EXPECT_EQ(RunProbe(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(2, {"all_reduce-done:2:hang"});
  auto r = RunProbe(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("rank 2 does not exist"), std::string::npos);
  o = Options(2);
  o.nnodes = 2;
  EXPECT_EQ(RunProbe(o).status().code(), StatusCode::kInvalidArgument);  // no master address
}

// Two "hosts" on this machine: one supervisor per host, host 0's rank 0 holds the rendezvous port,
// global ranks are node_rank * ranks + local index, each host writes its own probe.node<K>.json.
TEST_F(ProbeSimTest, TwoSupervisorsFormOneWorld) {
  auto l = comm::Listen("127.0.0.1", 0);  // find a free port, then free it for host 0
  ASSERT_TRUE(l.ok());
  int port = l->port;
  ::close(l->fd);
  ProbeOptions host[2] = {Options(2), Options(2)};
  Result<ProbeReport> result[2] = {Internal("not run"), Internal("not run")};
  std::vector<std::thread> threads;
  for (int k = 0; k < 2; ++k) {
    host[k].nnodes = 2;
    host[k].node_rank = k;
    host[k].master = comm::Endpoint{"127.0.0.1", port};
    threads.emplace_back([&, k] { result[k] = RunProbe(host[k]); });
  }
  for (auto& t : threads) t.join();
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(result[k].ok()) << result[k].status().ToString();
    EXPECT_EQ(result[k]->cls, ProbeClass::kPass) << result[k]->reason;
    EXPECT_EQ(ResultLine(*result[k]), "PROBE_RESULT=PASS clean_teardowns=2/2 transport=sim");
    EXPECT_TRUE(std::filesystem::exists(dir_ / fmt::format("probe.node{}.json", k)));
    EXPECT_EQ(result[k]->outcomes[0].rank, 2 * k);
    for (pid_t pid : result[k]->pids) EXPECT_FALSE(comm::ProcessExists(pid));
  }
  // A world of 4: every rank's sum covers four contributions (checked by each rank as ok above).
  MarkerLog log = ReadMarkerLog((dir_ / "rank3.markers.jsonl").string());
  ASSERT_FALSE(log.markers.empty());
  EXPECT_EQ(log.markers[0].detail.value("world_size", 0), 4);
}

// The nccl transport where there is no GPU (CI) or no NCCL: a classification, not a crash.
TEST_F(ProbeSimTest, NcclWithoutGpuIsClassifiedNotACrash) {
  // Only meaningful where no GPU is usable (CI); with one GPU the ranks fail differently, with two
  // the GPU check (tools/device/gpu_all.sh) runs the real probe.
  if (cuda::DeviceCount() >= 1) GTEST_SKIP() << "a GPU is present: this test is about machines without one";
  ProbeOptions o = Options(2);
  o.transport = Transport::kNccl;
  Result<ProbeReport> r = RunProbe(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->cls, ProbeClass::kInitStageFailure) << r->reason;
  EXPECT_EQ(r->exit_code, 3);
  EXPECT_EQ(ResultLine(*r), "PROBE_RESULT=INIT_STAGE_FAILURE clean_teardowns=0/2");
  for (const RankOutcome& out : r->outcomes) {
    EXPECT_TRUE(out.Has(Stage::kImportDone));
    EXPECT_FALSE(out.Has(Stage::kCommInitialised));
    EXPECT_TRUE(out.exit.exited) << "rank " << out.rank << " crashed: " << out.exit.ToString();
    EXPECT_EQ(out.exit.code, 1);
    EXPECT_FALSE(out.error.empty());
  }
  for (pid_t pid : r->pids) EXPECT_FALSE(comm::ProcessExists(pid));
}

// The real binary's CLI, when it has been built (it is the same library underneath).
TEST(ProbeCli, HelpAndSimRunThroughDecodelab) {
  std::string bin = std::string(DECODELAB_BINARY_DIR) + "/bin/decodelab";
  if (!std::filesystem::exists(bin)) GTEST_SKIP() << bin << " not built";
  auto run = [](const std::string& cmd, std::string* out) {
    FILE* p = ::popen(cmd.c_str(), "r");
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
    int status = ::pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  std::string help;
  EXPECT_EQ(run(bin + " probe --help", &help), 0);
  for (const char* flag : {"--ranks", "--timeout-s", "--bytes", "--iters", "--log-dir",
                           "--transport", "--inject", "PROBE_RESULT"}) {
    EXPECT_NE(help.find(flag), std::string::npos) << flag << " missing from --help:\n" << help;
  }
  std::string root_help;
  run(bin + " --help", &root_help);
  EXPECT_EQ(root_help.find("__probe-rank"), std::string::npos)
      << "the rank subcommand must be hidden";
  std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("dl_probe_cli_{}", ::getpid()))
          .string();
  std::string out;
  int code = run(bin +
                     " probe --ranks 2 --transport sim --timeout-s 2 --bytes 4096 --iters 2 "
                     "--inject all_reduce-done:0:wrong-value --log-dir " +
                     dir + " 2>/dev/null",
                 &out);
  EXPECT_EQ(code, 5) << out;
  EXPECT_NE(out.find("PROBE_RESULT=RESULT_MISMATCH clean_teardowns=2/2 transport=sim\n"),
            std::string::npos)
      << out;
  EXPECT_TRUE(std::filesystem::exists(dir + "/probe.json"));
  std::string bad;
  EXPECT_NE(run(bin + " probe --transport sim --inject nonsense 2>&1", &bad), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dl::lab

// The rank processes are this binary: `probe_test __probe-rank ...`.
int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "__probe-rank") {
    auto o = dl::lab::ParseRankArgs(std::vector<std::string>(argv + 2, argv + argc));
    if (!o.ok()) {
      std::fprintf(stderr, "error: %s\n", o.status().message().c_str());
      return 2;
    }
    int code = dl::lab::RunProbeRank(*o);
    std::fflush(nullptr);
    ::_exit(code);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
