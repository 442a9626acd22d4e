// generation_config.json, read as transformers and vLLM read it: its eos_token_id (Laguna's lists
// [2, 24]: without 24, `</assistant>`, a model keeps going into an invented next turn) and the
// sampling defaults a request that leaves a field out gets (vLLM's --generation-config auto).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl {

struct GenerationConfig {
  bool present = false;  // the file existed
  std::vector<int64_t> eos_token_ids;
  std::optional<double> temperature, top_p, min_p, repetition_penalty;
  std::optional<int64_t> top_k, max_new_tokens;
  // Keys that would change generation and are not used here (beam search, n-gram bans, ...).
  std::vector<std::string> warnings;

  static Result<GenerationConfig> FromJson(const nlohmann::json& j);
  // NotFound when the file does not exist.
  static Result<GenerationConfig> FromFile(const std::string& path);
};

}  // namespace dl
