#include "lab/lab_report.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <system_error>

#include <nlohmann/json.hpp>

#include "base/sha256.h"
#include "lab/lab_ledger.h"
#include "lab/lab_suite.h"

namespace dl::lab {

namespace fs = std::filesystem;
using nlohmann::json;

std::string HtmlEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

std::string EscapeScriptText(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<' && i + 1 < s.size() && s[i + 1] == '/' && i + 8 <= s.size() &&
        std::equal(s.begin() + i + 2, s.begin() + i + 8, "script", [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) == b;
        })) {
      o += "<\\/";  // "<\/script": the same string in JavaScript, no end tag in HTML
      ++i;
      continue;
    }
    if (s.compare(i, 4, "<!--") == 0) {
      o += "<\\!--";
      i += 3;
      continue;
    }
    o += s[i];
  }
  return o;
}

std::string EscapeJsonForScript(const std::string& json_text) {
  std::string o;
  o.reserve(json_text.size());
  for (char c : json_text) {
    if (c == '<') {
      o += "\\u003c";
    } else {
      o += c;
    }
  }
  return o;
}

std::string DefaultReportBundlesDir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "share/decodelab/report";
  return (self.parent_path().parent_path() / "share" / "decodelab" / "report").string();
}

ReportBundles LoadReportBundles(const std::string& dir) {
  ReportBundles b;
  b.dir = dir.empty() ? DefaultReportBundlesDir() : dir;
  for (const char* name : kReportBundleFiles) {
    const std::string path = (fs::path(b.dir) / name).string();
    auto text = ReadTextFile(path);
    if (!text.ok() || text->empty()) {
      b.reason = fmt::format("no {}", path);
      b.files.clear();
      return b;
    }
    b.files.push_back({name, *text, Sha256Hex(*text)});
  }
  b.found = true;
  return b;
}

namespace {

const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};

// "2026-11-30T01:05:00Z" -> "11-30 01:05" (UTC), readable under a chart.
std::string ShortTime(const std::string& utc) {
  if (utc.size() >= 16 && utc[10] == 'T') return utc.substr(5, 5) + " " + utc.substr(11, 5);
  return utc;
}

// A JSON file of a run directory, or an empty object.
json RunFile(const LedgerRun& run, const char* name) {
  auto text = ReadTextFile((fs::path(run.dir) / name).string());
  if (!text.ok()) return json::object();
  json j = json::parse(*text, nullptr, false);
  return j.is_object() ? j : json::object();
}

// The serve flags a run used: its serve argv after "serve", without the address the lab picks.
std::string ServeFlags(const json& manifest) {
  const json argv = manifest.value("serve_argv", json::array());
  std::string out;
  bool after_serve = false;
  for (size_t i = 0; i < argv.size(); ++i) {
    if (!argv[i].is_string()) continue;
    const std::string a = argv[i];
    if (!after_serve) {
      after_serve = a == "serve";
      continue;
    }
    if ((a == "--host" || a == "--port") && i + 1 < argv.size()) {
      ++i;
      continue;
    }
    out += (out.empty() ? "" : " ") + a;
  }
  return out;
}

