// `decodelab lab` end to end on the CPU backend: a short suite (6 prompts, M = 16/20) passes every
// check, and each check fails when it must (wrong teacher, prefix-cache hit, wrong scales, changed
// binary). Topology and fallback cannot happen on the CPU backend; they are covered through
// recorded /v1/decodelab/state JSON in src/lab/lab_checks_test.cc.
#include <unistd.h>

#include <chrono>
#include <cstdio>
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

struct Cmd {
  int rc = -1;
  std::string out;
};

Cmd Decodelab(const std::string& args) {
  const std::string cmd = std::string("'") + DECODELAB_EXE + "' " + args + " 2>&1";
  Cmd c;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return c;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) c.out.append(buf, n);
  const int st = pclose(p);
  c.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return c;
}

json ReadJson(const fs::path& p) {
  auto t = ReadTextFile(p.string());
  EXPECT_TRUE(t.ok()) << p;
  return t.ok() ? json::parse(*t) : json();
}

void WriteJson(const fs::path& p, const json& j) {
  ASSERT_TRUE(WriteTextFile(p.string(), j.dump(1)).ok());
}

// The only run directory under `runs` (tests use one runs dir per run unless they want more).
std::vector<fs::path> RunDirs(const fs::path& runs) {
  std::vector<fs::path> d;
  if (!fs::exists(runs)) return d;
  for (const auto& e : fs::directory_iterator(runs)) {
    if (e.is_directory()) d.push_back(e.path());
  }
  std::sort(d.begin(), d.end());
  return d;
}

std::map<std::string, std::string> CheckStatuses(const fs::path& run) {
  std::map<std::string, std::string> m;
  for (const auto& r : ReadJson(run / "checks.json")) m[r["name"]] = r["status"];
  return m;
}

class LabE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/decodelab-lab-e2e-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    suite_ = root_ / "short.json";
    WriteJson(suite_, ShortSuite());
    teacher_ = root_ / "teacher.json";
    Cmd c = Decodelab("lab teacher --backend cpu " + Common() + " --teacher '" + teacher_.string() +
                      "'");
    ASSERT_EQ(c.rc, 0) << c.out;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  static json ShortSuite() {
    return {{"format", "decodelab-lab-suite"},
            {"name", "short"},
            {"screen_tokens", 16},
            {"suite_tokens", 20},
            {"kv_dtype", "fp8"},
            {"prompts",
             {{{"name", "a"}, {"token_ids", {5, 17, 42, 99, 7, 300}}},
              {{"name", "b"}, {"token_ids", SyntheticPromptIds(21, 2, 500)}},
              {{"name", "c"}, {"token_ids", SyntheticPromptIds(40, 3, 500)}},
              {{"name", "text"}, {"text", "The lab checks every token."}},
              {{"name", "boundary"}, {"kind", "boundary"}, {"computed", true}},
              {{"name", "rollover"}, {"kind", "rollover"}, {"computed", true}}}}};
  }
  static std::string Common() {
    return "--suite '" + suite_.string() + "' --cache-dir '" + (root_ / "cache").string() + "'";
  }
  static std::string Screen(const std::string& runs, const std::string& extra = "") {
    return "lab screen --backend cpu " + Common() + " --runs-dir '" + (root_ / runs).string() +
           "' " + extra;
  }
  static fs::path root_, suite_, teacher_;
};
fs::path LabE2E::root_, LabE2E::suite_, LabE2E::teacher_;

