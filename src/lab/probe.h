// `decodelab probe`: the collective health probe of lab.md §4. A supervisor launches one process
// per rank (this binary re-executed with the hidden `__probe-rank` subcommand, each in its own
// process group), every rank writes fsync'd stage markers to its own log, the supervisor kills the
// process group of a rank that stops making progress, then classifies the run from the marker logs
// and the exit statuses with the first matching row of the contract's table.
#pragma once

#include <sys/types.h>

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "comm/launch_env.h"
#include "comm/process.h"

namespace dl::lab {

// The stage markers, in the order every rank writes them.
enum class Stage {
  kImportDone = 0,
  kDeviceSet,
  kCommInitialised,
  kTensorAllocated,
  kAllReduceStart,
  kAllReduceDone,
  kResultChecked,
  kTeardownDone,
};
inline constexpr int kNumStages = 8;
const char* StageName(Stage stage);  // "import-done", "all_reduce-start", ...
std::optional<Stage> StageFromName(std::string_view name);

enum class ProbeClass {
  kNotExecuted,
  kLaunchFailure,
  kInitStageFailure,
  kCollectiveStageFailure,
  kResultMismatch,
  kTeardownFailure,
  kPass,
};
const char* ProbeClassName(ProbeClass c);  // "COLLECTIVE_STAGE_FAILURE"
int ProbeExitCode(ProbeClass c);           // 8, 2, 3, 4, 5, 6, 0

enum class Transport { kNccl, kSim };
const char* TransportName(Transport t);
Result<Transport> ParseTransport(std::string_view name);

// --inject STAGE:RANK:KIND (see lab.md §4 for what each kind does).
enum class InjectKind { kHang, kExit, kWrongValue, kNoMarkers };
struct Injection {
  Stage stage = Stage::kImportDone;
  int rank = 0;
  InjectKind kind = InjectKind::kHang;
  std::string ToString() const;  // the STAGE:RANK:KIND form
};
Result<Injection> ParseInjection(std::string_view text);

// A rank's exit code when its own stage deadline passed (the supervisor's kill is the backstop).
inline constexpr int kRankTimeoutExitCode = 124;

// What the supervisor knows about one rank once it has ended.
struct RankOutcome {
  int rank = 0;
  bool started = false;                // the process was created
  std::array<bool, kNumStages> has{};  // which markers its log holds
  std::string result;                  // result-checked's "ok" / "mismatch"; empty when absent
  comm::ExitInfo exit;                 // how it ended
  bool killed_by_supervisor = false;
  std::string error;  // the rank's own last error line, if it wrote one

  bool Has(Stage s) const { return has[static_cast<int>(s)]; }
  bool AnyMarker() const;
  std::optional<Stage> LastStage() const;  // the furthest marker written
};

struct Classification {
  ProbeClass cls = ProbeClass::kPass;
  int clean_teardowns = 0;  // wrote teardown-done and exited 0 on its own
  std::string reason;       // which rank matched which row, for humans
};
// lab.md §4's table: the first row (top to bottom) that any rank matches.
Classification Classify(const std::vector<RankOutcome>& ranks);

// One rank process (the hidden `__probe-rank` subcommand).
struct RankOptions {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // also the CUDA device index
  Transport transport = Transport::kSim;
  double timeout_s = 60;
  size_t bytes = 1 << 20;
  int iters = 20;
  int warmup = -1;  // -1: 5 for nccl (as nccl-tests), 1 for sim
  std::string marker_file;
  comm::Endpoint rdzv{"127.0.0.1", 0};
  int rdzv_fd = -1;  // rank 0: an inherited listening socket
  std::vector<Injection> injections;
  std::string run_id;
};
// Parses the rank's argv (after `__probe-rank`). --rank/--world-size/--local-rank default to the
// launcher's environment (mpirun, PMI, Slurm) and --rdzv to DL_MASTER_ADDR/MASTER_ADDR, so a rank
// can also be started by a cluster launcher directly.
Result<RankOptions> ParseRankArgs(const std::vector<std::string>& args);
std::vector<std::string> RankArgs(const RankOptions& options);
// Runs one rank; returns its exit code: 0, 1 (a stage failed), kRankTimeoutExitCode. A caller
// should leave with _exit() on a non-zero code: NCCL's exit-time destructors may hang after a
// failure.
int RunProbeRank(const RankOptions& options);

struct ProbeOptions {
  int ranks = 2;  // ranks launched on this host (one per GPU)
  Transport transport = Transport::kNccl;
  double timeout_s = 60;  // per stage
  size_t bytes = 1 << 20;
  int iters = 20;
  std::string log_dir;  // empty: runs/probe-<UTC time>
  std::vector<Injection> injections;
  // Multi-host: this host's index and the host count; rank 0's endpoint (ignored when nnodes == 1).
  int nnodes = 1;
  int node_rank = 0;
  std::optional<comm::Endpoint> master;
  // How to start a rank: rank_exe with rank_argv_prefix (argv[0] and the hidden subcommand) then
  // the rank's options.
  std::string rank_exe = "/proc/self/exe";
  std::vector<std::string> rank_argv_prefix = {"decodelab", "__probe-rank"};
  std::function<void(const std::string&)> progress;  // human progress lines; may be empty
};

struct AllReduceStats {
  bool measured = false;  // every rank reported a timing
  size_t bytes = 0;
  size_t count = 0;  // float32 elements
  int iters = 0;
  double time_us = 0;      // mean over ranks of each rank's mean time per op (nccl-tests' average)
  double time_us_max = 0;  // slowest rank
  double algbw_gbs = 0;    // bytes / time
  double busbw_gbs = 0;    // algbw * 2(n-1)/n
  long long wrong = -1;    // mismatching elements summed over ranks; -1 when not checked
};

struct ProbeReport {
  ProbeClass cls = ProbeClass::kPass;
  int exit_code = 0;
  int clean_teardowns = 0;
  int ranks = 0;
  Transport transport = Transport::kNccl;
  std::string reason;
  std::string run_id;
  std::string log_dir;
  std::string json_path;  // <log_dir>/probe.json (probe.node<K>.json when nnodes > 1)
  std::vector<RankOutcome> outcomes;
  std::vector<pid_t> pids;  // every rank process started (all reaped when RunProbe returns)
  AllReduceStats stats;
  double duration_s = 0;
  nlohmann::json json;  // what probe.json holds
};

// Runs the probe; an error only when it could not run at all (bad options, unwritable log dir).
// Every rank process is reaped and its process group killed before this returns.
Result<ProbeReport> RunProbe(const ProbeOptions& options);

// `PROBE_RESULT=<class> clean_teardowns=<k>/<n>`, plus ` transport=sim` for the simulated
// transport.
std::string ResultLine(const ProbeReport& report);
// The nccl-tests-style table row(s) and per-rank summary printed before the result line.
std::string SummaryText(const ProbeReport& report);

}  // namespace dl::lab