// Conventional median per valid run, in ledger order, one colour per label.
std::string SpeedChart(const std::vector<LedgerRun>& runs) {
  std::vector<const LedgerRun*> pts;
  for (const auto& r : runs) {
    if (r.valid && r.conventional) pts.push_back(&r);
  }
  if (pts.empty()) return "<p>No valid run with a speed yet.</p>";
  std::map<std::string, int> colour;
  for (const auto* r : pts) colour.emplace(r->label, static_cast<int>(colour.size()) % 6);
  // The axis spans the data (plus a margin), not 0..max: a 1 % difference must be visible.
  double lo = *pts[0]->conventional, hi = lo;
  for (const auto* r : pts) {
    lo = std::min(lo, *r->conventional);
    hi = std::max(hi, *r->conventional);
  }
  const double pad = std::max((hi - lo) * 0.1, std::max(hi, 1e-9) * 0.005);
  lo -= pad;
  hi += pad;
  const int w = 720, h = 260, l = 60, b = 30;
  std::string s = fmt::format("<svg width=\"{}\" height=\"{}\" role=\"img\">", w, h + 20);
  s += fmt::format("<line x1=\"{0}\" y1=\"10\" x2=\"{0}\" y2=\"{1}\" stroke=\"#888\"/>", l, h - b);
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"#888\"/>", l, h - b,
                   w - 10);
  const int digits = hi - lo < 10 ? 2 : 0;
  for (int i = 0; i <= 4; ++i) {
    const double v = lo + (hi - lo) * i / 4;
    const double y = (h - b) - (h - b - 10) * i / 4.0;
    s += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\">{:.{}f}</text>", l - 4,
        y + 3, v, digits);
  }
  const double step = pts.size() > 1 ? (w - l - 30.0) / (pts.size() - 1) : 0;
  // Time ticks under the first, middle and last run (runs are evenly spaced, oldest first).
  for (size_t i : std::set<size_t>{0, pts.size() / 2, pts.size() - 1}) {
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"10\" text-anchor=\"middle\">{}</text>",
                     l + 10 + step * i, h - b + 14, HtmlEscape(ShortTime(pts[i]->started_utc)));
  }
  for (size_t i = 0; i < pts.size(); ++i) {
    const double x = l + 10 + step * i;
    const double y = (h - b) - (h - b - 10) * ((*pts[i]->conventional - lo) / (hi - lo));
    s += fmt::format(
        "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\"><title>{}: {:.2f} tok/s "
        "(historical {:.2f})</title></circle>",
        x, y, kPalette[colour[pts[i]->label]], HtmlEscape(pts[i]->run_id), *pts[i]->conventional,
        pts[i]->historical.value_or(0));
  }
  int k = 0;
  for (const auto& [label, c] : colour) {
    s += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"11\" fill=\"{}\">&#9679; {}</text>",
                     l + 10 + 130 * k++, h + 12, kPalette[c], HtmlEscape(label));
  }
  s += "</svg><p class=\"note\">Conventional 99-interval median (tok/s) per valid run, oldest "
       "first (the axis spans the data, not zero); hover a point for its run id.</p>";
  return s;
}

// The token gaps (ms) of one run's timings.csv, first token of each prompt excluded, sorted.
// Returns nullopt when the file is missing.
std::optional<std::vector<double>> ReadGapsMs(const LedgerRun& run) {
  std::ifstream in(fs::path(run.dir) / "timings.csv");
  if (!in) return std::nullopt;
  std::vector<double> gaps;
  std::string line;
  std::getline(in, line);  // header: prompt,index,token_id,arrival_s,gap_s
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    for (std::string x; std::getline(ss, x, ',');) f.push_back(x);
    if (f.size() < 5 || f[1] == "0") continue;
    try {
      gaps.push_back(std::stod(f[4]) * 1e3);
    } catch (...) {
    }
  }
  std::sort(gaps.begin(), gaps.end());
  return gaps;
}

// Bins end at the 99th percentile, so one stall does not flatten the picture; the rest are counted.
double GapTop(const std::vector<double>& sorted_gaps) {
  return std::max(sorted_gaps[static_cast<size_t>(0.99 * (sorted_gaps.size() - 1))], 1e-6);
}

// Histogram of the token gaps (ms) of one run's timings.csv, first token excluded.
std::string GapHistogram(const LedgerRun& run) {
  auto read = ReadGapsMs(run);
  if (!read) return "<p>No timings.csv for " + HtmlEscape(run.run_id) + ".</p>";
  const std::vector<double>& gaps = *read;
  if (gaps.empty()) return "<p>No token gaps recorded.</p>";
  const double top = GapTop(gaps);
  const int bins = 30;
  std::vector<int> count(bins, 0);
  int over = 0;
  for (double g : gaps) {
    if (g > top) {
      ++over;
      continue;
    }
    count[std::min(bins - 1, static_cast<int>(g / top * bins))]++;
  }
  const int peak = std::max(1, *std::max_element(count.begin(), count.end()));
  const int w = 720, h = 200, l = 40;
  std::string s = fmt::format("<svg width=\"{}\" height=\"{}\" role=\"img\">", w, h + 30);
  const double bw = (w - l - 10.0) / bins;
  for (int i = 0; i < bins; ++i) {
    const double bh = (h - 10.0) * count[i] / peak;
    s += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"#1f77b4\">"
        "<title>{:.3f}-{:.3f} ms: {}</title></rect>",
        l + bw * i, h - bh, std::max(1.0, bw - 1), bh, top * i / bins, top * (i + 1) / bins,
        count[i]);
  }
  s += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10\">0 ms</text>", l, h + 14);
  s += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10\" text-anchor=\"end\">{:.3f} ms</text>",
                   w - 10, h + 14, top);
  s += "</svg>";
  s += fmt::format(
      "<p class=\"note\">{} gaps of run {}; {} above the 99th percentile ({:.3f} ms) "
      "not drawn.</p>",
      gaps.size(), HtmlEscape(run.run_id), over, top);
  return s;
}