TEST_F(LabE2E, ScreenPassesEveryCheckAndWritesArtifacts) {
  Cmd c = Decodelab(Screen("ok", "--teacher '" + teacher_.string() + "' --label ok"));
  ASSERT_EQ(c.rc, 0) << c.out;
  auto dirs = RunDirs(root_ / "ok");
  ASSERT_EQ(dirs.size(), 1u);
  const fs::path run = dirs[0];
  EXPECT_EQ(run.filename().string().rfind("ok-", 0), 0u) << run;
  for (const char* f : {"manifest.json", "requests.jsonl", "responses.jsonl", "timings.csv",
                        "checks.json", "summary.json", "server.log"}) {
    EXPECT_TRUE(fs::exists(run / f)) << f;
  }
  EXPECT_FALSE(fs::exists(run / "INCOMPLETE")) << "a finished run keeps its incomplete marker";
  auto st = CheckStatuses(run);
  for (const char* n : {"identity", "no_fallback", "scale_audit", "exactness", "no_prefix_cache",
                        "boundary", "rollover"}) {
    EXPECT_EQ(st[n], "PASS") << n << "\n" << c.out;
  }
  // The CPU backend has no captured graph and no kernel presets: never a PASS.
  EXPECT_EQ(st["topology"], "NOT_APPLICABLE");
  EXPECT_EQ(st["kernel_presets"], "NOT_APPLICABLE");
  json s = ReadJson(run / "summary.json");
  EXPECT_EQ(s["valid"], true);
  EXPECT_EQ(s["exact"], 6);
  EXPECT_EQ(s["prompts"], 6);
  EXPECT_GT(s["decode_tok_s_conventional_99_interval_median"].get<double>(), 0);
  EXPECT_GT(s["decode_tok_s_historical_100_event_median"].get<double>(), 0);
  json m = ReadJson(run / "manifest.json");
  EXPECT_EQ(m["ignore_eos"], true);
  EXPECT_EQ(m["binary_sha256"].get<std::string>().size(), 64u);
  EXPECT_FALSE(m["boot_id"].get<std::string>().empty());
  EXPECT_EQ(m["suite_sha256"].get<std::string>().size(), 64u);
  // Every generated token has a timing row: 6 prompts x 16 tokens + the header.
  std::ifstream csv(run / "timings.csv");
  int lines = 0;
  for (std::string l; std::getline(csv, l);) ++lines;
  EXPECT_EQ(lines, 6 * 16 + 1);
  EXPECT_NE(c.out.find("decode tok/s"), std::string::npos);
}

TEST_F(LabE2E, WrongTeacherFailsExactnessBoundaryAndRollover) {
  json t = ReadJson(teacher_);
  for (auto& p : t["prompts"]) {
    if (p["name"] == "b") p["tokens"][3] = (p["tokens"][3].get<int>() + 1) % 500;
    if (p["name"] == "rollover") p["tokens"][0] = (p["tokens"][0].get<int>() + 1) % 500;
    if (p["name"] == "boundary") p["next"]["16"] = (p["next"]["16"].get<int>() + 1) % 500;
  }
  const fs::path wrong = root_ / "wrong-teacher.json";
  WriteJson(wrong, t);
  Cmd c = Decodelab(Screen("wrong-teacher", "--teacher '" + wrong.string() + "'"));
  EXPECT_NE(c.rc, 0) << c.out;
  auto dirs = RunDirs(root_ / "wrong-teacher");
  ASSERT_EQ(dirs.size(), 1u);
  auto st = CheckStatuses(dirs[0]);
  EXPECT_EQ(st["exactness"], "FAIL");
  EXPECT_EQ(st["boundary"], "FAIL");
  EXPECT_EQ(st["rollover"], "FAIL");
  EXPECT_EQ(st["scale_audit"], "PASS");
  EXPECT_EQ(ReadJson(dirs[0] / "summary.json")["exact"], 4);
}

TEST_F(LabE2E, PrefixCacheHitFails) {
  // Two prompts share 40 tokens; with prefix caching on, the second reuses cached pages.
  json suite = ShortSuite();
  suite["prompts"] = {{{"name", "c"}, {"token_ids", SyntheticPromptIds(40, 3, 500)}},
                      {{"name", "c-again"}, {"token_ids", SyntheticPromptIds(40, 3, 500)}}};
  suite["checks"] = {"exactness", "no_prefix_cache"};
  const fs::path s = root_ / "cached.json";
  WriteJson(s, suite);
  const std::string common =
      "--backend cpu --suite '" + s.string() + "' --cache-dir '" + (root_ / "cache").string() + "'";
  const fs::path t = root_ / "cached-teacher.json";
  Cmd rec = Decodelab("lab teacher " + common + " --teacher '" + t.string() + "'");
  ASSERT_EQ(rec.rc, 0) << rec.out;
  Cmd c = Decodelab("lab screen " + common + " --teacher '" + t.string() + "' --runs-dir '" +
                    (root_ / "cached").string() + "' -- --enable-prefix-caching");
  EXPECT_NE(c.rc, 0) << c.out;
  auto dirs = RunDirs(root_ / "cached");
  ASSERT_EQ(dirs.size(), 1u);
  auto st = CheckStatuses(dirs[0]);
  EXPECT_EQ(st["no_prefix_cache"], "FAIL") << c.out;
  EXPECT_EQ(st["exactness"], "PASS");
}

