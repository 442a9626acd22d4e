// Response and tool-call ids ("chatcmpl-…", "cmpl-…", "chatcmpl-tool-…").
#pragma once

#include <string>
#include <string_view>

namespace dl::api {

// "<prefix>-" followed by a per-process random salt (16 hex digits) and a counter (8 hex digits):
// unique within the process and unlikely to repeat across restarts.
std::string UniqueId(std::string_view prefix);

}  // namespace dl::api
