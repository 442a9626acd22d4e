#include "lab/lab_gate.h"

#include <filesystem>

#include "base/sha256.h"
#include "lab/lab_suite.h"

namespace dl::lab {

using nlohmann::json;

namespace {

std::string Resolve(const std::string& p, const std::string& plan_path) {
  if (p.empty() || std::filesystem::path(p).is_absolute() || plan_path.empty()) return p;
  return (std::filesystem::path(plan_path).parent_path() / p).lexically_normal().string();
}

Result<GateSide> ParseSide(const json& j, const std::string& path, const char* name) {
  GateSide s;
  if (!j.is_object()) return InvalidArgument("{}: \"{}\" must be an object", path, name);
  s.binary = Resolve(j.value("binary", ""), path);
  s.lock = Resolve(j.value("lock", ""), path);
  s.flags = j.value("flags", std::vector<std::string>{});
  return s;
}

}  // namespace

Result<GatePlan> ParseGatePlan(const json& j, const std::string& path) {
  GatePlan p;
  p.path = path;
  try {
    if (j.value("format", "") != "decodelab-lab-plan") {
      return InvalidArgument("{}: \"format\" must be \"decodelab-lab-plan\"", path);
    }
    DL_RETURN_IF_ERROR(CheckVersion(j, path));
    if (j.contains("model")) {
      const json& m = j.at("model");
      p.model_dir = Resolve(m.value("dir", ""), path);
      p.shape = m.value("shape", "");
      DL_ASSIGN_OR_RETURN(int64_t seed, JsonIntField(m, "seed", 0, 0, INT64_MAX, path + ": model"));
      p.seed = static_cast<uint64_t>(seed);
      DL_ASSIGN_OR_RETURN(int64_t layers,
                          JsonIntField(m, "num_layers", 0, 0, 1000, path + ": model"));
      p.num_layers = static_cast<int>(layers);
      if (!p.model_dir.empty() && !p.shape.empty()) {
        return InvalidArgument("{}: model: give \"dir\" or \"shape\", not both", path);
      }
    }
    p.suite = Resolve(j.value("suite", ""), path);
    p.teacher = Resolve(j.value("teacher", ""), path);
    DL_ASSIGN_OR_RETURN(p.control, ParseSide(j.value("control", json::object()), path, "control"));
    DL_ASSIGN_OR_RETURN(p.candidate,
                        ParseSide(j.value("candidate", json::object()), path, "candidate"));
    if (j.contains("probe")) {
      p.probe_transport = j.at("probe").value("transport", "");
      // 0: the GPU count (2 with sim).
      DL_ASSIGN_OR_RETURN(int64_t ranks,
                          JsonIntField(j.at("probe"), "ranks", 0, 0, 1024, path + ": probe"));
      p.probe_ranks = static_cast<int>(ranks);
      if (!p.probe_transport.empty() && p.probe_transport != "nccl" && p.probe_transport != "sim") {
        return InvalidArgument("{}: probe.transport must be nccl or sim", path);
      }
    }
  } catch (const json::exception& e) {
    return InvalidArgument("{}: {}", path, e.what());
  }
  return p;
}

Result<GatePlan> ReadGatePlan(const std::string& path) {
  DL_ASSIGN_OR_RETURN(JsonFile f, ReadJsonFile(path));
  DL_ASSIGN_OR_RETURN(GatePlan p, ParseGatePlan(f.value, std::filesystem::absolute(path).string()));
  p.sha256 = Sha256Hex(f.text);
  return p;
}

const std::vector<std::string>& GateStepNames() {
  static const std::vector<std::string> names = {
      "preflight", "probe", "teacher", "control_screen", "candidate_screen", "suite", "verdict"};
  return names;
}

bool StepPassed(const GateStep& s) {
  return s.status != "FAIL" && s.status != "INVALID";
}

json GateRecord::ToJson() const {
  json steps_j = json::array();
  for (const auto& s : steps) {
    steps_j.push_back(
        {{"name", s.name}, {"status", s.status}, {"detail", s.detail}, {"run_ids", s.run_ids}});
  }
  return {{"format", "decodelab-lab-gate"},
          {"gate_id", gate_id},
          {"plan_sha256", plan_sha256},
          {"steps", steps_j},
          {"verdict", verdict},
          {"extra", extra}};
}

Result<GateRecord> GateRecord::FromJson(const json& j, const std::string& what) {
  GateRecord r;
  try {
    if (j.value("format", "") != "decodelab-lab-gate") {
      return InvalidArgument("{}: not a gate record", what);
    }
    r.gate_id = j.value("gate_id", "");
    r.plan_sha256 = j.value("plan_sha256", "");
    r.verdict = j.value("verdict", "");
    r.extra = j.value("extra", json::object());
    for (const auto& s : j.at("steps")) {
      r.steps.push_back({s.at("name"), s.at("status"), s.value("detail", ""),
                         s.value("run_ids", std::vector<std::string>{})});
    }
  } catch (const json::exception& e) {
    return InvalidArgument("{}: {}", what, e.what());
  }
  return r;
}

size_t GateRecord::ResumeIndex() const {
  size_t i = 0;
  while (i < steps.size() && StepPassed(steps[i])) ++i;
  return i;
}

}  // namespace dl::lab