TEST_F(LabE2E, ScalesDifferingFromTheCalibrationFileFail) {
  // A server started with a scales file one layer differs from; the suite names the original.
  fs::path cal;
  for (const auto& e : fs::directory_iterator(root_ / "cache" / "calibration")) cal = e.path();
  ASSERT_FALSE(cal.empty());
  json scales = ReadJson(cal);
  scales["layers"][2]["k_scale"] = scales["layers"][2]["k_scale"].get<double>() * 2;
  scales["layers"][2].erase("k_scale_bits");
  const fs::path other = root_ / "other-scales.json";
  WriteJson(other, scales);
  json suite = ShortSuite();
  suite["calibration"] = cal.string();
  suite["checks"] = {"identity", "no_fallback", "scale_audit"};
  const fs::path s = root_ / "scales-suite.json";
  WriteJson(s, suite);

  comm::SpawnSpec spec;
  spec.exe = DECODELAB_EXE;
  spec.argv = {
      DECODELAB_EXE, "serve", "--model",     (root_ / "cache" / "models" / "tiny-seed11").string(),
      "--backend",   "cpu",   "--port",      "0",
      "--kv-dtype",  "fp8",   "--kv-scales", other.string()};
  spec.env = comm::EnvironmentWith({});
  spec.output_path = (root_ / "serve.log").string();
  auto child = comm::ChildProcess::Spawn(spec);
  ASSERT_TRUE(child.ok()) << child.status().message();
  std::string url;
  for (int i = 0; i < 2400 && url.empty() && !child->Poll(); ++i) {  // up to 120 s
    auto log = ReadTextFile(spec.output_path);
    const size_t at = log.ok() ? log->find("ready at ") : std::string::npos;
    if (at != std::string::npos && log->find('\n', at) != std::string::npos) {
      url = log->substr(at + 9, log->find('\n', at) - at - 9);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ASSERT_FALSE(url.empty()) << "decodelab serve printed no URL (see " << spec.output_path << ")";
  Cmd c = Decodelab("lab screen --backend cpu --suite '" + s.string() + "' --cache-dir '" +
                    (root_ / "cache").string() + "' --teacher '" + teacher_.string() +
                    "' --runs-dir '" + (root_ / "scales").string() + "' --endpoint " + url);
  child->KillAndReap();
  EXPECT_NE(c.rc, 0) << c.out;
  auto dirs = RunDirs(root_ / "scales");
  ASSERT_EQ(dirs.size(), 1u);
  auto st = CheckStatuses(dirs[0]);
  EXPECT_EQ(st["scale_audit"], "FAIL") << c.out;
  EXPECT_EQ(st["identity"], "PASS");
}

TEST_F(LabE2E, ChangedBinaryRefusesToStartUnlessAccepted) {
  // A lock taken on another binary stands in for "the engine binary changed since the lock".
  const fs::path lock = root_ / "other.lock";
  Cmd l = Decodelab("lab lock --binary /bin/sh --out '" + lock.string() + "'");
  ASSERT_EQ(l.rc, 0) << l.out;
  Cmd c = Decodelab(
      Screen("locked", "--teacher '" + teacher_.string() + "' --lock '" + lock.string() + "'"));
  EXPECT_NE(c.rc, 0) << c.out;
  EXPECT_EQ(c.out.find("decode tok/s"), std::string::npos) << "an invalid run printed a speed";
  auto dirs = RunDirs(root_ / "locked");
  ASSERT_EQ(dirs.size(), 1u);
  EXPECT_EQ(CheckStatuses(dirs[0])["identity"], "INVALID");
  EXPECT_FALSE(fs::exists(dirs[0] / "server.log")) << "the server must not start";
  json s = ReadJson(dirs[0] / "summary.json");
  EXPECT_EQ(s["valid"], false);
  EXPECT_TRUE(s["decode_tok_s_conventional_99_interval_median"].is_null());

  Cmd a = Decodelab(Screen("accepted", "--teacher '" + teacher_.string() + "' --lock '" +
                                           lock.string() + "' --accept-identity"));
  EXPECT_EQ(a.rc, 0) << a.out;
  auto adirs = RunDirs(root_ / "accepted");
  ASSERT_EQ(adirs.size(), 1u);
  EXPECT_EQ(ReadJson(adirs[0] / "manifest.json")["accept_identity"], true);

  // A lock of this very binary passes.
  const fs::path self_lock = root_ / "self.lock";
  ASSERT_EQ(Decodelab("lab lock --out '" + self_lock.string() + "'").rc, 0);
  Cmd ok = Decodelab(Screen(
      "self-locked", "--teacher '" + teacher_.string() + "' --lock '" + self_lock.string() + "'"));
  EXPECT_EQ(ok.rc, 0) << ok.out;
}

TEST_F(LabE2E, SuiteRunsTwiceAndTheLedgerCompares) {
  const std::string runs = (root_ / "suite").string();
  Cmd c = Decodelab("lab suite --backend cpu " + Common() + " --teacher '" + teacher_.string() +
                    "' --runs-dir '" + runs + "' --label twice");
  ASSERT_EQ(c.rc, 0) << c.out;
  EXPECT_NE(c.out.find("repeat spread"), std::string::npos) << c.out;
  auto dirs = RunDirs(runs);
  ASSERT_EQ(dirs.size(), 2u);
  for (const auto& d : dirs) EXPECT_EQ(ReadJson(d / "summary.json")["max_tokens"], 20);
  Cmd list = Decodelab("lab runs --runs-dir '" + runs + "'");
  EXPECT_EQ(list.rc, 0) << list.out;
  EXPECT_NE(list.out.find(dirs[0].filename().string()), std::string::npos) << list.out;
  EXPECT_NE(list.out.find(dirs[1].filename().string()), std::string::npos) << list.out;
  Cmd cmp = Decodelab("lab compare --runs-dir '" + runs + "' " + dirs[0].filename().string() + " " +
                      dirs[1].filename().string());
  EXPECT_EQ(cmp.rc, 0) << cmp.out;
  EXPECT_NE(cmp.out.find("difference"), std::string::npos) << cmp.out;
  Cmd bad = Decodelab("lab compare --runs-dir '" + runs + "' twice nope");
  EXPECT_NE(bad.rc, 0);

  // The report: one self-contained HTML file naming both runs, with charts and the check tables.
  const fs::path html = root_ / "report.html";
  // Without the Vega-Lite bundles (lab_report_test covers the charts with them): inline SVG.
  Cmd rep = Decodelab("lab report --runs-dir '" + runs + "' --out '" + html.string() +
                      "' --bundles '" + (root_ / "no-bundles").string() + "'");
  ASSERT_EQ(rep.rc, 0) << rep.out;
  auto text = ReadTextFile(html.string());
  ASSERT_TRUE(text.ok());
  for (const auto& d : dirs) EXPECT_NE(text->find(d.filename().string()), std::string::npos);
  EXPECT_NE(text->find("<svg"), std::string::npos);
  EXPECT_NE(text->find("exactness"), std::string::npos);
  EXPECT_EQ(text->find("<script"), std::string::npos);
  EXPECT_NE(text->find("charts missing: Vega-Lite bundles not found"), std::string::npos);
  EXPECT_EQ(text->find("src=\"http"), std::string::npos) << "the report must open offline";
  EXPECT_EQ(text->find("href=\"http"), std::string::npos) << "the report must open offline";
}

TEST_F(LabE2E, GateStopsAtAFailedStepAndResumes) {
  // The candidate's lock names another binary: the gate stops at candidate_screen.
  const fs::path lock = root_ / "gate-other.lock";
  ASSERT_EQ(Decodelab("lab lock --binary /bin/sh --out '" + lock.string() + "'").rc, 0);
  const fs::path plan = root_ / "plan.json";
  json p = {{"format", "decodelab-lab-plan"},
            {"suite", suite_.string()},
            {"control", json::object()},
            {"candidate", {{"lock", lock.string()}}},
            {"probe", {{"transport", "sim"}, {"ranks", 2}}}};
  WriteJson(plan, p);
  const std::string runs = (root_ / "gate").string();
  const std::string common = "lab gate '" + plan.string() + "' --backend cpu --cache-dir '" +
                             (root_ / "cache").string() + "' --runs-dir '" + runs + "'";
  Cmd c = Decodelab(common);
  EXPECT_EQ(c.rc, 3) << c.out;
  EXPECT_NE(c.out.find("GATE_RESULT=STOPPED step=candidate_screen"), std::string::npos) << c.out;
  auto gates = RunDirs(fs::path(runs) / "gates");
  ASSERT_EQ(gates.size(), 1u);
  json g = ReadJson(gates[0] / "gate.json");
  ASSERT_EQ(g["steps"].size(), 5u);
  EXPECT_EQ(g["steps"][0]["status"], "NOT_APPLICABLE");  // no GPU on the CPU backend
  EXPECT_EQ(g["steps"][1]["status"], "SIMULATED");       // the sim probe is never a PASS
  EXPECT_EQ(g["steps"][3]["status"], "PASS");
  EXPECT_EQ(g["steps"][4]["status"], "INVALID");
  const std::string control_run = g["steps"][3]["run_ids"][0];

  // Fix the plan, resume: the passed steps are kept, the candidate runs, the gate finishes.
  p["candidate"] = json::object();
  WriteJson(plan, p);
  Cmd r = Decodelab(common + " --resume");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("GATE_RESULT="), std::string::npos);
  json g2 = ReadJson(gates[0] / "gate.json");
  ASSERT_EQ(g2["steps"].size(), 7u) << g2.dump(1);
  EXPECT_EQ(g2["steps"][3]["run_ids"][0], control_run);
  EXPECT_EQ(g2["steps"][4]["status"], "PASS");
  const std::string suite_status = g2["steps"][5]["status"];
  // A/A: the candidate may or may not be faster on the screen; both paths are valid.
  EXPECT_TRUE(suite_status == "SKIPPED" || suite_status == "PASS") << suite_status;
  if (suite_status == "PASS") EXPECT_EQ(g2["steps"][5]["run_ids"].size(), 4u);
  const std::string verdict = g2["verdict"];
  EXPECT_TRUE(verdict == "NOT_FASTER" || verdict == "FASTER" || verdict == "NOT_PROVEN") << verdict;
}

// Speculative decoding in the lab: the teacher stays plain decoding, a screen with --spec ngram
// must give the teacher's tokens (the exactness check unchanged), and its manifest, summary,
// ledger, `lab runs`, `lab compare` and report carry the drafter and the acceptance read from
// /metrics.
TEST_F(LabE2E, SpeculativeScreenIsExactAndRecordsAcceptance) {
  // A periodic prompt: its last token always occurred before, so the n-gram drafter drafts.
  std::vector<int> periodic;
  for (int i = 0; i < 40; ++i) periodic.push_back(60 + (i % 7) * 31);
  json suite = ShortSuite();
  suite["name"] = "spec";
  suite["checks"] = {"identity",  "no_fallback",     "scale_audit", "topology",
                     "exactness", "no_prefix_cache", "boundary"};
  suite["prompts"] = {{{"name", "periodic"}, {"token_ids", periodic}},
                      {{"name", "a"}, {"token_ids", {5, 17, 42, 99, 7, 300}}},
                      {{"name", "boundary"}, {"kind", "boundary"}, {"computed", true}}};
  const fs::path spec_suite = root_ / "spec-suite.json";
  WriteJson(spec_suite, suite);
  const std::string common = "--backend cpu --suite '" + spec_suite.string() + "' --cache-dir '" +
                             (root_ / "cache").string() + "'";
  const fs::path teacher = root_ / "spec-teacher.json";
  Cmd refused =
      Decodelab("lab teacher " + common + " --teacher '" + teacher.string() + "' --spec ngram");
  EXPECT_NE(refused.rc, 0) << refused.out;
  EXPECT_NE(refused.out.find("plain decoding"), std::string::npos) << refused.out;
  EXPECT_FALSE(fs::exists(teacher));
  Cmd t = Decodelab("lab teacher " + common + " --teacher '" + teacher.string() + "'");
  ASSERT_EQ(t.rc, 0) << t.out;

  const std::string runs = (root_ / "spec-runs").string();
  const std::string screen =
      "lab screen " + common + " --teacher '" + teacher.string() + "' --runs-dir '" + runs + "' ";
  Cmd c = Decodelab(screen + "--spec ngram --spec-k 3 --spec-ngram-min 1");
  ASSERT_EQ(c.rc, 0) << c.out;
  auto dirs = RunDirs(runs);
  ASSERT_EQ(dirs.size(), 1u);
  const fs::path run = dirs[0];
  EXPECT_EQ(run.filename().string().rfind("screen-spec-ngram-", 0), 0u)
      << "the default label names the drafter";
  auto st = CheckStatuses(run);
  for (const char* n : {"identity", "no_fallback", "exactness", "no_prefix_cache", "boundary"}) {
    EXPECT_EQ(st[n], "PASS") << n << "\n" << c.out;
  }
  json m = ReadJson(run / "manifest.json");
  EXPECT_EQ(m["speculative"]["drafter"], "ngram[1,5]") << m["speculative"];
  EXPECT_EQ(m["speculative"]["num_speculative_tokens"], 3);
  EXPECT_NE(m["speculative"]["flags"].dump().find("--spec"), std::string::npos);
  EXPECT_NE(m["serve_argv"].dump().find("\"--spec\",\"ngram\""), std::string::npos)
      << m["serve_argv"];
  json s = ReadJson(run / "summary.json");
  EXPECT_EQ(s["exact"], 3);
  const json sp = s["speculative"];
  ASSERT_TRUE(sp.is_object()) << s.dump(1);
  const int drafts = sp["vllm:spec_decode_num_drafts_total"];
  const int drafted = sp["vllm:spec_decode_num_draft_tokens_total"];
  const int accepted = sp["vllm:spec_decode_num_accepted_tokens_total"];
  EXPECT_GT(drafts, 0) << "the periodic prompt always has an n-gram match";
  EXPECT_LE(drafted, 3 * drafts);
  EXPECT_LE(accepted, drafted);
  // Position i counts drafts whose tokens 0..i were all accepted: non-increasing, summing to the
  // accepted tokens.
  ASSERT_EQ(sp["vllm:spec_decode_num_accepted_tokens_per_pos_total"].size(), 3u);
  int sum = 0, prev = drafts;
  for (int v : sp["vllm:spec_decode_num_accepted_tokens_per_pos_total"]) {
    EXPECT_LE(v, prev);
    prev = v;
    sum += v;
  }
  EXPECT_EQ(sum, accepted);
  EXPECT_DOUBLE_EQ(sp["mean_acceptance_length"].get<double>(), 1.0 + double(accepted) / drafts);
  // The speed of a speculative run is the stream rate; the per-event statistics are left out.
  EXPECT_TRUE(s["decode_tok_s_conventional_99_interval_median"].is_null());
  EXPECT_GT(s["decode_tok_s_stream_median"].get<double>(), 0);
  EXPECT_NE(c.out.find("speculative: ngram[1,5] K=3"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("stream median"), std::string::npos) << c.out;

  // The same flags after `--` are the lab's too; both at once are refused.
  Cmd both = Decodelab(screen + "--spec ngram -- --spec ngram");
  EXPECT_NE(both.rc, 0);
  EXPECT_NE(both.out.find("not both"), std::string::npos) << both.out;
  Cmd dashed = Decodelab(screen + "--label dashed -- --spec ngram --spec-k 2");
  ASSERT_EQ(dashed.rc, 0) << dashed.out;
  Cmd plain = Decodelab(screen + "--label plain");
  ASSERT_EQ(plain.rc, 0) << plain.out;
  dirs = RunDirs(runs);
  ASSERT_EQ(dirs.size(), 3u);
  for (const auto& d : dirs) {
    const json md = ReadJson(d / "manifest.json");
    if (d.filename().string().rfind("dashed-", 0) == 0) {
      EXPECT_EQ(md["speculative"]["num_speculative_tokens"], 2);
    }
    if (d.filename().string().rfind("plain-", 0) == 0) {
      EXPECT_EQ(md["speculative"]["drafter"], "none");
      EXPECT_TRUE(ReadJson(d / "summary.json")["speculative"].is_null());
    }
  }

  Cmd list = Decodelab("lab runs --runs-dir '" + runs + "'");
  ASSERT_EQ(list.rc, 0) << list.out;
  EXPECT_NE(list.out.find("accept len"), std::string::npos) << list.out;
  const size_t at = list.out.find(run.filename().string());
  ASSERT_NE(at, std::string::npos) << list.out;
  const std::string row = list.out.substr(at, list.out.find('\n', at) - at);
  EXPECT_NE(row.find(fmt::format("{:.2f}", sp["mean_acceptance_length"].get<double>())),
            std::string::npos)
      << row;
  Cmd cmp = Decodelab("lab compare --runs-dir '" + runs + "' plain screen-spec-ngram");
  ASSERT_EQ(cmp.rc, 0) << cmp.out;
  EXPECT_NE(cmp.out.find("statistic: stream median"), std::string::npos) << cmp.out;

  const fs::path html = root_ / "spec-report.html";
  Cmd rep = Decodelab("lab report --runs-dir '" + runs + "' --out '" + html.string() +
                      "' --bundles '" + (root_ / "no-bundles").string() + "'");
  ASSERT_EQ(rep.rc, 0) << rep.out;
  auto text = ReadTextFile(html.string());
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("id=\"speculative-runs\""), std::string::npos);
  EXPECT_NE(text->find("ngram[1,5] K=3: mean acceptance length"), std::string::npos);
  EXPECT_NE(text->find("<th>pos 2</th>"), std::string::npos);
}

TEST_F(LabE2E, ReproPassesOnTheTeachersTokensAndFailsOtherwise) {
  // Precursors fill and free KV pages first. The teacher recorded the target's tokens on a server
  // that never saw these precursors, so equality after them is evidence of no stale state.
  json t = ReadJson(teacher_);
  json target;
  for (const auto& p : t["prompts"]) {
    if (p["name"] == "c") target = p;
  }
  ASSERT_FALSE(target.is_null());
  std::vector<int> expected(target["tokens"].begin(), target["tokens"].begin() + 16);
  json repro = {
      {"format", "decodelab-lab-repro"},
      {"name", "page-reuse"},
      {"kv_dtype", "fp8"},
      {"precursors",
       {{{"token_ids", SyntheticPromptIds(45, 9, 500)}, {"max_tokens", 20}},
        {{"token_ids", SyntheticPromptIds(7, 10, 500)}, {"max_tokens", 3}}}},
      {"target", {{"token_ids", target["prompt"]}, {"max_tokens", 16}, {"expected", expected}}}};
  const fs::path file = root_ / "repro.json";
  WriteJson(file, repro);
  const std::string common = "--backend cpu --cache-dir '" + (root_ / "cache").string() + "'";
  Cmd ok = Decodelab("lab repro '" + file.string() + "' " + common);
  EXPECT_EQ(ok.rc, 0) << ok.out;
  EXPECT_NE(ok.out.find("REPRO_RESULT=PASS"), std::string::npos) << ok.out;

  repro["target"]["expected"][5] = (expected[5] + 1) % 500;
  WriteJson(file, repro);
  Cmd bad = Decodelab("lab repro '" + file.string() + "' " + common);
  EXPECT_EQ(bad.rc, 3) << bad.out;
  EXPECT_NE(bad.out.find("REPRO_RESULT=FAIL"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("token 5"), std::string::npos) << bad.out;
}

}  // namespace
}  // namespace dl::lab
