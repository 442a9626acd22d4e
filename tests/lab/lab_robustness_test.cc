// The lab against hostile input (issue 21): paths and plan fields with shell metacharacters are
// never interpreted by a shell, every wait on a child is bounded, and filesystem errors become
// messages instead of aborts. The binary is run with an argument vector here too, so the test's
// own harness cannot be the one that interprets a quote.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "comm/process.h"
#include "lab/lab_suite.h"

namespace dl::lab {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct CmdRun {
  int rc = -1;  // -1: killed by the timeout or a signal
  std::string out;
  double seconds = 0;
};

CmdRun Decodelab(const std::vector<std::string>& args, const std::string& log, double timeout_s = 300) {
  comm::SpawnSpec spec;
  // DECODELAB_TEST_BINARY runs these cases against another build (e.g. an older one).
  const char* other = std::getenv("DECODELAB_TEST_BINARY");
  spec.exe = other && *other ? other : DECODELAB_EXE;
  spec.argv = {spec.exe};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.env = comm::EnvironmentWith({});
  spec.output_path = log;
  CmdRun r;
  const auto t0 = Clock::now();
  auto exit = comm::RunToCompletion(spec, timeout_s);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (exit.ok() && exit->exited) r.rc = exit->code;
  std::ifstream in(log);
  r.out = std::string(std::istreambuf_iterator<char>(in), {});
  if (!exit.ok()) r.out += "\n" + exit.status().message();
  return r;
}

class LabRobustness : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/decodelab-lab-robust-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    // A suite with an FP8 cache: the lab runs `decodelab calibrate` for it.
    suite_ = root_ / "suite.json";
    json suite = {{"format", "decodelab-lab-suite"},
                  {"version", 1},
                  {"name", "robust"},
                  {"screen_tokens", 4},
                  {"suite_tokens", 4},
                  {"kv_dtype", "fp8"},
                  {"checks", {"exactness"}},
                  {"prompts", {{{"name", "a"}, {"token_ids", {5, 17, 42, 99}}}}}};
    ASSERT_TRUE(WriteTextFile(suite_.string(), suite.dump(1)).ok());
    // An F32 cache with a named calibration: the lab runs no calibration, the binary is served at
    // once.
    suite["kv_dtype"] = "f32";
    suite["calibration"] = "unused-scales.json";
    std::ofstream(root_ / "unused-scales.json") << "{}";
    suite_f32_ = root_ / "suite-f32.json";
    ASSERT_TRUE(WriteTextFile(suite_f32_.string(), suite.dump(1)).ok());
    // A "binary" that never becomes ready.
    hang_ = root_ / "hang.sh";
    std::ofstream(hang_) << "#!/bin/sh\nexec sleep 1000\n";
    fs::permissions(hang_, fs::perms::owner_all);
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  static std::string Log(const std::string& name) { return (root_ / (name + ".log")).string(); }
  static fs::path root_, suite_, suite_f32_, hang_;
};
fs::path LabRobustness::root_, LabRobustness::suite_, LabRobustness::suite_f32_,
    LabRobustness::hang_;

TEST_F(LabRobustness, ShellMetacharactersInPathsAndPlansAreNeverExecuted) {
  // A model directory whose name closes the old single quotes and runs a command.
  const fs::path marker1 = root_ / "PWNED-model";
  const fs::path model = root_ / ("m';touch " + marker1.string() + ";'");
  CmdRun mk = Decodelab({"make-model", "--shape", "tiny", "--seed", "3", "--out", model.string()},
                     Log("make-model"));
  ASSERT_EQ(mk.rc, 0) << mk.out;
  CmdRun screen = Decodelab({"lab", "screen", "--backend", "cpu", "--model", model.string(), "--suite",
                          suite_.string(), "--cache-dir", (root_ / "cache-inject").string(),
                          "--runs-dir", (root_ / "runs-inject").string()},
                         Log("screen-inject"));
  EXPECT_FALSE(fs::exists(marker1)) << "the model path was run by a shell:\n" << screen.out;
  // Calibration ran on that very path (it is what used to go through the shell).
  EXPECT_TRUE(fs::exists(root_ / "cache-inject" / "calibration")) << screen.out;

  // A plan whose control binary is an injection: the probe step used popen on it.
  const fs::path marker2 = root_ / "PWNED-plan";
  const json plan = {{"format", "decodelab-lab-plan"},
                     {"suite", suite_.string()},
                     {"control", {{"binary", "x';touch " + marker2.string() + ";'"}}},
                     {"candidate", json::object()},
                     {"probe", {{"transport", "sim"}, {"ranks", 2}}}};
  const fs::path plan_path = root_ / "plan.json";
  ASSERT_TRUE(WriteTextFile(plan_path.string(), plan.dump(1)).ok());
  CmdRun gate = Decodelab({"lab", "gate", plan_path.string(), "--backend", "cpu", "--runs-dir",
                        (root_ / "runs-gate").string(), "--cache-dir",
                        (root_ / "cache-gate").string()},
                       Log("gate-inject"));
  EXPECT_FALSE(fs::exists(marker2)) << "the plan's binary was run by a shell:\n" << gate.out;
  EXPECT_NE(gate.rc, 0) << gate.out;
  EXPECT_NE(gate.out.find("GATE_RESULT=STOPPED step=probe"), std::string::npos) << gate.out;
}

