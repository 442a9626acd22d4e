// The checks of lab.md §2 as pure functions over parsed responses, /v1/decodelab/state JSON, the
// teacher and the calibration file, so every failure mode is unit-testable without a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv_cache/kv_scales.h"
#include "lab/lab_suite.h"

namespace dl::lab {

enum class CheckStatus { kPass, kFail, kInvalid, kNotApplicable, kSimulated };
const char* CheckStatusName(CheckStatus s);  // "PASS", "FAIL", "INVALID", "NOT_APPLICABLE", ...

struct CheckRow {
  std::string name;
  CheckStatus status = CheckStatus::kFail;
  std::string detail;
  nlohmann::json ToJson() const;
};

// One prompt's outcome as the lab client recorded it.
struct PromptResult {
  std::string name;
  std::string kind = "regular";
  std::vector<int32_t> prompt;
  int max_tokens = 0;
  std::vector<int32_t> tokens;  // generated ids, in stream order
  std::string finish_reason;
  int64_t cached_tokens = -1;   // usage.prompt_tokens_details.cached_tokens; -1 = not reported
  std::optional<int32_t> next;  // the "next" request's token (prompt + M tokens, max_tokens 1)
};

// 1. Exactness: every prompt's tokens equal the teacher's first M; detail "k/N".
CheckRow CheckExactness(const std::vector<PromptResult>& results, const Teacher& teacher,
                        int* exact_out = nullptr);
// 2. No prefix-cache hits: every response reports cached_tokens == 0.
CheckRow CheckNoPrefixCache(const std::vector<PromptResult>& results);
// 3. Full-length boundary: every prompt (the boundary prompt among them) returned exactly M tokens
// with finish_reason "length", and its "next" token equals the teacher's token M+1.
CheckRow CheckBoundary(const std::vector<PromptResult>& results, const Teacher& teacher);
// 4. Rollover row: the rollover prompt's tokens equal the teacher's.
CheckRow CheckRollover(const std::vector<PromptResult>& results, const Teacher& teacher);
// 5. Scale audit: every rank's kv_scales equal the calibration file's bit for bit.
CheckRow CheckScaleAudit(const nlohmann::json& state, const KvScales& calibration);
// 6. Topology audit: every rank's signature equals the expected one. NOT_APPLICABLE when the
// backend captures no graph (topology_applicable false, e.g. CPU).
CheckRow CheckTopology(const nlohmann::json& state, const std::vector<std::string>& expected);
// 7. No fallback: state.fallback false and fallback_ops empty; otherwise INVALID.
CheckRow CheckNoFallback(const nlohmann::json& state);
// Kernel presets: NOT_APPLICABLE on the CPU backend; PASS with the list otherwise.
CheckRow CheckKernelPresets(const nlohmann::json& state);

// 8. Identity lock file: {"format": "decodelab-lab-lock", "binary_sha256": ..., "commit": ...}.
struct IdentityLock {
  std::string binary_sha256;
  std::string commit;
  nlohmann::json ToJson() const;
};
Result<IdentityLock> ReadLockFile(const std::string& path);
// Compares the server's binary_sha256 (and the binary file's hash the lab computed) with the lock.
// No lock: PASS, saying no lock was given. Mismatch: INVALID, or PASS noting the acceptance when
// `accept_identity` (the manifest records it).
CheckRow CheckIdentity(const nlohmann::json& state, const std::string& binary_sha256,
                       const std::optional<IdentityLock>& lock, bool accept_identity);

// A run's verdict over its rows: "INVALID" when any row is INVALID, else "FAIL" when any FAIL,
// else "PASS".
std::string Verdict(const std::vector<CheckRow>& rows);

}  // namespace dl::lab
