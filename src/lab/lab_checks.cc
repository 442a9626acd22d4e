#include "lab/lab_checks.h"

#include <cstring>

#include "base/dtype.h"
#include "lab/lab_suite.h"

namespace dl::lab {

using nlohmann::json;

const char* CheckStatusName(CheckStatus s) {
  switch (s) {
    case CheckStatus::kPass:
      return "PASS";
    case CheckStatus::kFail:
      return "FAIL";
    case CheckStatus::kInvalid:
      return "INVALID";
    case CheckStatus::kNotApplicable:
      return "NOT_APPLICABLE";
    case CheckStatus::kSimulated:
      return "SIMULATED";
  }
  return "?";
}

json CheckRow::ToJson() const {
  return {{"name", name}, {"status", CheckStatusName(status)}, {"detail", detail}};
}

namespace {

CheckRow Row(std::string name, CheckStatus s, std::string detail) {
  return {std::move(name), s, std::move(detail)};
}

// First index where a and b differ within the first n, or -1.
int FirstDiff(const std::vector<int32_t>& a, const std::vector<int32_t>& b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (i >= a.size() || i >= b.size() || a[i] != b[i]) return static_cast<int>(i);
  }
  return -1;
}

// Compares one result with the teacher's first max_tokens tokens; empty string when equal.
std::string Mismatch(const PromptResult& r, const Teacher& teacher) {
  const TeacherPrompt* t = teacher.Find(r.name);
  if (!t) return fmt::format("{}: not in the teacher transcript", r.name);
  if (t->prompt != r.prompt) return fmt::format("{}: prompt differs from the teacher's", r.name);
  const size_t m = static_cast<size_t>(r.max_tokens);
  if (t->tokens.size() < m) {
    return fmt::format("{}: teacher has {} tokens, run asked for {}", r.name, t->tokens.size(), m);
  }
  if (r.tokens.size() != m) {
    return fmt::format("{}: returned {} tokens, expected {}", r.name, r.tokens.size(), m);
  }
  const int d = FirstDiff(r.tokens, t->tokens, m);
  if (d >= 0) {
    return fmt::format("{}: token {} is {}, teacher has {}", r.name, d, r.tokens[d], t->tokens[d]);
  }
  return "";
}

}  // namespace

CheckRow CheckExactness(const std::vector<PromptResult>& results, const Teacher& teacher,
                        int* exact_out) {
  int exact = 0;
  std::string first;
  for (const auto& r : results) {
    std::string m = Mismatch(r, teacher);
    if (m.empty()) {
      ++exact;
    } else if (first.empty()) {
      first = m;
    }
  }
  if (exact_out) *exact_out = exact;
  const int n = static_cast<int>(results.size());
  std::string detail = fmt::format("{}/{} exact", exact, n);
  if (!first.empty()) detail += "; first mismatch: " + first;
  return Row("exactness", exact == n && n > 0 ? CheckStatus::kPass : CheckStatus::kFail, detail);
}

CheckRow CheckNoPrefixCache(const std::vector<PromptResult>& results) {
  for (const auto& r : results) {
    if (r.cached_tokens != 0) {
      return Row("no_prefix_cache", CheckStatus::kFail,
                 r.cached_tokens < 0
                     ? fmt::format("{}: usage.prompt_tokens_details.cached_tokens missing", r.name)
                     : fmt::format("{}: cached_tokens = {} (a prefix-cache hit)", r.name,
                                   r.cached_tokens));
    }
  }
  return Row("no_prefix_cache", CheckStatus::kPass,
             fmt::format("cached_tokens = 0 on all {} responses", results.size()));
}