// The run's speculative decoding in one cell: drafter, K, mean acceptance length and rate (from
// summary.json's `speculative` block); a dash for plain decoding.
std::string SpecCell(const json& summary) {
  const json sp = summary.value("speculative", json());
  if (!sp.is_object()) return "&ndash;";
  std::string s = fmt::format("{} K={}", HtmlEscape(sp.value("drafter", "?")),
                              sp.value("num_speculative_tokens", 0));
  const json mal = sp.value("mean_acceptance_length", json());
  const json rate = sp.value("acceptance_rate", json());
  if (mal.is_number() && rate.is_number()) {
    s += fmt::format(": mean acceptance length {:.2f}, {:.1f}% accepted", mal.get<double>(),
                     100 * rate.get<double>());
  } else if (sp.contains("error")) {
    s += ": acceptance not read";
  } else {
    s += ": no drafts";
  }
  return s;
}

// Every speculative run's counters and per-position acceptance (vLLM's names), newest first; empty
// when no run speculated.
std::string SpecSection(const std::vector<LedgerRun>& runs) {
  std::string rows;
  size_t positions = 0;
  std::vector<std::pair<const LedgerRun*, json>> spec_runs;
  for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
    const json sp = RunFile(*it, "summary.json").value("speculative", json());
    if (!sp.is_object()) continue;
    const json pp = sp.value("per_position_acceptance_rate", json());
    if (pp.is_array()) positions = std::max(positions, pp.size());
    spec_runs.emplace_back(&*it, sp);
  }
  if (spec_runs.empty()) return "";
  std::string h =
      "<h2>Speculative decoding</h2><p class=\"note\">Counted between the first prompt and the "
      "last from the server's /metrics (vLLM's <code>vllm:spec_decode_*</code> counters). A draft "
      "is one verify of a sequence with draft tokens; mean acceptance length = 1 + accepted / "
      "drafts (tokens per verify); position i = drafts whose tokens 0..i were all accepted, over "
      "drafts. The exactness check is the same as without speculation. A speculative run has no "
      "conventional or historical statistic (a verify's tokens arrive together), so the speed "
      "charts leave it out; its speed is the stream rate (first to last token).</p>"
      "<table id=\"speculative-runs\"><tr><th>run id</th><th>verdict</th><th>drafter</th>"
      "<th>K</th><th>drafts</th><th>draft tokens</th><th>accepted</th><th>acceptance rate</th>"
      "<th>mean acceptance length</th><th>stream tok/s</th>";
  for (size_t i = 0; i < positions; ++i) h += fmt::format("<th>pos {}</th>", i);
  h += "</tr>";
  for (const auto& [r, sp] : spec_runs) {
    auto count = [&](const char* key) {
      const json v = sp.value(key, json());
      return v.is_number() ? v.dump() : std::string("&ndash;");
    };
    const json mal = sp.value("mean_acceptance_length", json());
    const json rate = sp.value("acceptance_rate", json());
    h += fmt::format(
        "<tr><td>{}</td><td class=\"{}\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
        HtmlEscape(r->run_id), HtmlEscape(r->verdict), HtmlEscape(r->verdict),
        HtmlEscape(sp.value("drafter", "?")), count("num_speculative_tokens"),
        count("vllm:spec_decode_num_drafts_total"),
        count("vllm:spec_decode_num_draft_tokens_total"),
        count("vllm:spec_decode_num_accepted_tokens_total"),
        rate.is_number() ? fmt::format("{:.1f}%", 100 * rate.get<double>()) : "&ndash;",
        mal.is_number() ? fmt::format("{:.2f}", mal.get<double>()) : "&ndash;",
        r->stream && r->valid ? fmt::format("{:.2f}", *r->stream) : "&ndash;");
    const json pp = sp.value("per_position_acceptance_rate", json());
    for (size_t i = 0; i < positions; ++i) {
      h += pp.is_array() && i < pp.size() && pp[i].is_number()
               ? fmt::format("<td>{:.1f}%</td>", 100 * pp[i].get<double>())
               : "<td>&ndash;</td>";
    }
    h += "</tr>";
    if (sp.contains("error")) {
      h += fmt::format("<tr><td colspan=\"{}\" class=\"note\">{}: {}</td></tr>", 10 + positions,
                       HtmlEscape(r->run_id), HtmlEscape(sp.value("error", "")));
    }
  }
  return h + "</table>";
}

