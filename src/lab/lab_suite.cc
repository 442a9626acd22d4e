#include "lab/lab_suite.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/file_util.h"
#include "base/sha256.h"

namespace dl::lab {

namespace fs = std::filesystem;
using nlohmann::json;

const std::vector<std::string>& AllCheckNames() {
  static const std::vector<std::string> names = {"identity", "no_fallback", "scale_audit",
                                                 "topology", "exactness",   "no_prefix_cache",
                                                 "boundary", "rollover"};
  return names;
}

bool Suite::HasCheck(const std::string& n) const {
  return std::find(checks.begin(), checks.end(), n) != checks.end();
}

std::vector<int> Suite::Ms() const {
  std::vector<int> ms = {screen_tokens};
  if (suite_tokens != screen_tokens) ms.push_back(suite_tokens);
  std::sort(ms.begin(), ms.end());
  return ms;
}

Result<std::string> ReadTextFile(const std::string& path) {
  return ReadRegularFile(path, kMaxJsonSidecarBytes);
}

Result<JsonFile> ReadJsonFile(const std::string& path) {
  JsonFile f;
  DL_ASSIGN_OR_RETURN(f.text, ReadTextFile(path));
  try {
    f.value = json::parse(f.text);
  } catch (const json::exception& e) {
    return InvalidArgument("{}: not JSON: {}", path, e.what());
  }
  return f;
}

Status WriteTextFile(const std::string& path, const std::string& text) {
  std::error_code ec;
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Internal("{}: cannot write", tmp);
    out << text;
    if (!out.flush()) return Internal("{}: write failed", tmp);
  }
  fs::rename(tmp, path, ec);
  if (ec) return Internal("{}: cannot rename into place: {}", path, ec.message());
  return Status::Ok();
}

Result<int64_t> JsonInt(const json& v, int64_t lo, int64_t hi, const std::string& what) {
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) {
      return InvalidArgument("{}: {} is outside [{}, {}]", what, u, lo, hi);
    }
    x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    return InvalidArgument("{}: expected an integer, got {}", what, v.dump());
  }
  if (x < lo || x > hi) return InvalidArgument("{}: {} is outside [{}, {}]", what, x, lo, hi);
  return x;
}

Result<int64_t> JsonIntField(const json& j, const char* key, int64_t def, int64_t lo, int64_t hi,
                             const std::string& what) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  return JsonInt(*it, lo, hi, what + ": \"" + key + "\"");
}

