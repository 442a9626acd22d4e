// `decodelab lab gate`: the resume order of lab.md §5 as a command. This file holds the plan format
// and the gate's step record (gate.json), which make --resume possible; apps/decodelab/cmd_lab.cc
// runs the steps.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl::lab {

struct GateSide {
  std::string binary;              // empty: this decodelab
  std::string lock;                // identity lock file, optional
  std::vector<std::string> flags;  // serve flags
};

struct GatePlan {
  std::string path, sha256;  // empty for the built-in A/A self-test
  std::string model_dir, shape;
  uint64_t seed = 0;
  int num_layers = 0;
  std::string suite, teacher;  // empty: the lab's defaults / recorded from the control
  GateSide control, candidate;
  std::string probe_transport;  // "nccl" or "sim"; empty: nccl with a GPU, else sim
  int probe_ranks = 0;          // 0: the GPU count (2 with sim)
};
Result<GatePlan> ParseGatePlan(const nlohmann::json& j, const std::string& path);
Result<GatePlan> ReadGatePlan(const std::string& path);

// The steps, in order (lab.md §5).
const std::vector<std::string>& GateStepNames();

struct GateStep {
  std::string name;
  std::string status;  // PASS, FAIL, INVALID, NOT_APPLICABLE, SIMULATED, SKIPPED
  std::string detail;
  std::vector<std::string> run_ids;
};
// A step lets the gate go on when it is not FAIL or INVALID.
bool StepPassed(const GateStep& s);

struct GateRecord {
  std::string gate_id, plan_sha256;
  std::vector<GateStep> steps;                      // completed steps, in order
  std::string verdict;                              // empty until the verdict step ran
  nlohmann::json extra = nlohmann::json::object();  // teacher path, medians

  nlohmann::json ToJson() const;
  static Result<GateRecord> FromJson(const nlohmann::json& j, const std::string& what);
  // The index of the first step to run on --resume: after the last passed step of the leading run
  // of passed steps.
  size_t ResumeIndex() const;
};

}  // namespace dl::lab
