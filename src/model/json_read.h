// Values read out of the JSON a model directory holds (config.json, a DFlash drafter's config.json):
// one rule for integers and one way to quote a bad value, so every loader refuses alike.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl {

// Every size, count and id is used as a 32-bit int downstream (kernels, the KV cache, the lab).
inline constexpr int64_t kJsonInt32Max = 2147483647;

// A value as it appeared, cut to 60 characters, for error messages.
std::string ShowJson(const nlohmann::json& v);

// *out = v when it is an integer (or a float with an integral value below 9e15) in [lo, hi];
// otherwise an error naming `key` (a value outside the range is refused, never wrapped:
// sliding_window 2^32 + 8 used to become 8).
Status JsonInt(const nlohmann::json& v, const std::string& key, int64_t lo, int64_t hi, int64_t* out);

}  // namespace dl
