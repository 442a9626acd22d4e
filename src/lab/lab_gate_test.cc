#include "lab/lab_gate.h"

#include <unistd.h>

#include <filesystem>

#include "lab/lab_ledger.h"
#include "lab/lab_report.h"
#include "lab/lab_repro.h"

#include <gtest/gtest.h>

namespace dl::lab {
namespace {

using nlohmann::json;

TEST(LabGate, ParsesAPlan) {
  auto p = ParseGatePlan(json::parse(R"({"format": "decodelab-lab-plan",
      "model": {"shape": "tiny", "seed": 3}, "suite": "s.json",
      "control": {"binary": "/opt/a/decodelab", "lock": "a.lock"},
      "candidate": {"binary": "b/decodelab", "flags": ["--max-batch", "1"]},
      "probe": {"transport": "sim", "ranks": 4}})"),
                         "/plans/p.json");
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(p->shape, "tiny");
  EXPECT_EQ(p->seed, 3u);
  EXPECT_EQ(p->suite, "/plans/s.json");
  EXPECT_EQ(p->control.binary, "/opt/a/decodelab");
  EXPECT_EQ(p->control.lock, "/plans/a.lock");
  EXPECT_EQ(p->candidate.binary, "/plans/b/decodelab");
  EXPECT_EQ(p->candidate.flags, (std::vector<std::string>{"--max-batch", "1"}));
  EXPECT_EQ(p->probe_ranks, 4);
}

TEST(LabGate, RejectsBadPlans) {
  EXPECT_FALSE(ParseGatePlan(json::parse(R"({"format": "x"})"), "p").ok());
  EXPECT_FALSE(ParseGatePlan(json::parse(R"({"format": "decodelab-lab-plan",
      "model": {"dir": "m", "shape": "tiny"}})"),
                             "p")
                   .ok());
  EXPECT_FALSE(ParseGatePlan(json::parse(R"({"format": "decodelab-lab-plan",
      "probe": {"transport": "carrier-pigeon"}})"),
                             "p")
                   .ok());
}

TEST(LabGate, ResumeStartsAfterTheLastPassedStep) {
  GateRecord r;
  r.gate_id = "g";
  r.steps = {{"preflight", "NOT_APPLICABLE", "", {}},
             {"probe", "SIMULATED", "", {}},
             {"teacher", "PASS", "", {}},
             {"control_screen", "PASS", "", {"control-1"}},
             {"candidate_screen", "INVALID", "lock", {"candidate-1"}}};
  EXPECT_EQ(r.ResumeIndex(), 4u);
  auto back = GateRecord::FromJson(r.ToJson(), "mem");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->ResumeIndex(), 4u);
  EXPECT_EQ(back->steps[3].run_ids, (std::vector<std::string>{"control-1"}));
  r.steps[1].status = "FAIL";
  EXPECT_EQ(r.ResumeIndex(), 1u);
  EXPECT_EQ(GateStepNames().front(), "preflight");
  EXPECT_EQ(GateStepNames().back(), "verdict");
}

TEST(LabRepro, ParsesAndValidates) {
  auto r = ParseRepro(json::parse(R"({"format": "decodelab-lab-repro", "calibration": "s.json",
      "precursors": [{"token_ids": [1, 2], "max_tokens": 4}],
      "target": {"token_ids": [3], "max_tokens": 2, "expected": [7, 8]}})"),
                      "/r/x.json");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->name, "x");
  EXPECT_EQ(r->calibration, "/r/s.json");
  ASSERT_EQ(r->precursors.size(), 1u);
  EXPECT_EQ(r->precursors[0].max_tokens, 4);
  EXPECT_EQ(r->expected, (std::vector<int32_t>{7, 8}));
  // expected must have max_tokens entries
  EXPECT_FALSE(ParseRepro(json::parse(R"({"format": "decodelab-lab-repro",
      "target": {"token_ids": [3], "max_tokens": 3, "expected": [7, 8]}})"),
                          "p")
                   .ok());
  EXPECT_FALSE(ParseRepro(json::parse(R"({"format": "decodelab-lab-repro",
      "target": {"token_ids": [], "max_tokens": 1, "expected": [7]}})"),
                          "p")
                   .ok());
  EXPECT_FALSE(ParseRepro(json::parse(R"({"format": "decodelab-lab-repro"})"), "p").ok());
}

TEST(LabReport, EscapesAndNeverShowsAnInvalidRunsSpeed) {
  EXPECT_EQ(HtmlEscape("<a href=\"x\">&</a>"), "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;");
  char tmpl[] = "/tmp/decodelab-report-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  LedgerRun ok;
  ok.run_id = "ok-1";
  ok.label = "control";
  ok.verdict = "PASS";
  ok.valid = true;
  ok.conventional = 321.5;
  ok.historical = 320.25;
  LedgerRun bad = ok;
  bad.run_id = "bad<1>";
  bad.verdict = "INVALID";
  bad.valid = false;
  bad.conventional = 987.75;  // must never be shown
  ASSERT_TRUE(LedgerRecord(dir, ok, {}, {}).ok());
  ASSERT_TRUE(LedgerRecord(dir, bad, {}, {}).ok());
  auto html = BuildReportHtml(dir);
  ASSERT_TRUE(html.ok()) << html.status().message();
  EXPECT_NE(html->find("321.50"), std::string::npos);
  EXPECT_EQ(html->find("987.75"), std::string::npos);
  EXPECT_NE(html->find("bad&lt;1&gt;"), std::string::npos);
  EXPECT_EQ(html->find("bad<1>"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dl::lab