std::string CheckTable(const LedgerRun& run) {
  auto text = ReadTextFile((fs::path(run.dir) / "checks.json").string());
  if (!text.ok()) return "<p>No checks.json.</p>";
  std::string s = "<table><tr><th>check</th><th>status</th><th>detail</th></tr>";
  try {
    for (const auto& r : json::parse(*text)) {
      const std::string st = r.value("status", "");
      s += fmt::format("<tr><td>{}</td><td class=\"{}\">{}</td><td>{}</td></tr>",
                       HtmlEscape(r.value("name", "")), HtmlEscape(st), HtmlEscape(st),
                       HtmlEscape(r.value("detail", "")));
    }
  } catch (const json::exception&) {
    return "<p>checks.json is not valid JSON.</p>";
  }
  return s + "</table>";
}

// --- Vega-Lite charts (bundles present) ---------------------------------------------------------
// Each chart is a <div id="chart-NAME" class="vl-chart">, its spec (without data) in
// <script type="application/json" id="vl-spec-NAME"> and its rows in id="vl-data-NAME"; one script
// at the end embeds them all with renderer "svg" and counts the ones that drew into <body
// data-charts-drawn="N">, which the headless-browser test reads.

std::string ChartBlock(const std::string& name, const json& spec, const json& values,
                       const std::string& note) {
  std::string s = fmt::format("<div id=\"chart-{}\" class=\"vl-chart\"></div>", name);
  s += fmt::format("<script type=\"application/json\" id=\"vl-spec-{}\">{}</script>", name,
                   EscapeJsonForScript(spec.dump()));
  s += fmt::format("<script type=\"application/json\" id=\"vl-data-{}\">{}</script>", name,
                   EscapeJsonForScript(values.dump()));
  if (!note.empty()) s += "<p class=\"note\">" + note + "</p>";
  return s;
}

json BaseSpec(const std::string& title) {
  return {{"$schema", "https://vega.github.io/schema/vega-lite/v6.json"},
          {"title", title},
          {"width", 720},
          {"height", 240}};
}

std::string VegaSpeedChart(const std::vector<LedgerRun>& runs) {
  json values = json::array();
  int order = 0;
  for (const auto& r : runs) {
    if (!r.valid || !r.conventional) continue;  // INVALID runs never show a speed
    values.push_back({{"run_id", r.run_id},
                      {"label", r.label},
                      {"started_utc", r.started_utc},
                      {"order", order++},
                      {"conventional", *r.conventional},
                      {"historical", r.historical ? json(*r.historical) : json(nullptr)}});
  }
  json spec = BaseSpec("Decode speed per run (conventional median, tok/s)");
  const json tooltip =
      json::array({{{"field", "run_id"}, {"type", "nominal"}},
                   {{"field", "started_utc"}, {"type", "nominal"}},
                   {{"field", "conventional"}, {"type", "quantitative"}, {"format", ".2f"}},
                   {{"field", "historical"}, {"type", "quantitative"}, {"format", ".2f"}}});
  // Time in UTC with short labels that do not overlap; tok/s on an axis that spans the data (not
  // zero), so a 1 % difference is visible.
  spec["encoding"] = {
      {"x",
       {{"field", "started_utc"},
        {"type", "temporal"},
        {"title", "run started (UTC)"},
        {"scale", {{"type", "utc"}}},
        {"axis",
         {{"format", "%m-%d %H:%M"},
          {"formatType", "utc"},
          {"labelAngle", -30},
          {"labelOverlap", "greedy"},
          {"tickCount", 8}}}}},
      {"y",
       {{"field", "conventional"},
        {"type", "quantitative"},
        {"title", "tok/s"},
        {"scale", {{"zero", false}, {"nice", true}}}}},
      {"color", {{"field", "label"}, {"type", "nominal"}}}};
  spec["layer"] = json::array({{{"mark", {{"type", "line"}, {"opacity", 0.5}}}},
                               {{"mark", {{"type", "point"}, {"filled", true}, {"size", 60}}},
                                {"encoding", {{"tooltip", tooltip}}}}});
  return ChartBlock("speed", spec, values,
                    values.empty() ? "No valid run with a speed yet."
                                   : "Conventional 99-interval median per valid run, coloured by "
                                     "label; hover a point for its run id.");
}

