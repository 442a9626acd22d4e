// Whole-file reads for loaders: model files are input too, so a path may name a device, a FIFO or
// a huge file. Only regular files of bounded size are read; anything else is a clear error, never a
// hang (a FIFO is opened without blocking) or unbounded memory (/dev/zero).
#pragma once

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl {

// Limits the loaders use; each names what it bounds.
inline constexpr size_t kMaxConfigFileBytes = 16u << 20;      // config.json, chat templates
inline constexpr size_t kMaxJsonSidecarBytes = 64u << 20;     // tokenizer_config.json, index, scales
inline constexpr size_t kMaxTokenizerFileBytes = 512u << 20;  // tokenizer.json

// The contents of `path`: NotFound when it does not exist, InvalidArgument when it is not a regular
// file or is larger than `max_bytes` (the message names the path and the limit).
Result<std::string> ReadRegularFile(const std::string& path, size_t max_bytes);
// ReadRegularFile, parsed as JSON: InvalidArgument "<path>: not valid JSON: <why>" when it is not.
Result<nlohmann::json> ReadJsonFile(const std::string& path, size_t max_bytes);

}  // namespace dl