CheckRow CheckBoundary(const std::vector<PromptResult>& results, const Teacher& teacher) {
  // Every prompt gets its "next" request (it costs one prefill); the boundary prompt is the one
  // whose pages end exactly at the prompt.
  int checked = 0;
  for (const auto& r : results) {
    ++checked;
    if (static_cast<int>(r.tokens.size()) != r.max_tokens || r.finish_reason != "length") {
      return Row("boundary", CheckStatus::kFail,
                 fmt::format("{}: {} tokens with finish_reason \"{}\", expected {} with \"length\"",
                             r.name, r.tokens.size(), r.finish_reason, r.max_tokens));
    }
    const TeacherPrompt* t = teacher.Find(r.name);
    if (!t) return Row("boundary", CheckStatus::kFail, r.name + ": not in the teacher transcript");
    auto it = t->next.find(r.max_tokens);
    if (it == t->next.end()) {
      return Row("boundary", CheckStatus::kFail,
                 fmt::format("{}: teacher has no next token for M={}", r.name, r.max_tokens));
    }
    if (!r.next) {
      return Row("boundary", CheckStatus::kFail, r.name + ": the next request returned no token");
    }
    if (*r.next != it->second) {
      return Row("boundary", CheckStatus::kFail,
                 fmt::format("{}: token M+1={} is {}, teacher has {}", r.name, r.max_tokens + 1,
                             *r.next, it->second));
    }
  }
  if (checked == 0) return Row("boundary", CheckStatus::kFail, "no prompt to check");
  return Row("boundary", CheckStatus::kPass,
             fmt::format("{} prompt(s): M tokens, finish length, token M+1 matches", checked));
}

CheckRow CheckRollover(const std::vector<PromptResult>& results, const Teacher& teacher) {
  for (const auto& r : results) {
    if (r.kind != "rollover") continue;
    std::string m = Mismatch(r, teacher);
    if (!m.empty()) return Row("rollover", CheckStatus::kFail, m);
    return Row("rollover", CheckStatus::kPass,
               fmt::format("{}: prompt {} tokens, {} generated tokens equal the teacher", r.name,
                           r.prompt.size(), r.tokens.size()));
  }
  return Row("rollover", CheckStatus::kFail, "the suite has no rollover prompt");
}

CheckRow CheckScaleAudit(const json& state, const KvScales& cal) {
  try {
    const std::string dtype = state.value("kv_dtype", json(nullptr)).is_string()
                                  ? state["kv_dtype"].get<std::string>()
                                  : "";
    const auto parsed = DTypeFromName(dtype);
    if (parsed && *parsed != DType::kF8E4M3) {
      return Row("scale_audit", CheckStatus::kNotApplicable,
                 fmt::format("KV dtype {} stores no scales", dtype));
    }
    if (!state.contains("kv_scales") || !state["kv_scales"].is_array() ||
        state["kv_scales"].empty()) {
      return Row("scale_audit", CheckStatus::kFail, "/v1/decodelab/state reports no kv_scales");
    }
    for (const auto& rank : state["kv_scales"]) {
      const int r = rank.value("rank", -1);
      const auto& layers = rank.at("layers");
      if (layers.size() != cal.k.size()) {
        return Row("scale_audit", CheckStatus::kFail,
                   fmt::format("rank {}: {} layers reported, calibration file has {}", r,
                               layers.size(), cal.k.size()));
      }
      for (const auto& l : layers) {
        const int li = l.at("layer").get<int>();
        if (li < 0 || li >= static_cast<int>(cal.k.size())) {
          return Row("scale_audit", CheckStatus::kFail,
                     fmt::format("rank {}: layer {} out of range", r, li));
        }
        const std::string kb = l.at("k_scale_bits").get<std::string>();
        const std::string vb = l.at("v_scale_bits").get<std::string>();
        if (kb != FloatBitsHex(cal.k[li]) || vb != FloatBitsHex(cal.v[li])) {
          return Row("scale_audit", CheckStatus::kFail,
                     fmt::format("rank {} layer {}: server k/v scale bits {}/{}, calibration file "
                                 "{}/{}",
                                 r, li, kb, vb, FloatBitsHex(cal.k[li]), FloatBitsHex(cal.v[li])));
        }
      }
    }
    return Row("scale_audit", CheckStatus::kPass,
               fmt::format("{} rank(s) x {} layers equal the calibration file bit for bit",
                           state["kv_scales"].size(), cal.k.size()));
  } catch (const json::exception& e) {
    return Row("scale_audit", CheckStatus::kFail, fmt::format("malformed kv_scales: {}", e.what()));
  }
}

