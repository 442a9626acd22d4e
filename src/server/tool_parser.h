// Laguna's tool-call format parsed into OpenAI tool calls, as vLLM's `poolside_v1` tool parser does:
//
//   <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>
//
// (Laguna's chat template writes calls this way: string values raw, other values as JSON; some
// template versions put a newline after NAME.) NAME ends at the first newline, `<arg_key>` or
// `</tool_call>` and is trimmed; keys and values are trimmed. A value whose parameter the request's
// tool schema types as "string" stays text; any other value is read as JSON, or Python's
// True/False/None, and stays text when it is neither. `arguments` is the JSON object of the pairs in
// their order. A block with an empty name is dropped, as vLLM does.
//
// Text outside complete blocks is content. A `<tool_call>` never closed (the output ran out) is
// returned as content, raw. Text that could be the start of `<tool_call>` is held back until known,
// so streamed pieces give exactly what one whole-text parse gives; a call is reported once, whole,
// when its `</tool_call>` arrives.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dl::api {

inline constexpr std::string_view kToolCallStart = "<tool_call>";
inline constexpr std::string_view kToolCallEnd = "</tool_call>";
inline constexpr std::string_view kArgKeyStart = "<arg_key>";
inline constexpr std::string_view kArgKeyEnd = "</arg_key>";
inline constexpr std::string_view kArgValueStart = "<arg_value>";
inline constexpr std::string_view kArgValueEnd = "</arg_value>";

struct ToolCall {
  std::string id;         // "chatcmpl-tool-<hex>", unique per call
  std::string name;
  std::string arguments;  // JSON object text
};

struct ToolParse {
  std::string content;
  std::vector<ToolCall> calls;
};

class ToolCallParser {
 public:
  // `tools`: the request's tools array (OpenAI shape), used for the parameter types.
  explicit ToolCallParser(nlohmann::json tools = nlohmann::json::array()) : tools_(std::move(tools)) {}
  ToolParse Add(std::string_view text);
  // End of output: the held-back text as content (an unclosed block raw). Never calls: a call is
  // complete only at its `</tool_call>`, which Add reports.
  ToolParse Finish();
  // Whole text at once: Add + Finish.
  static ToolParse Parse(std::string_view text, const nlohmann::json& tools);

 private:
  // The call in one block's body (between the markers); false when the name is empty.
  bool ParseBlock(std::string_view body, ToolCall* call) const;
  bool IsStringParam(const std::string& tool, const std::string& key) const;

  nlohmann::json tools_;
  std::string buf_;
  bool in_call_ = false;
};

}  // namespace dl::api
