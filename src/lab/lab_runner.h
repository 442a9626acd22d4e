// `decodelab lab screen|suite|teacher`: starts `decodelab serve` as a child (or uses a running
// endpoint), verifies identity, runs every prompt streamed, runs the checks of lab.md §2, computes
// the statistics of §3 and writes the run directory and ledger rows of §7.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "lab/lab_checks.h"
#include "lab/lab_ledger.h"
#include "lab/lab_repro.h"
#include "lab/lab_stats.h"
#include "lab/lab_suite.h"

namespace dl::lab {

struct LabOptions {
  std::string mode = "screen";  // "screen", "suite" or "teacher"
  std::string binary;           // engine binary to serve and hash (default /proc/self/exe)
  // False for --endpoint without --binary: the served binary_sha256 is then the identity (the
  // running server need not be this lab's binary).
  bool hash_binary = true;
  // Flags that name the model and backend for serve ("--model DIR" or "--shape NAME ...",
  // "--backend X"); the lab adds --port 0 --host 127.0.0.1 --kv-dtype --kv-scales.
  std::vector<std::string> model_args;
  std::vector<std::string> serve_extra;  // after `--`
  // Speculative decoding flags for serve ("--spec ngram --spec-k 4 ..."; empty: plain decoding).
  // A screen, suite or reproducer's server gets them; a teacher's never does: the teacher is the
  // plain-decoding reference a speculative run must equal token for token.
  std::vector<std::string> spec_args;
  std::string endpoint;                  // a running server instead of a child
  Suite suite;
  std::string teacher_path;  // required except in teacher mode (where it is the output)
  std::string runs_dir = "runs";
  std::string label = "lab";
  std::optional<IdentityLock> lock;
  std::string lock_path;
  bool accept_identity = false;
  int repeats = 1;         // a suite runs twice by default
  int sliding_window = 0;  // for computed rollover prompts (0: page size only)
  int vocab_limit = 512;   // synthetic ids stay below this
  double server_start_timeout_s = 300;
  double request_timeout_s = 600;  // one HTTP request to the server, start to end
  // Turns a text prompt into token ids (the model's tokenizer); null: text prompts are an error.
  std::function<Result<std::vector<int32_t>>(const std::string&)> tokenize;
  std::function<void(const std::string&)> progress;  // progress lines (stderr)
};

struct RunOutcome {
  std::string run_id, dir, verdict;
  bool valid = false;
  std::vector<CheckRow> checks;
  nlohmann::json summary;
};

// Runs a screen or suite (options.repeats times, one run id each).
Result<std::vector<RunOutcome>> RunScreenOrSuite(const LabOptions& options);
// Records a teacher transcript to options.teacher_path.
Status RecordTeacher(const LabOptions& options);

// Replays a reproducer against a fresh server (options.suite supplies kv_dtype and calibration):
// precursors in order, then the target; the row is PASS when the target's tokens equal `expected`.
Result<CheckRow> RunRepro(const LabOptions& options, const Repro& repro);

// The summary key of the statistic that compares a run's speed with others: the stream rate for a
// speculative run (its per-event statistics are null, lab_stats.h says why), else the conventional
// median. `lab compare` and the gate use the stream rate for both sides when either is speculative.
const char* SpeedKey(const nlohmann::json& summary);

// "<label>-<short commit>-<UTC yyyymmddTHHMMSSZ>".
std::string MakeRunId(const std::string& label, const std::string& commit, std::time_t t);
// The short table printed after a run.
std::string FormatRunTable(const RunOutcome& run);

}  // namespace dl::lab