std::string VegaGapChart(const LedgerRun* latest) {
  json values = json::array();
  std::string note = "No valid run.";
  if (latest) {
    auto gaps = ReadGapsMs(*latest);
    if (!gaps) {
      note = "No timings.csv for " + HtmlEscape(latest->run_id) + ".";
    } else if (gaps->empty()) {
      note = "No token gaps recorded.";
    } else {
      const double top = GapTop(*gaps);
      int over = 0;
      for (double g : *gaps) {
        if (g > top) {
          ++over;
        } else {
          values.push_back({{"gap_ms", g}});
        }
      }
      note = fmt::format("{} gaps of run {}; {} above the 99th percentile ({:.3f} ms) not drawn.",
                         gaps->size(), HtmlEscape(latest->run_id), over, top);
    }
  }
  json spec = BaseSpec("Token gaps (ms), latest valid run");
  spec["mark"] = "bar";
  spec["encoding"] = {
      {"x",
       {{"field", "gap_ms"},
        {"type", "quantitative"},
        {"bin", {{"maxbins", 30}}},
        {"title", "gap (ms)"}}},
      {"y", {{"aggregate", "count"}, {"type", "quantitative"}, {"title", "tokens"}}}};
  return ChartBlock("gaps", spec, values, note);
}

std::string VegaCompareChart(const std::vector<LedgerRun>& ctl,
                             const std::vector<LedgerRun>& cand) {
  json values = json::array();
  for (const auto* side : {&ctl, &cand}) {
    for (const auto& r : *side) {
      if (!r.valid || !r.conventional) continue;
      values.push_back(
          {{"run_id", r.run_id}, {"label", r.label}, {"conventional", *r.conventional}});
    }
  }
  json spec = BaseSpec("Control against candidate: each run's median and the side's median");
  spec["height"] = 200;
  spec["width"] = 360;
  const json x = {{"field", "label"},
                  {"type", "nominal"},
                  {"sort", json::array({"control", "candidate"})},
                  {"title", nullptr}};
  spec["layer"] = json::array(
      {{{"mark", {{"type", "point"}, {"filled", true}, {"size", 70}}},
        {"encoding",
         {{"x", x},
          {"y",
           {{"field", "conventional"},
            {"type", "quantitative"},
            {"title", "tok/s"},
            {"scale", {{"zero", false}}}}},
          {"color", {{"field", "label"}, {"type", "nominal"}}},
          {"tooltip",
           json::array(
               {{{"field", "run_id"}, {"type", "nominal"}},
                {{"field", "conventional"}, {"type", "quantitative"}, {"format", ".2f"}}})}}}},
       {{"mark", {{"type", "tick"}, {"thickness", 2}, {"size", 40}, {"color", "#333"}}},
        {"encoding",
         {{"x", x},
          {"y",
           {{"aggregate", "median"}, {"field", "conventional"}, {"type", "quantitative"}}}}}}});
  return ChartBlock("compare", spec, values, "");
}

std::string VegaChecksChart(const std::vector<LedgerRun>& runs) {
  json values = json::array();
  for (const auto& r : runs) {
    auto text = ReadTextFile((fs::path(r.dir) / "checks.json").string());
    if (!text.ok()) continue;
    try {
      for (const auto& c : json::parse(*text)) {
        values.push_back({{"run_id", r.run_id},
                          {"check", c.value("name", "")},
                          {"status", c.value("status", "")},
                          {"detail", c.value("detail", "")}});
      }
    } catch (const json::exception&) {
      // The table below says the file is not valid JSON; the chart just leaves the run out.
    }
  }
  json spec = BaseSpec("Checks per run");
  spec.erase("width");
  spec["height"] = {{"step", 18}};
  spec["width"] = {{"step", 28}};
  spec["mark"] = {{"type", "rect"}, {"stroke", "white"}};
  spec["encoding"] = {
      {"x", {{"field", "check"}, {"type", "nominal"}, {"title", nullptr}}},
      {"y", {{"field", "run_id"}, {"type", "nominal"}, {"title", nullptr}}},
      {"color",
       {{"field", "status"},
        {"type", "nominal"},
        {"scale",
         {{"domain", json::array({"PASS", "FAIL", "INVALID", "NOT_APPLICABLE", "SIMULATED"})},
          {"range", json::array({"#2a7d2a", "#d62728", "#7f0000", "#bbbbbb", "#9ecae1"})}}}}},
      {"tooltip", json::array({{{"field", "run_id"}, {"type", "nominal"}},
                               {{"field", "check"}, {"type", "nominal"}},
                               {{"field", "status"}, {"type", "nominal"}},
                               {{"field", "detail"}, {"type", "nominal"}}})}};
  return ChartBlock("checks", spec, values, "Hover a cell for the check's detail.");
}

