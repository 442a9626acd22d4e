// `decodelab lab report`: one self-contained HTML file (inline CSS and SVG, no script, no network)
// over the ledger: decode speed per run and label over time, the distribution of token gaps,
// control against candidate, and every run's check table (lab.md §7).
#pragma once

#include <string>

#include "base/status.h"

namespace dl::lab {

Result<std::string> BuildReportHtml(const std::string& runs_dir);
std::string HtmlEscape(const std::string& s);

}  // namespace dl::lab