TEST_F(LabRobustness, BinaryThatNeverBecomesReadyIsBoundedEverywhere) {
  // Calibration runs the binary first: bounded by --step-timeout.
  CmdRun cal = Decodelab({"lab", "screen", "--backend", "cpu", "--binary", hang_.string(), "--suite",
                       suite_.string(), "--cache-dir", (root_ / "cache-hang").string(),
                       "--runs-dir", (root_ / "runs-hang").string(), "--step-timeout", "2",
                       "--start-timeout", "2"},
                      Log("hang-calibrate"), 120);
  EXPECT_GT(cal.rc, 0) << cal.out;
  EXPECT_LT(cal.seconds, 30) << cal.out;
  EXPECT_NE(cal.out.find("did not finish within 2 s"), std::string::npos) << cal.out;
  // Serving it: bounded by --start-timeout.
  CmdRun teacher = Decodelab({"lab", "teacher", "--backend", "cpu", "--binary", hang_.string(),
                           "--suite", suite_f32_.string(), "--teacher",
                           (root_ / "hang-teacher.json").string(), "--cache-dir",
                           (root_ / "cache-hang").string(), "--start-timeout", "2"},
                          Log("hang-serve"), 120);
  EXPECT_GT(teacher.rc, 0) << teacher.out;
  EXPECT_LT(teacher.seconds, 30) << teacher.out;
  EXPECT_NE(teacher.out.find("within 2 s"), std::string::npos) << teacher.out;
  // The gate's probe of the plan binary: bounded by --step-timeout.
  const json plan = {{"format", "decodelab-lab-plan"},
                     {"suite", suite_f32_.string()},
                     {"control", {{"binary", hang_.string()}}},
                     {"candidate", json::object()},
                     {"probe", {{"transport", "sim"}, {"ranks", 2}}}};
  const fs::path plan_path = root_ / "hang-plan.json";
  ASSERT_TRUE(WriteTextFile(plan_path.string(), plan.dump(1)).ok());
  CmdRun gate = Decodelab({"lab", "gate", plan_path.string(), "--backend", "cpu", "--runs-dir",
                        (root_ / "runs-hang-gate").string(), "--step-timeout", "2"},
                       Log("hang-gate"), 120);
  EXPECT_GT(gate.rc, 0) << gate.out;
  EXPECT_LT(gate.seconds, 30) << gate.out;
  EXPECT_NE(gate.out.find("GATE_RESULT=STOPPED step=probe"), std::string::npos) << gate.out;
}

TEST_F(LabRobustness, FilesystemErrorsAreMessagesNotAborts) {
  // A 300-character label used to abort with an uncaught filesystem_error.
  CmdRun label = Decodelab({"lab", "screen", "--backend", "cpu", "--suite", suite_f32_.string(),
                         "--cache-dir", (root_ / "cache-label").string(), "--runs-dir",
                         (root_ / "runs-label").string(), "--label", std::string(300, 'L')},
                        Log("label"));
  EXPECT_EQ(label.rc, 2) << label.out;
  EXPECT_NE(label.out.find("--label"), std::string::npos) << label.out;
  // A runs directory that is a file.
  const fs::path file = root_ / "not-a-dir";
  std::ofstream(file) << "x";
  CmdRun runs = Decodelab({"lab", "runs", "--runs-dir", file.string()}, Log("runs-file"));
  EXPECT_GT(runs.rc, 0) << runs.out;
  EXPECT_NE(runs.out.find("error:"), std::string::npos) << runs.out;
  CmdRun report = Decodelab({"lab", "report", "--runs-dir", file.string()}, Log("report-file"));
  EXPECT_GT(report.rc, 0) << report.out;
  EXPECT_NE(report.out.find("error:"), std::string::npos) << report.out;
}


