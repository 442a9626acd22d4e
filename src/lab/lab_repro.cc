#include "lab/lab_repro.h"

#include <filesystem>

#include "lab/lab_suite.h"

namespace dl::lab {

using nlohmann::json;

namespace {

Result<ReproRequest> ParseRequest(const json& j, const std::string& what) {
  ReproRequest r;
  DL_ASSIGN_OR_RETURN(r.token_ids, JsonTokenIds(j.at("token_ids"), what + ": token_ids"));
  DL_ASSIGN_OR_RETURN(int64_t max_tokens, JsonIntField(j, "max_tokens", 1, 0, 1 << 24, what));
  r.max_tokens = static_cast<int>(max_tokens);
  if (r.token_ids.empty()) return InvalidArgument("{}: token_ids is empty", what);
  if (r.max_tokens < 1) return InvalidArgument("{}: max_tokens must be at least 1", what);
  return r;
}

}  // namespace

Result<Repro> ParseRepro(const json& j, const std::string& path) {
  Repro r;
  r.path = path;
  try {
    if (j.value("format", "") != "decodelab-lab-repro") {
      return InvalidArgument("{}: \"format\" must be \"decodelab-lab-repro\"", path);
    }
    DL_RETURN_IF_ERROR(CheckVersion(j, path));
    r.name = j.value("name", std::filesystem::path(path).stem().string());
    r.description = j.value("description", "");
    r.kv_dtype = j.value("kv_dtype", "fp8");
    r.calibration = j.value("calibration", "");
    if (!r.calibration.empty() && !std::filesystem::path(r.calibration).is_absolute()) {
      r.calibration =
          (std::filesystem::path(path).parent_path() / r.calibration).lexically_normal().string();
    }
    if (j.contains("precursors")) {
      int i = 0;
      for (const auto& p : j.at("precursors")) {
        DL_ASSIGN_OR_RETURN(ReproRequest q,
                            ParseRequest(p, fmt::format("{}: precursors[{}]", path, i++)));
        r.precursors.push_back(std::move(q));
      }
    }
    DL_ASSIGN_OR_RETURN(r.target, ParseRequest(j.at("target"), path + ": target"));
    DL_ASSIGN_OR_RETURN(r.expected,
                        JsonTokenIds(j.at("target").at("expected"), path + ": target.expected"));
    if (static_cast<int>(r.expected.size()) != r.target.max_tokens) {
      return InvalidArgument("{}: target.expected has {} tokens, max_tokens is {}", path,
                             r.expected.size(), r.target.max_tokens);
    }
  } catch (const json::exception& e) {
    return InvalidArgument("{}: {}", path, e.what());
  }
  return r;
}

Result<Repro> ReadReproFile(const std::string& path) {
  DL_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  try {
    return ParseRepro(json::parse(text), std::filesystem::absolute(path).string());
  } catch (const json::exception& e) {
    return InvalidArgument("{}: not JSON: {}", path, e.what());
  }
}

}  // namespace dl::lab