CheckRow CheckTopology(const json& state, const std::vector<std::string>& expected) {
  try {
    if (!state.value("topology_applicable", false) || !state.contains("topology") ||
        !state["topology"].is_array()) {
      return Row(
          "topology", CheckStatus::kNotApplicable,
          fmt::format("backend {} captures no graph", state.value("backend", std::string("?"))));
    }
    const auto& topo = state["topology"];
    if (expected.empty()) {
      return Row("topology", CheckStatus::kFail, "no expected signature (teacher or suite)");
    }
    if (topo.size() != expected.size()) {
      return Row("topology", CheckStatus::kFail,
                 fmt::format("{} rank(s) reported, {} expected", topo.size(), expected.size()));
    }
    std::string sigs;
    for (const auto& t : topo) {
      const int r = t.at("rank").get<int>();
      const std::string sig = t.at("signature").get<std::string>();
      if (r < 0 || r >= static_cast<int>(expected.size())) {
        return Row("topology", CheckStatus::kFail, fmt::format("rank {} out of range", r));
      }
      if (sig != expected[r]) {
        return Row("topology", CheckStatus::kFail,
                   fmt::format("rank {}: signature {}, expected {}", r, sig, expected[r]));
      }
      sigs += (sigs.empty() ? "" : " ") + sig;
    }
    return Row("topology", CheckStatus::kPass, "every rank matches: " + sigs);
  } catch (const json::exception& e) {
    return Row("topology", CheckStatus::kFail, fmt::format("malformed topology: {}", e.what()));
  }
}

CheckRow CheckNoFallback(const json& state) {
  const bool fb = state.value("fallback", false);
  std::string ops;
  if (state.contains("fallback_ops") && state["fallback_ops"].is_array()) {
    for (const auto& o : state["fallback_ops"]) ops += (ops.empty() ? "" : ", ") + o.dump();
  }
  if (fb || !ops.empty()) {
    return Row("no_fallback", CheckStatus::kInvalid,
               "the server fell back to a generic path" + (ops.empty() ? "" : ": " + ops));
  }
  return Row("no_fallback", CheckStatus::kPass, "no fallback reported");
}

CheckRow CheckKernelPresets(const json& state) {
  const std::string backend = state.value("backend", std::string("?"));
  if (backend.rfind("cpu", 0) == 0) {
    return Row("kernel_presets", CheckStatus::kNotApplicable, "CPU backend has no kernel presets");
  }
  return Row("kernel_presets", CheckStatus::kPass,
             "presets: " + state.value("kernel_presets", json(nullptr)).dump());
}

json IdentityLock::ToJson() const {
  return {{"format", "decodelab-lab-lock"},
          {"version", 1},
          {"binary_sha256", binary_sha256},
          {"commit", commit}};
}

Result<IdentityLock> ReadLockFile(const std::string& path) {
  DL_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  try {
    json j = json::parse(text);
    if (j.value("format", "") != "decodelab-lab-lock") {
      return InvalidArgument("{}: \"format\" must be \"decodelab-lab-lock\"", path);
    }
    IdentityLock l;
    l.binary_sha256 = j.at("binary_sha256").get<std::string>();
    l.commit = j.value("commit", "");
    return l;
  } catch (const json::exception& e) {
    return InvalidArgument("{}: {}", path, e.what());
  }
}

CheckRow CheckIdentity(const json& state, const std::string& binary_sha256,
                       const std::optional<IdentityLock>& lock, bool accept_identity) {
  const std::string served = state.value("binary_sha256", std::string());
  if (!binary_sha256.empty() && !served.empty() && served != binary_sha256) {
    return Row(
        "identity", CheckStatus::kInvalid,
        fmt::format("the server runs binary {} but the lab hashed {}", served, binary_sha256));
  }
  const std::string actual = served.empty() ? binary_sha256 : served;
  if (!lock) return Row("identity", CheckStatus::kPass, "binary " + actual + " (no lock file)");
  if (lock->binary_sha256 == actual) {
    return Row("identity", CheckStatus::kPass, "binary " + actual + " matches the lock");
  }
  const std::string what =
      fmt::format("binary {} differs from the lock's {}", actual, lock->binary_sha256);
  if (accept_identity) {
    return Row("identity", CheckStatus::kPass, what + " (accepted with --accept-identity)");
  }
  return Row("identity", CheckStatus::kInvalid, what);
}

std::string Verdict(const std::vector<CheckRow>& rows) {
  bool fail = false;
  for (const auto& r : rows) {
    if (r.status == CheckStatus::kInvalid) return "INVALID";
    fail |= r.status == CheckStatus::kFail;
  }
  return fail ? "FAIL" : "PASS";
}

}  // namespace dl::lab
