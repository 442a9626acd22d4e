// `lab report` with and without the pinned Vega-Lite bundles (tools/report-js, docs/lab.md): a
// small ledger written through the ledger API, the report built from it, and -- where Chromium and
// the bundles exist -- the report opened headless to check that all four charts drew.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/sha256.h"
#include "lab/lab_ledger.h"
#include "lab/lab_report.h"
#include "lab/lab_suite.h"

namespace dl::lab {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A check detail that would end a <script> element if written raw.
constexpr const char* kHostileDetail = "teacher said </script><b>boom</b> <!-- here";

class LabReportCharts : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("dl_lab_report_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    runs_ = root_ / "runs";
    fs::create_directories(runs_);
    // Two control and two candidate runs with different speeds, and one INVALID candidate whose
    // speed must never be shown (lab.md: INVALID runs have no speed).
    AddRun("20261130T010000Z-control", "control", "2026-11-30T01:00:00Z", true, 101.25, 0.8);
    AddRun("20261130T010500Z-candidate", "candidate", "2026-11-30T01:05:00Z", true, 120.5, 0.6);
    AddRun("20261130T011000Z-control", "control", "2026-11-30T01:10:00Z", true, 99.75, 0.9);
    AddRun("20261130T011500Z-candidate", "candidate", "2026-11-30T01:15:00Z", true, 122.0, 0.55);
    AddRun("20261130T012000Z-candidate", "candidate", "2026-11-30T01:20:00Z", false, 987.5, 0.1);
  }
  void TearDown() override { fs::remove_all(root_); }

  void AddRun(const std::string& id, const std::string& label, const std::string& started,
              bool valid, double tok_s, double gap_base_ms) {
    const fs::path dir = runs_ / id;
    fs::create_directories(dir);
    // Three prompts of 40 tokens; gaps vary around gap_base_ms, the first token of each has none.
    std::ofstream csv(dir / "timings.csv");
    csv << "prompt,index,token_id,arrival_s,gap_s\n";
    double t = 0;
    for (int p = 0; p < 3; ++p) {
      for (int i = 0; i < 40; ++i) {
        const double gap_s = i == 0 ? 0 : (gap_base_ms + 0.05 * ((i * 7 + p) % 11)) / 1e3;
        t += gap_s;
        csv << "p" << p << "," << i << "," << 1000 + i << "," << t << "," << gap_s << "\n";
      }
    }
    std::vector<CheckRow> checks = {{"exactness", valid ? CheckStatus::kPass : CheckStatus::kFail,
                                     valid ? "13/13 exact" : kHostileDetail},
                                    {"no_prefix_cache", CheckStatus::kPass, "cached_tokens 0"},
                                    {"scale_audit", CheckStatus::kNotApplicable, "no fp8 cache"}};
    json cj = json::array();
    for (const auto& c : checks) cj.push_back(c.ToJson());
    std::ofstream(dir / "checks.json") << cj.dump(2);
    // What the runner writes beside them: the configuration and the latency distributions.
    std::ofstream(dir / "manifest.json") << json{{"backend", "cuda"},
                                                 {"kv_dtype", "fp8"},
                                                 {"serve_argv",
                                                  {"/x/decodelab", "serve", "--shape", "xs2", "--host",
                                                   "127.0.0.1", "--port", "0", "--kv-dtype", "fp8",
                                                   "--page-size", "32"}}}
                                                .dump();
    std::ofstream(dir / "state.json") << json{{"page_size", 32}, {"kv_dtype", "fp8"}}.dump();
    std::ofstream(dir / "summary.json")
        << json{{"ttft", {{"median_ms", 12.5 + gap_base_ms}, {"p99_ms", 30.25}}},
                {"itl", {{"median_ms", gap_base_ms}, {"p99_ms", 1.75}}}}
               .dump();
    LedgerRun r;
    r.run_id = id;
    r.label = label;
    r.mode = "conventional";
    r.commit = "abc123";
    r.started_utc = started;
    r.verdict = valid ? "PASS" : "INVALID";
    r.dir = dir.string();
    r.valid = valid;
    r.exact = valid ? 13 : 12;
    r.prompts = 13;
    if (valid) {
      r.conventional = tok_s;
      r.historical = tok_s * 0.97;
      r.per_prompt_conventional = {tok_s - 1, tok_s, tok_s + 1};
    }
    ASSERT_TRUE(LedgerRecord(runs_.string(), r, checks, {{"conventional_median", tok_s}}).ok());
  }