TEST_F(LabRobustness, AMissingTeacherNamedByTheSuiteIsAnError) {
  // The default model records its own teacher when none is cached; a teacher the suite names must
  // exist instead of being recorded from the binary under test (which would pass any run).
  const fs::path missing = root_ / "no-such-teacher.json";
  json suite = json::parse(*ReadTextFile(suite_f32_.string()));
  suite["teacher"] = missing.string();
  const fs::path path = root_ / "suite-missing-teacher.json";
  ASSERT_TRUE(WriteTextFile(path.string(), suite.dump(1)).ok());
  CmdRun r = Decodelab({"lab", "screen", "--backend", "cpu", "--suite", path.string(), "--cache-dir",
                        (root_ / "cache-missing").string(), "--runs-dir",
                        (root_ / "runs-missing").string()},
                       Log("missing-teacher"));
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("does not exist"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(missing)) << "the missing teacher was recorded";
  // Likewise with --teacher.
  CmdRun t = Decodelab({"lab", "screen", "--backend", "cpu", "--suite", suite_f32_.string(),
                        "--teacher", missing.string(), "--cache-dir",
                        (root_ / "cache-missing").string(), "--runs-dir",
                        (root_ / "runs-missing").string()},
                       Log("missing-teacher-flag"));
  EXPECT_NE(t.rc, 0) << t.out;
  EXPECT_FALSE(fs::exists(missing));
}


TEST_F(LabRobustness, AKilledRunIsListedAsIncomplete) {
  // A run whose server never becomes ready is killed (-9) while it waits: the partial directory
  // must say so, and `lab runs` and the report must show it.
  const fs::path teacher = root_ / "empty-teacher.json";
  ASSERT_TRUE(WriteTextFile(teacher.string(),
                            json{{"format", "decodelab-teacher"}, {"prompts", json::array()}}.dump())
                  .ok());
  const fs::path runs = root_ / "runs-killed";
  comm::SpawnSpec spec;
  spec.exe = DECODELAB_EXE;
  spec.argv = {spec.exe,       "lab",           "screen",          "--backend", "cpu",
               "--binary",     hang_.string(),  "--suite",         suite_f32_.string(),
               "--teacher",    teacher.string(), "--runs-dir",     runs.string(),
               "--label",      "killed",        "--cache-dir",     (root_ / "cache-killed").string()};
  spec.env = comm::EnvironmentWith({});
  spec.output_path = Log("killed");
  auto child = comm::ChildProcess::Spawn(spec);
  ASSERT_TRUE(child.ok()) << child.status().message();
  // Wait until the run directory exists, then kill the lab without warning.
  const auto t0 = Clock::now();
  bool started = false;
  while (!started && std::chrono::duration<double>(Clock::now() - t0).count() < 60) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(runs, ec)) {
      if (e.path().filename().string().rfind("killed-", 0) == 0) started = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(started);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  child->KillAndReap();

  CmdRun list = Decodelab({"lab", "runs", "--runs-dir", runs.string()}, Log("killed-runs"));
  EXPECT_EQ(list.rc, 0) << list.out;
  EXPECT_NE(list.out.find("INCOMPLETE"), std::string::npos) << list.out;
  EXPECT_NE(list.out.find("killed-"), std::string::npos) << list.out;
  const fs::path html = root_ / "killed-report.html";
  CmdRun report = Decodelab({"lab", "report", "--runs-dir", runs.string(), "--out", html.string()},
                            Log("killed-report"));
  ASSERT_EQ(report.rc, 0) << report.out;
  const std::string text = *ReadTextFile(html.string());
  EXPECT_NE(text.find("id=\"incomplete-runs\""), std::string::npos);
  EXPECT_NE(text.find("killed-"), std::string::npos);
}

}  // namespace
}  // namespace dl::lab
