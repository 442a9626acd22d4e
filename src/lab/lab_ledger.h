// The ledger (lab.md §1): a SQLite database in the runs directory indexing every run, check and
// metric, so `decodelab lab runs` and `lab compare` need not re-read run directories.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "lab/lab_checks.h"

namespace dl::lab {

struct LedgerRun {
  std::string run_id, label, mode, commit, started_utc, verdict, dir;
  bool valid = false;
  int exact = 0, prompts = 0;
  std::optional<double> conventional, historical;  // absent for invalid and speculative runs
  std::vector<double> per_prompt_conventional;
  // From the metrics table (filled by LedgerList/LedgerSelect; LedgerRecord takes them from its
  // metrics argument): decode_tok_s_stream_median, and for a run with speculative decoding
  // spec_decode_num_speculative_tokens (its presence marks the run speculative) and
  // spec_decode_mean_acceptance_length (absent without drafts).
  std::optional<double> stream;
  bool speculative = false;
  std::optional<double> mean_acceptance_length;
};

std::string LedgerPath(const std::string& runs_dir);  // <runs_dir>/ledger.sqlite

// A run directory whose run never finished (killed, or stopped by an error before its ledger row
// was written): the lab writes this marker when it creates the directory and removes it last.
inline constexpr const char* kIncompleteMarker = "INCOMPLETE";
struct IncompleteRun {
  std::string run_id, dir, mode, label, started_utc;
};
// The run directories of `runs_dir` that still hold the marker and have no ledger row, by run id.
std::vector<IncompleteRun> ListIncompleteRuns(const std::string& runs_dir);
// Inserts (or replaces) a run with its checks and metrics.
Status LedgerRecord(const std::string& runs_dir, const LedgerRun& run,
                    const std::vector<CheckRow>& checks,
                    const std::map<std::string, double>& metrics);
Result<std::vector<LedgerRun>> LedgerList(const std::string& runs_dir);
// Runs selected by run id, else every run with that label.
Result<std::vector<LedgerRun>> LedgerSelect(const std::string& runs_dir, const std::string& key);

// The comparison of lab.md §3: both medians, the spread of each side's repeats and whether the
// difference exceeds the larger repeat spread.
// When either side has a speculative run, both sides are compared by their stream rate
// (decode_tok_s_stream_median: a speculative run has no per-event statistics), and the line says
// so.
struct Comparison {
  std::string a, b;
  std::string statistic = "conventional";  // or "stream"
  double median_a = 0, median_b = 0;       // `statistic`, median over the side's valid runs
  double hmedian_a = 0, hmedian_b = 0;     // historical (0 when comparing by stream)
  double spread_a = 0, spread_b = 0;    // max - min of the side's run medians
  int runs_a = 0, runs_b = 0;
  bool spread_known = false;  // some side has at least two runs
  bool exceeds = false;
  std::string Line() const;
};
Result<Comparison> Compare(const std::string& a, const std::vector<LedgerRun>& ra,
                           const std::string& b, const std::vector<LedgerRun>& rb);

}  // namespace dl::lab