  std::string Report(const std::string& bundles_dir) {
    ReportOptions o;
    o.bundles_dir = bundles_dir;
    auto html = BuildReportHtml(runs_.string(), o);
    EXPECT_TRUE(html.ok()) << html.status().message();
    return html.ok() ? *html : std::string();
  }

  fs::path root_, runs_;
};

const std::string kBundles = DL_REPORT_BUNDLES_DIR;

bool HaveBundles() {
  return LoadReportBundles(kBundles).found;
}

std::string FindChromium() {
  for (const char* name : {"chromium", "chromium-browser", "google-chrome"}) {
    const std::string cmd = std::string("command -v ") + name + " >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return name;
  }
  return "";
}

// The text of <script type="application/json" id="ID">...</script>.
std::string ScriptBlock(const std::string& html, const std::string& id) {
  const std::string open = "<script type=\"application/json\" id=\"" + id + "\">";
  const size_t a = html.find(open);
  if (a == std::string::npos) return "";
  const size_t b = html.find("</script>", a + open.size());
  return html.substr(a + open.size(), b - a - open.size());
}

TEST(LabReportEscape, ScriptAndJsonTextCannotCloseTheElement) {
  EXPECT_EQ(EscapeScriptText("a</script>b</SCRIPT >c<!--d"), "a<\\/script>b<\\/SCRIPT >c<\\!--d");
  EXPECT_EQ(EscapeScriptText("x</scrip"), "x</scrip");  // not an end tag: unchanged
  const json j = {{"s", "</script><!--"}};
  const std::string e = EscapeJsonForScript(j.dump());
  EXPECT_EQ(e.find('<'), std::string::npos);
  EXPECT_EQ(json::parse(e), j) << "escaping must not change what the JSON means";
}

TEST_F(LabReportCharts, WithoutBundlesKeepsTablesAndSaysChartsAreMissing) {
  const std::string html = Report((root_ / "no-bundles").string());
  EXPECT_NE(html.find("charts missing: Vega-Lite bundles not found"), std::string::npos);
  EXPECT_NE(html.find((root_ / "no-bundles" / "vega.min.js").string()), std::string::npos)
      << "the notice names what it looked for";
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_NE(html.find("<svg"), std::string::npos) << "the inline fallback charts stay";
  EXPECT_NE(html.find("<td>20261130T010500Z-candidate</td>"), std::string::npos);
  EXPECT_NE(html.find("<td>exactness</td>"), std::string::npos);
  EXPECT_NE(html.find("<td>no_prefix_cache</td>"), std::string::npos);
  EXPECT_NE(html.find("122.00"), std::string::npos);
  EXPECT_EQ(html.find("987.50"), std::string::npos) << "an INVALID run's speed is never shown";
  EXPECT_EQ(html.find("</script><b>"), std::string::npos);
}

TEST_F(LabReportCharts, RunsTableShowsConfigurationAndLatencies) {
  const std::string html = Report((root_ / "no-bundles").string());
  for (const char* header : {"<th>TTFT median / p99 (ms)</th>", "<th>ITL median / p99 (ms)</th>",
                             "<th>KV dtype</th>", "<th>page size</th>", "<th>serve flags</th>"}) {
    EXPECT_NE(html.find(header), std::string::npos) << header;
  }
  // The 01:05 candidate: TTFT 12.5 + 0.6, ITL 0.6; its configuration, without the lab's address.
  EXPECT_NE(
      html.find(
          "<td>13.10 / 30.25</td><td>0.60 / 1.75</td><td>cuda</td><td>fp8</td><td>32</td>"
          "<td><code>--shape xs2 --kv-dtype fp8 --page-size 32</code></td><td>&ndash;</td></tr>"),
      std::string::npos)
      << "a plain run's speculative cell is a dash";
  // No run speculated: no speculative decoding table (tests/lab/lab_e2e_test.cc covers one that
  // did).
  EXPECT_EQ(html.find("id=\"speculative-runs\""), std::string::npos);
  // The INVALID run shows no latency either.
  EXPECT_EQ(html.find("<td>12.60 / 30.25</td>"), std::string::npos);
}

