#include "lab/lab_report.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

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

namespace {

const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};

// Conventional median per valid run, in ledger order, one colour per label.
std::string SpeedChart(const std::vector<LedgerRun>& runs) {
  std::vector<const LedgerRun*> pts;
  for (const auto& r : runs) {
    if (r.valid && r.conventional) pts.push_back(&r);
  }
  if (pts.empty()) return "<p>No valid run with a speed yet.</p>";
  std::map<std::string, int> colour;
  for (const auto* r : pts) colour.emplace(r->label, static_cast<int>(colour.size()) % 6);
  double hi = 0;
  for (const auto* r : pts) hi = std::max(hi, *r->conventional);
  hi = hi > 0 ? hi * 1.1 : 1;
  const int w = 720, h = 260, l = 60, b = 30;
  std::string s = fmt::format("<svg width=\"{}\" height=\"{}\" role=\"img\">", w, h + 20);
  s += fmt::format("<line x1=\"{0}\" y1=\"10\" x2=\"{0}\" y2=\"{1}\" stroke=\"#888\"/>", l, h - b);
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"#888\"/>", l, h - b,
                   w - 10);
  for (int i = 0; i <= 4; ++i) {
    const double v = hi * i / 4;
    const double y = (h - b) - (h - b - 10) * i / 4.0;
    s += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\">{:.0f}</text>", l - 4,
        y + 3, v);
  }
  const double step = pts.size() > 1 ? (w - l - 30.0) / (pts.size() - 1) : 0;
  for (size_t i = 0; i < pts.size(); ++i) {
    const double x = l + 10 + step * i;
    const double y = (h - b) - (h - b - 10) * (*pts[i]->conventional / hi);
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
       "first; hover a point for its run id.</p>";
  return s;
}

// Histogram of the token gaps (ms) of one run's timings.csv, first token excluded.
std::string GapHistogram(const LedgerRun& run) {
  std::ifstream in(fs::path(run.dir) / "timings.csv");
  if (!in) return "<p>No timings.csv for " + HtmlEscape(run.run_id) + ".</p>";
  std::vector<double> gaps;
  std::string line;
  std::getline(in, line);  // header
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
  if (gaps.empty()) return "<p>No token gaps recorded.</p>";
  std::sort(gaps.begin(), gaps.end());
  // Bins up to the 99th percentile, so one stall does not flatten the picture; the rest are
  // counted.
  const double top = std::max(gaps[static_cast<size_t>(0.99 * (gaps.size() - 1))], 1e-6);
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

}  // namespace

Result<std::string> BuildReportHtml(const std::string& runs_dir) {
  DL_ASSIGN_OR_RETURN(std::vector<LedgerRun> runs, LedgerList(runs_dir));
  std::string h =
      "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>decodelab lab report</title>"
      "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}"
      "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;"
      "font-size:13px;text-align:left}.PASS{color:#2a7d2a}.FAIL{color:#c00}.INVALID{color:#c00;"
      "font-weight:bold}.NOT_APPLICABLE,.SIMULATED{color:#888}.note{color:#555;font-size:12px}"
      "</style></head><body><h1>decodelab lab report</h1>";
  std::time_t now = std::time(nullptr);
  char stamp[64];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  h += fmt::format(
      "<p class=\"note\">{} run(s) in {}; generated {}. Speeds of INVALID runs are "
      "never shown.</p>",
      runs.size(), HtmlEscape(fs::absolute(runs_dir).string()), stamp);
  h += "<h2>Runs</h2><table><tr><th>run id</th><th>label</th><th>mode</th><th>verdict</th>"
       "<th>exact</th><th>conventional tok/s</th><th>historical tok/s</th></tr>";
  for (const auto& r : runs) {
    auto num = [&](const std::optional<double>& v) {
      return v && r.valid ? fmt::format("{:.2f}", *v) : std::string("&ndash;");
    };
    h += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td><td>{}/{}</td><td>{}</td>"
        "<td>{}</td></tr>",
        HtmlEscape(r.run_id), HtmlEscape(r.label), HtmlEscape(r.mode), HtmlEscape(r.verdict),
        HtmlEscape(r.verdict), r.exact, r.prompts, num(r.conventional), num(r.historical));
  }
  h += "</table><h2>Decode speed over time</h2>" + SpeedChart(runs);
  const LedgerRun* latest = nullptr;
  for (const auto& r : runs) {
    if (r.valid && r.conventional) latest = &r;
  }
  h += "<h2>Token gaps (latest valid run)</h2>";
  h += latest ? GapHistogram(*latest) : "<p>No valid run.</p>";
  h += "<h2>Control against candidate</h2>";
  std::vector<LedgerRun> ctl, cand;
  for (const auto& r : runs) {
    if (r.label == "control") ctl.push_back(r);
    if (r.label == "candidate") cand.push_back(r);
  }
  auto c = Compare("control", ctl, "candidate", cand);
  h += c.ok() ? "<p>" + HtmlEscape(c->Line()) + "</p>"
              : "<p class=\"note\">No comparison: " + HtmlEscape(c.status().message()) +
                    " (runs labelled control and candidate, as the gate writes them).</p>";
  h += "<h2>Checks</h2>";
  for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
    h += "<h3>" + HtmlEscape(it->run_id) + " &mdash; " + HtmlEscape(it->verdict) + "</h3>" +
         CheckTable(*it);
  }
  return h + "</body></html>\n";
}

}  // namespace dl::lab