// Loads every chart; a chart that fails says so in its div instead of leaving it blank.
constexpr const char* kEmbedScript = R"JS(
(function () {
  var divs = document.querySelectorAll('div.vl-chart');
  var drawn = 0, jobs = [];
  function fail(div, e) {
    div.textContent = 'chart failed: ' + e;
    div.setAttribute('data-chart-error', String(e));
  }
  divs.forEach(function (div) {
    var name = div.id.replace('chart-', '');
    try {
      var spec = JSON.parse(document.getElementById('vl-spec-' + name).textContent);
      spec.data = {values: JSON.parse(document.getElementById('vl-data-' + name).textContent)};
      jobs.push(vegaEmbed(div, spec, {renderer: 'svg', actions: false}).then(function () {
        drawn++;
      }, function (e) { fail(div, e); }));
    } catch (e) {
      fail(div, e);
    }
  });
  Promise.all(jobs).then(function () {
    document.body.setAttribute('data-charts-drawn', String(drawn));
  });
})();
)JS";

}  // namespace

Result<std::string> BuildReportHtml(const std::string& runs_dir, const ReportOptions& opts) {
  auto listed = LedgerList(runs_dir);
  if (!listed.ok() && listed.status().code() == StatusCode::kNotFound &&
      !ListIncompleteRuns(runs_dir).empty()) {
    listed = std::vector<LedgerRun>{};  // only killed runs so far: the report lists them
  }
  DL_ASSIGN_OR_RETURN(std::vector<LedgerRun> runs, std::move(listed));
  const ReportBundles bundles = LoadReportBundles(opts.bundles_dir);
  std::string h =
      "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>decodelab lab report</title>"
      "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}"
      "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;"
      "font-size:13px;text-align:left}.PASS{color:#2a7d2a}.FAIL{color:#c00}.INVALID{color:#c00;"
      "font-weight:bold}.NOT_APPLICABLE,.SIMULATED{color:#888}.note{color:#555;font-size:12px}"
      ".missing{background:#fff3cd;border:1px solid #e0c060;padding:4px 8px}"
      "</style></head><body><h1>decodelab lab report</h1>";
  std::time_t now = std::time(nullptr);
  char stamp[64];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  h += fmt::format(
      "<p class=\"note\">{} run(s) in {}; generated {}. Speeds of INVALID runs are "
      "never shown.</p>",
      runs.size(), HtmlEscape(fs::absolute(runs_dir).string()), stamp);
  h += "<h2>Runs</h2><table><tr><th>run id</th><th>label</th><th>mode</th><th>verdict</th>"
       "<th>exact</th><th>conventional tok/s</th><th>historical tok/s</th><th>stream tok/s</th>"
       "<th>TTFT median / p99 (ms)</th><th>ITL median / p99 (ms)</th><th>backend</th>"
       "<th>KV dtype</th><th>page size</th><th>serve flags</th><th>speculative</th></tr>";
  for (const auto& r : runs) {
    auto num = [&](const std::optional<double>& v) {
      return v && r.valid ? fmt::format("{:.2f}", *v) : std::string("&ndash;");
    };
    const json manifest = RunFile(r, "manifest.json");
    const json state = RunFile(r, "state.json");
    const json summary = RunFile(r, "summary.json");
    // Latencies are speeds too: never shown for an INVALID run.
    auto latency = [&](const char* key) {
      const json d = summary.value(key, json::object());
      if (!r.valid || !d.is_object() || !d.contains("median_ms") || !d.contains("p99_ms")) {
        return std::string("&ndash;");
      }
      return fmt::format("{:.2f} / {:.2f}", d["median_ms"].get<double>(), d["p99_ms"].get<double>());
    };
    auto text = [](const json& v) {
      if (v.is_string()) return HtmlEscape(v.get<std::string>());
      if (v.is_number()) return v.dump();
      return std::string("&ndash;");
    };
    const json kv = state.contains("kv_dtype") ? state["kv_dtype"] : manifest.value("kv_dtype", json());
    const std::string flags = ServeFlags(manifest);
    h += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td><td>{}/{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
        "<td><code>{}</code></td><td>{}</td></tr>",
        HtmlEscape(r.run_id), HtmlEscape(r.label), HtmlEscape(r.mode), HtmlEscape(r.verdict),
        HtmlEscape(r.verdict), r.exact, r.prompts, num(r.conventional), num(r.historical),
        num(r.stream), latency("ttft"), latency("itl"), text(manifest.value("backend", json())),
        text(kv), text(state.value("page_size", json())),
        flags.empty() ? "&ndash;" : HtmlEscape(flags), SpecCell(summary));
  }
  h += "</table>";
  if (const auto incomplete = ListIncompleteRuns(runs_dir); !incomplete.empty()) {
    h += "<h2>Incomplete runs</h2><p class=\"note\">Run directories without a result (the run "
         "was killed or stopped before its ledger row); their partial files are not results.</p>"
         "<table id=\"incomplete-runs\"><tr><th>run id</th><th>label</th><th>mode</th>"
         "<th>started</th><th>directory</th></tr>";
    for (const auto& r : incomplete) {
      h += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", HtmlEscape(r.run_id),
          HtmlEscape(r.label), HtmlEscape(r.mode), HtmlEscape(r.started_utc), HtmlEscape(r.dir));
    }
    h += "</table>";
  }
  if (!bundles.found) {
    h +=
        "<p class=\"missing\" id=\"charts-missing\">charts missing: Vega-Lite bundles not found (" +
        HtmlEscape(bundles.reason) +
        "; build with npm available, or pass --bundles DIR). Simple inline charts and every table "
        "follow.</p>";
  }
  h += SpecSection(runs);
  h += "<h2>Decode speed over time</h2>";
  h += bundles.found ? VegaSpeedChart(runs) : SpeedChart(runs);
  const LedgerRun* latest = nullptr;
  for (const auto& r : runs) {
    if (r.valid && r.conventional) latest = &r;
  }
  h += "<h2>Token gaps (latest valid run)</h2>";
  if (bundles.found) {
    h += VegaGapChart(latest);
  } else {
    h += latest ? GapHistogram(*latest) : "<p>No valid run.</p>";
  }
  h += "<h2>Control against candidate</h2>";
  std::vector<LedgerRun> ctl, cand;
  for (const auto& r : runs) {
    if (r.label == "control") ctl.push_back(r);
    if (r.label == "candidate") cand.push_back(r);
  }
  if (ctl.empty() || cand.empty()) {
    // Without both sides the chart would be empty axes: say what would fill it instead.
    h += "<p class=\"note\" id=\"no-gate\">No gate has run here: this comparison needs runs "
         "labelled control and candidate, which <code>decodelab lab gate</code> writes (or "
         "<code>lab screen --label control</code> / <code>--label candidate</code>).</p>";
  } else {
    if (bundles.found) h += VegaCompareChart(ctl, cand);
    auto c = Compare("control", ctl, "candidate", cand);
    h += c.ok() ? "<p>" + HtmlEscape(c->Line()) + "</p>"
                : "<p class=\"note\">No comparison: " + HtmlEscape(c.status().message()) + ".</p>";
  }
  h += "<h2>Checks</h2>";
  if (bundles.found) h += VegaChecksChart(runs);
  for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
    h += "<h3>" + HtmlEscape(it->run_id) + " &mdash; " + HtmlEscape(it->verdict) + "</h3>" +
         CheckTable(*it);
  }
  if (bundles.found) {
    // The pinned bundles, inlined so the file opens offline; their hashes say which ones drew it.
    h += "<p class=\"note\" id=\"bundle-hashes\">Charts: Vega-Lite bundles";
    for (const auto& f : bundles.files) {
      h += fmt::format(" {} sha256:{}", HtmlEscape(f.name), f.sha256);
    }
    h += ".</p>";
    for (const auto& f : bundles.files) {
      h += fmt::format("<!-- {} sha256:{} -->\n<script>", f.name, f.sha256);
      h += EscapeScriptText(f.text);
      h += "</script>\n";
    }
    h += "<script>" + std::string(kEmbedScript) + "</script>";
  }
  return h + "</body></html>\n";
}

}  // namespace dl::lab