TEST_F(LabReportCharts, SpeedAxesSpanTheDataAndTimeTicksAreReadable) {
  // Inline fallback: ticks from about the slowest to the fastest run, not from zero; time labels.
  const std::string html = Report((root_ / "no-bundles").string());
  const size_t svg = html.find("<svg");
  ASSERT_NE(svg, std::string::npos);
  const std::string chart = html.substr(svg, html.find("</svg>", svg) - svg);
  EXPECT_EQ(chart.find(">0</text>"), std::string::npos) << "the speed axis must not start at 0";
  EXPECT_NE(chart.find(">11-30 01:00</text>"), std::string::npos) << chart;
  EXPECT_NE(chart.find(">11-30 01:15</text>"), std::string::npos) << chart;
  if (!HaveBundles()) GTEST_SKIP() << "Vega-Lite bundles not built (no npm?): spec checks skipped";
  const std::string v = Report(kBundles);
  const json speed = json::parse(ScriptBlock(v, "vl-spec-speed"));
  EXPECT_EQ(speed["encoding"]["y"]["scale"]["zero"], false);
  EXPECT_EQ(speed["encoding"]["x"]["scale"]["type"], "utc");
  EXPECT_EQ(speed["encoding"]["x"]["axis"]["format"], "%m-%d %H:%M");
  EXPECT_EQ(speed["encoding"]["x"]["axis"]["labelOverlap"], "greedy");
  const json compare = json::parse(ScriptBlock(v, "vl-spec-compare"));
  EXPECT_EQ(compare["layer"][0]["encoding"]["y"]["scale"]["zero"], false);
}

TEST_F(LabReportCharts, NoGateNoCompareChartButAnExplanation) {
  // Only screens: no control/candidate pair.
  fs::remove_all(runs_);
  fs::create_directories(runs_);
  AddRun("20261201T010000Z-screen", "screen", "2026-12-01T01:00:00Z", true, 100.0, 0.7);
  AddRun("20261201T020000Z-screen", "screen", "2026-12-01T02:00:00Z", true, 101.0, 0.7);
  for (const std::string& dir : {(root_ / "no-bundles").string(), kBundles}) {
    if (dir == kBundles && !HaveBundles()) continue;
    const std::string html = Report(dir);
    EXPECT_NE(html.find("id=\"no-gate\""), std::string::npos);
    EXPECT_NE(html.find("decodelab lab gate"), std::string::npos);
    EXPECT_EQ(html.find("id=\"chart-compare\""), std::string::npos);
  }
}

TEST_F(LabReportCharts, WithBundlesInlinesThemWithHashesAndData) {
  if (!HaveBundles()) GTEST_SKIP() << "Vega-Lite bundles not built in " << kBundles << " (no npm?)";
  const std::string html = Report(kBundles);
  EXPECT_EQ(html.find("charts missing"), std::string::npos);
  EXPECT_EQ(html.find("src=\"http"), std::string::npos) << "the report must open offline";
  for (const char* name : kReportBundleFiles) {
    auto sha = Sha256File((fs::path(kBundles) / name).string());
    ASSERT_TRUE(sha.ok());
    EXPECT_NE(html.find(std::string(name) + " sha256:" + *sha), std::string::npos) << name;
  }
  for (const char* chart : {"speed", "gaps", "compare", "checks"}) {
    EXPECT_NE(html.find(std::string("<div id=\"chart-") + chart + "\""), std::string::npos);
    const std::string spec = ScriptBlock(html, std::string("vl-spec-") + chart);
    ASSERT_FALSE(spec.empty()) << chart;
    EXPECT_NO_THROW(json::parse(spec)) << chart;
  }
  // The speed data: the four valid runs, never the INVALID one.
  const json speed = json::parse(ScriptBlock(html, "vl-data-speed"));
  ASSERT_EQ(speed.size(), 4u);
  double hi = 0;
  for (const auto& p : speed) hi = std::max(hi, p.at("conventional").get<double>());
  EXPECT_DOUBLE_EQ(hi, 122.0);
  EXPECT_EQ(html.find("987.5"), std::string::npos) << "an INVALID run's speed is never shown";
  // The gap data: the latest valid run's 3 x 39 gaps (ms) less those above its 99th percentile.
  const json gaps = json::parse(ScriptBlock(html, "vl-data-gaps"));
  EXPECT_GE(gaps.size(), 110u);
  EXPECT_LE(gaps.size(), 117u);
  for (const auto& g : gaps) {
    EXPECT_GE(g.at("gap_ms").get<double>(), 0.55 - 1e-9);
    EXPECT_LE(g.at("gap_ms").get<double>(), 0.55 + 0.5 + 1e-9);
  }
  EXPECT_EQ(json::parse(ScriptBlock(html, "vl-data-compare")).size(), 4u);
  // The hostile check detail is in the checks data, escaped, and reads back intact.
  const std::string checks_text = ScriptBlock(html, "vl-data-checks");
  EXPECT_EQ(checks_text.find('<'), std::string::npos);
  const json checks = json::parse(checks_text);
  EXPECT_EQ(checks.size(), 15u);
  EXPECT_NE(checks_text.find("\\u003c/script>"), std::string::npos);
  bool found = false;
  for (const auto& c : checks) found = found || c.value("detail", "") == kHostileDetail;
  EXPECT_TRUE(found);
  EXPECT_EQ(html.find("</script><b>"), std::string::npos);
  // The tables are all still there.
  EXPECT_NE(html.find("<td>exactness</td>"), std::string::npos);
  EXPECT_NE(html.find("<td>20261130T011500Z-candidate</td>"), std::string::npos);
}

