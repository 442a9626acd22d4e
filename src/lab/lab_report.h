// `decodelab lab report`: one self-contained HTML file over the ledger (docs/lab.md): the runs
// table with each run's configuration (backend, KV dtype, page size, serve flags) and TTFT / ITL,
// decode speed per run and label over time (UTC ticks, a tok/s axis that spans the data, not zero),
// the distribution of token gaps, control against candidate (only when a gate's runs exist; a note
// otherwise), and every run's check table. With the pinned Vega-Lite bundles (tools/report-js) the
// charts are Vega-Lite specs drawn by the inlined bundles; without them the report says the charts
// are missing and draws the speed and gap charts as inline SVG. The tables are there either way.
// No network.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace dl::lab {

// The three UMD bundles, in the order they must load.
inline constexpr const char* kReportBundleFiles[] = {"vega.min.js", "vega-lite.min.js",
                                                     "vega-embed.min.js"};

struct ReportBundles {
  bool found = false;
  std::string dir;     // where they were looked for
  std::string reason;  // why not found (names the missing file)
  struct File {
    std::string name, text, sha256;
  };
  std::vector<File> files;  // kReportBundleFiles order, when found
};

// <directory of this executable>/../share/decodelab/report, where the build and `install` put them.
std::string DefaultReportBundlesDir();
// Reads the bundles from `dir` (empty: DefaultReportBundlesDir()). Never fails: a missing or
// unreadable file makes found=false with the reason.
ReportBundles LoadReportBundles(const std::string& dir);

struct ReportOptions {
  std::string bundles_dir;  // empty: DefaultReportBundlesDir()
};

Result<std::string> BuildReportHtml(const std::string& runs_dir, const ReportOptions& opts = {});
std::string HtmlEscape(const std::string& s);
// Text safe inside <script>...</script>: "</script" and "<!--" cannot end or confuse the element.
std::string EscapeScriptText(const std::string& s);
// JSON safe inside <script type="application/json">: every '<' becomes \u003c (only strings can
// hold one, so the JSON means the same).
std::string EscapeJsonForScript(const std::string& json_text);

}  // namespace dl::lab
