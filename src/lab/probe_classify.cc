// Names, fault-injection parsing and the classification table of lab.md §4.
#include <fmt/format.h>

#include "comm/launch_env.h"
#include "lab/probe.h"

namespace dl::lab {
namespace {

constexpr const char* kStageNames[kNumStages] = {
    "import-done",      "device-set",      "comm-initialised", "tensor-allocated",
    "all_reduce-start", "all_reduce-done", "result-checked",   "teardown-done",
};

constexpr const char* kKindNames[] = {"hang", "exit", "wrong-value", "no-markers"};

}  // namespace

const char* StageName(Stage stage) {
  return kStageNames[static_cast<int>(stage)];
}

std::optional<Stage> StageFromName(std::string_view name) {
  for (int i = 0; i < kNumStages; ++i) {
    if (name == kStageNames[i]) return static_cast<Stage>(i);
  }
  return std::nullopt;
}

const char* ProbeClassName(ProbeClass c) {
  switch (c) {
    case ProbeClass::kNotExecuted:
      return "NOT_EXECUTED";
    case ProbeClass::kLaunchFailure:
      return "LAUNCH_FAILURE";
    case ProbeClass::kInitStageFailure:
      return "INIT_STAGE_FAILURE";
    case ProbeClass::kCollectiveStageFailure:
      return "COLLECTIVE_STAGE_FAILURE";
    case ProbeClass::kResultMismatch:
      return "RESULT_MISMATCH";
    case ProbeClass::kTeardownFailure:
      return "TEARDOWN_FAILURE";
    case ProbeClass::kPass:
      return "PASS";
  }
  return "UNKNOWN";
}

int ProbeExitCode(ProbeClass c) {
  switch (c) {
    case ProbeClass::kNotExecuted:
      return 8;
    case ProbeClass::kLaunchFailure:
      return 2;
    case ProbeClass::kInitStageFailure:
      return 3;
    case ProbeClass::kCollectiveStageFailure:
      return 4;
    case ProbeClass::kResultMismatch:
      return 5;
    case ProbeClass::kTeardownFailure:
      return 6;
    case ProbeClass::kPass:
      return 0;
  }
  return 1;
}

const char* TransportName(Transport t) {
  return t == Transport::kSim ? "sim" : "nccl";
}

Result<Transport> ParseTransport(std::string_view name) {
  if (name == "nccl") return Transport::kNccl;
  if (name == "sim") return Transport::kSim;
  return InvalidArgument("unknown transport '{}' (expected nccl or sim)", name);
}

std::string Injection::ToString() const {
  return fmt::format("{}:{}:{}", StageName(stage), rank, kKindNames[static_cast<int>(kind)]);
}

Result<Injection> ParseInjection(std::string_view text) {
  size_t a = text.find(':');
  size_t b = a == std::string_view::npos ? a : text.find(':', a + 1);
  if (b == std::string_view::npos || text.find(':', b + 1) != std::string_view::npos) {
    return InvalidArgument("--inject '{}' is not STAGE:RANK:KIND", text);
  }
  Injection inj;
  std::optional<Stage> stage = StageFromName(text.substr(0, a));
  if (!stage) {
    return InvalidArgument(
        "--inject '{}': unknown stage '{}' (import-done, device-set, comm-initialised, "
        "tensor-allocated, all_reduce-start, all_reduce-done, result-checked, teardown-done)",
        text, text.substr(0, a));
  }
  inj.stage = *stage;
  DL_ASSIGN_OR_RETURN(long long rank,
                      comm::ParseInteger(text.substr(a + 1, b - a - 1),
                                         fmt::format("rank of --inject '{}'", text)));
  if (rank < 0) return InvalidArgument("--inject '{}': rank {} is negative", text, rank);
  inj.rank = static_cast<int>(rank);
  std::string_view kind = text.substr(b + 1);
  bool found = false;
  for (int i = 0; i < 4; ++i) {
    if (kind == kKindNames[i]) {
      inj.kind = static_cast<InjectKind>(i);
      found = true;
    }
  }
  if (!found) {
    return InvalidArgument("--inject '{}': unknown kind '{}' (hang, exit, wrong-value, no-markers)",
                           text, kind);
  }
  return inj;
}

bool RankOutcome::AnyMarker() const {
  for (bool h : has) {
    if (h) return true;
  }
  return false;
}

std::optional<Stage> RankOutcome::LastStage() const {
  for (int i = kNumStages - 1; i >= 0; --i) {
    if (has[i]) return static_cast<Stage>(i);
  }
  return std::nullopt;
}

namespace {

std::string Describe(const RankOutcome& r) {
  std::optional<Stage> last = r.LastStage();
  std::string s = fmt::format("last marker {}; ", last ? StageName(*last) : "none");
  if (!r.started) {
    s += "never started";
  } else if (r.killed_by_supervisor) {
    s += "killed by the supervisor (no progress within the stage timeout)";
  } else {
    s += r.exit.ToString();
  }
  if (r.exit.exited && r.exit.code == kRankTimeoutExitCode) s += ", its own stage deadline passed";
  if (!r.error.empty()) s += "; it said: " + r.error;
  return s;
}

}  // namespace

Classification Classify(const std::vector<RankOutcome>& ranks) {
  Classification out;
  for (const RankOutcome& r : ranks) {
    if (r.Has(Stage::kTeardownDone) && r.exit.exited && r.exit.code == 0 &&
        !r.killed_by_supervisor) {
      ++out.clean_teardowns;
    }
  }
  // Each row: the class and a predicate; the first row any rank matches wins.
  struct Row {
    ProbeClass cls;
    std::function<bool(const RankOutcome&)> match;
    const char* why;
  };
  const Row rows[] = {
      {ProbeClass::kNotExecuted,
       [](const RankOutcome& r) {
         return r.started && r.exit.exited && r.exit.code == 0 && !r.killed_by_supervisor &&
                !r.AnyMarker();
       },
       "exited 0 but wrote none of the probe's markers"},
      {ProbeClass::kLaunchFailure, [](const RankOutcome& r) { return !r.Has(Stage::kImportDone); },
       "lacks import-done"},
      {ProbeClass::kInitStageFailure,
       [](const RankOutcome& r) { return !r.Has(Stage::kCommInitialised); },
       "lacks comm-initialised"},
      {ProbeClass::kCollectiveStageFailure,
       [](const RankOutcome& r) { return !r.Has(Stage::kAllReduceDone); }, "lacks all_reduce-done"},
      {ProbeClass::kResultMismatch,
       [](const RankOutcome& r) { return r.Has(Stage::kResultChecked) && r.result == "mismatch"; },
       "reports result-checked mismatch"},
      {ProbeClass::kTeardownFailure,
       [](const RankOutcome& r) {
         return !r.Has(Stage::kResultChecked) || !r.Has(Stage::kTeardownDone);
       },
       "lacks result-checked or teardown-done"},
  };
  for (const Row& row : rows) {
    std::vector<std::string> hits;
    for (const RankOutcome& r : ranks) {
      if (row.match(r)) hits.push_back(fmt::format("rank {} ({})", r.rank, Describe(r)));
    }
    if (!hits.empty()) {
      out.cls = row.cls;
      out.reason = fmt::format("{}: {}", row.why, fmt::join(hits, "; "));
      return out;
    }
  }
  out.cls = ProbeClass::kPass;
  out.reason = fmt::format("all {} ranks wrote every marker, result ok", ranks.size());
  return out;
}

}  // namespace dl::lab
