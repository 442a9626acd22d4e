// Reproducer files (lab.md §6): a recorded sequence of precursor requests and a target request
// whose tokens must equal the expected (teacher) tokens on a fresh server. They exist for
// state-leak bugs: a KV page reused with stale contents, a stale scale, a graph replayed with the
// wrong length.
//
//   {"format": "decodelab-lab-repro", "name": "...", "description": "...",
//    "kv_dtype": "fp8", "calibration": "",          // as in a suite ("" = the lab's calibration)
//    "precursors": [{"token_ids": [...], "max_tokens": 40}, ...],
//    "target": {"token_ids": [...], "max_tokens": 16, "expected": [...]}}
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl::lab {

struct ReproRequest {
  std::vector<int32_t> token_ids;
  int max_tokens = 1;
};

struct Repro {
  std::string path, name, description;
  std::string kv_dtype = "fp8";
  std::string calibration;
  std::vector<ReproRequest> precursors;
  ReproRequest target;
  std::vector<int32_t> expected;
};
Result<Repro> ParseRepro(const nlohmann::json& j, const std::string& path);
Result<Repro> ReadReproFile(const std::string& path);

}  // namespace dl::lab