TEST_F(LabReportCharts, HeadlessChromiumDrawsAllFourCharts) {
  if (!HaveBundles()) GTEST_SKIP() << "Vega-Lite bundles not built in " << kBundles << " (no npm?)";
  const std::string chromium = FindChromium();
  if (chromium.empty()) GTEST_SKIP() << "no chromium on PATH (scripts/install-deps.sh installs it)";
  const fs::path html_path = root_ / "report.html";
  ASSERT_TRUE(WriteTextFile(html_path.string(), Report(kBundles)).ok());
  const fs::path dom_path = root_ / "dom.html";
  const std::string cmd =
      "timeout 120 " + chromium +
      " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage"
      " --disable-background-networking --disable-component-update --disable-sync --no-first-run"
      " --user-data-dir='" +
      (root_ / "profile").string() + "' --virtual-time-budget=5000 --dump-dom 'file://" +
      html_path.string() + "' > '" + dom_path.string() + "' 2> '" +
      (root_ / "chromium.log").string() + "'";
  const int rc = std::system(cmd.c_str());
  auto dom = ReadTextFile(dom_path.string());
  auto log = ReadTextFile((root_ / "chromium.log").string());
  ASSERT_EQ(rc, 0) << cmd << "\n" << (log.ok() ? *log : "");
  ASSERT_TRUE(dom.ok());
  const size_t failed = dom->find("data-chart-error=\"");
  EXPECT_EQ(failed, std::string::npos)
      << dom->substr(failed == std::string::npos ? 0 : failed, 400);
  EXPECT_NE(dom->find("data-charts-drawn=\"4\""), std::string::npos)
      << "not every chart's vegaEmbed resolved";
  // Each chart's div holds a Vega SVG with the marks its spec asks for.
  const std::vector<std::pair<std::string, std::vector<std::string>>> want = {
      {"speed", {"mark-line", "mark-symbol"}},
      {"gaps", {"mark-rect"}},
      {"compare", {"mark-symbol", "mark-rect"}},  // Vega-Lite draws a tick as a rect
      {"checks", {"mark-rect"}}};
  for (const auto& [chart, marks] : want) {
    const size_t a = dom->find("id=\"chart-" + chart + "\"");
    ASSERT_NE(a, std::string::npos) << chart;
    const size_t b = dom->find("id=\"vl-spec-" + chart + "\"", a);
    ASSERT_NE(b, std::string::npos) << chart;
    const std::string seg = dom->substr(a, b - a);
    EXPECT_NE(seg.find("<svg"), std::string::npos) << chart << " drew no SVG";
    EXPECT_NE(seg.find("class=\"marks\""), std::string::npos) << chart;
    for (const auto& m : marks) EXPECT_NE(seg.find(m), std::string::npos) << chart << " " << m;
  }
}

}  // namespace
}  // namespace dl::lab