Result<std::vector<int32_t>> JsonTokenIds(const json& v, const std::string& what) {
  if (!v.is_array()) return InvalidArgument("{}: expected an array of token ids", what);
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    DL_ASSIGN_OR_RETURN(int64_t id,
                        JsonInt(v[i], 0, INT32_MAX, fmt::format("{}[{}]: token id", what, i)));
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

Status CheckVersion(const json& j, const std::string& what) {
  if (!j.is_object() || !j.contains("version")) return Status::Ok();
  DL_ASSIGN_OR_RETURN(int64_t v, JsonInt(j["version"], 0, INT32_MAX, what + ": \"version\""));
  if (v != 1) {
    return InvalidArgument("{}: version {} is not supported (this lab reads version 1)", what, v);
  }
  return Status::Ok();
}

namespace {

std::string Resolve(const std::string& p, const std::string& suite_path) {
  if (p.empty() || fs::path(p).is_absolute()) return p;
  return (fs::path(suite_path).parent_path() / p).lexically_normal().string();
}

}  // namespace

Result<Suite> ParseSuite(const json& j, const std::string& path, const std::string& sha256) {
  Suite s;
  s.path = path;
  s.sha256 = sha256;
  try {
    if (!j.is_object()) return InvalidArgument("{}: a suite is a JSON object", path);
    if (j.value("format", "") != "decodelab-lab-suite") {
      return InvalidArgument("{}: \"format\" must be \"decodelab-lab-suite\"", path);
    }
    DL_RETURN_IF_ERROR(CheckVersion(j, path));
    s.name = j.value("name", fs::path(path).stem().string());
    DL_ASSIGN_OR_RETURN(int64_t screen, JsonIntField(j, "screen_tokens", 128, 0, 1 << 24, path));
    DL_ASSIGN_OR_RETURN(int64_t suite, JsonIntField(j, "suite_tokens", 512, 0, 1 << 24, path));
    s.screen_tokens = static_cast<int>(screen);
    s.suite_tokens = static_cast<int>(suite);
    if (s.screen_tokens < 2 || s.suite_tokens < 2) {
      return InvalidArgument("{}: screen_tokens and suite_tokens must be at least 2", path);
    }
    s.kv_dtype = j.value("kv_dtype", "fp8");
    if (s.kv_dtype != "f32" && s.kv_dtype != "bf16" && s.kv_dtype != "fp8") {
      return InvalidArgument("{}: kv_dtype \"{}\" is not f32, bf16 or fp8", path, s.kv_dtype);
    }
    s.calibration = Resolve(j.value("calibration", ""), path);
    s.teacher = Resolve(j.value("teacher", ""), path);
    if (j.contains("checks")) {
      for (const auto& c : j.at("checks")) {
        const std::string n = c.get<std::string>();
        const auto& all = AllCheckNames();
        if (std::find(all.begin(), all.end(), n) == all.end()) {
          return InvalidArgument("{}: unknown check \"{}\"", path, n);
        }
        s.checks.push_back(n);
      }
    } else {
      s.checks = AllCheckNames();
    }
    if (j.contains("expected_topology")) {
      for (const auto& [cfg, sigs] : j.at("expected_topology").items()) {
        s.expected_topology[cfg] = sigs.get<std::vector<std::string>>();
      }
    }
    if (!j.contains("prompts") || !j.at("prompts").is_array() || j.at("prompts").empty()) {
      return InvalidArgument("{}: \"prompts\" must be a non-empty array", path);
    }
    int idx = 0;
    for (const auto& pj : j.at("prompts")) {
      SuitePrompt p;
      p.name = pj.value("name", fmt::format("p{:02d}", idx));
      p.kind = pj.value("kind", "regular");
      if (p.kind != "regular" && p.kind != "boundary" && p.kind != "rollover") {
        return InvalidArgument("{}: prompt {}: kind \"{}\" is not regular, boundary or rollover",
                               path, p.name, p.kind);
      }
      p.computed = pj.value("computed", false);
      if (pj.contains("token_ids")) {
        DL_ASSIGN_OR_RETURN(p.token_ids,
                            JsonTokenIds(pj.at("token_ids"),
                                         fmt::format("{}: prompt {}: token_ids", path, p.name)));
      }
      if (pj.contains("text")) p.text = pj.at("text").get<std::string>();
      if (!p.computed && p.token_ids.empty() && p.text.empty()) {
        return InvalidArgument("{}: prompt {} has neither token_ids nor text", path, p.name);
      }
      for (const auto& other : s.prompts) {
        if (other.name == p.name)
          return InvalidArgument("{}: prompt name {} repeats", path, p.name);
      }
      s.prompts.push_back(std::move(p));
      ++idx;
    }
  } catch (const json::exception& e) {
    return InvalidArgument("{}: {}", path, e.what());
  }
  return s;
}

Result<Suite> ReadSuiteFile(const std::string& path) {
  DL_ASSIGN_OR_RETURN(JsonFile f, ReadJsonFile(path));
  return ParseSuite(f.value, fs::absolute(path).string(), Sha256Hex(f.text));
}

std::vector<int32_t> SyntheticPromptIds(int len, int salt, int vocab_limit) {
  std::vector<int32_t> ids;
  const int range = std::max(2, vocab_limit - 1);
  uint32_t x = 2166136261u ^ static_cast<uint32_t>(salt * 7919 + 17);
  for (int i = 0; i < len; ++i) {
    x = x * 1664525u + 1013904223u;
    ids.push_back(static_cast<int32_t>(1 + (x >> 8) % static_cast<uint32_t>(range)));
  }
  return ids;
}

std::string DefaultSuiteJson() {
  const int lengths[13] = {8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 200};
  std::string s =
      "{\n"
      " \"format\": \"decodelab-lab-suite\",\n"
      " \"version\": 1,\n"
      " \"name\": \"default\",\n"
      " \"screen_tokens\": 128,\n"
      " \"suite_tokens\": 512,\n"
      " \"kv_dtype\": \"fp8\",\n"
      " \"checks\": [\"identity\", \"no_fallback\", \"scale_audit\", \"topology\", "
      "\"exactness\", \"no_prefix_cache\", \"boundary\", \"rollover\"],\n"
      " \"calibration\": \"\",\n"
      " \"teacher\": \"\",\n"
      " \"expected_topology\": {},\n"
      " \"prompts\": [\n";
  for (int i = 0; i < 13; ++i) {
    s += fmt::format("  {{\"name\": \"p{:02d}\", \"token_ids\": {}}},\n", i + 1,
                     json(SyntheticPromptIds(lengths[i], i + 1, 500)).dump());
  }
  s += "  {\"name\": \"boundary\", \"kind\": \"boundary\", \"computed\": true},\n";
  s += "  {\"name\": \"rollover\", \"kind\": \"rollover\", \"computed\": true}\n";
  s += " ]\n}\n";
  return s;
}

int BoundaryPromptLength(int page_size) {
  return 2 * std::max(1, page_size);
}

int RolloverPromptLength(int page_size, int sliding_window) {
  const int ps = std::max(1, page_size);
  const int target = std::max(sliding_window, 1);
  const int pages = (target + ps - 1) / ps;
  return std::max(1, pages * ps - 1);
}

const TeacherPrompt* Teacher::Find(const std::string& n) const {
  for (const auto& p : prompts) {
    if (p.name == n) return &p;
  }
  return nullptr;
}

json Teacher::ToJson() const {
  json ps = json::array();
  for (const auto& p : prompts) {
    json next = json::object();
    for (const auto& [m, t] : p.next) next[std::to_string(m)] = t;
    ps.push_back({{"name", p.name}, {"prompt", p.prompt}, {"tokens", p.tokens}, {"next", next}});
  }
  return {{"format", "decodelab-teacher"},
          {"version", 1},
          {"suite_sha256", suite_sha256},
          {"control_identity", control_identity},
          {"backend", backend},
          {"kv_dtype", kv_dtype},
          {"topology", topology},
          {"topology_applicable", topology_applicable},
          {"prompts", ps}};
}

Result<Teacher> ParseTeacher(const json& j, const std::string& what) {
  Teacher t;
  try {
    if (j.value("format", "") != "decodelab-teacher") {
      return InvalidArgument("{}: \"format\" must be \"decodelab-teacher\"", what);
    }
    DL_RETURN_IF_ERROR(CheckVersion(j, what));
    t.suite_sha256 = j.value("suite_sha256", "");
    t.control_identity = j.value("control_identity", "");
    t.backend = j.value("backend", "");
    t.kv_dtype = j.value("kv_dtype", "");
    t.topology = j.value("topology", std::vector<std::string>{});
    t.topology_applicable = j.value("topology_applicable", false);
    for (const auto& pj : j.at("prompts")) {
      TeacherPrompt p;
      p.name = pj.at("name").get<std::string>();
      const std::string where = fmt::format("{}: prompt {}", what, p.name);
      DL_ASSIGN_OR_RETURN(p.prompt, JsonTokenIds(pj.at("prompt"), where + ": prompt"));
      DL_ASSIGN_OR_RETURN(p.tokens, JsonTokenIds(pj.at("tokens"), where + ": tokens"));
      for (const auto& [m, tok] : pj.at("next").items()) {
        const bool digits = !m.empty() && m.size() <= 8 &&
                            std::all_of(m.begin(), m.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (!digits) return InvalidArgument("{}: next: key \"{}\" is not a token count", where, m);
        DL_ASSIGN_OR_RETURN(int64_t id, JsonInt(tok, 0, INT32_MAX, where + ": next[" + m + "]"));
        p.next[std::stoi(m)] = static_cast<int32_t>(id);
      }
      t.prompts.push_back(std::move(p));
    }
  } catch (const std::exception& e) {
    return InvalidArgument("{}: {}", what, e.what());
  }
  return t;
}

Result<Teacher> ReadTeacherFile(const std::string& path) {
  DL_ASSIGN_OR_RETURN(JsonFile f, ReadJsonFile(path));
  return ParseTeacher(f.value, path);
}

Status WriteTeacherFile(const std::string& path, const Teacher& t) {
  return WriteTextFile(path, t.ToJson().dump(1) + "\n");
}

}  // namespace dl::lab
