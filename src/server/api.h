// The OpenAI request/response layer of the server, without HTTP: request bodies parsed into native
// types (with the OpenAI error envelope for anything wrong), streamed text assembly with stop
// strings, and response JSON builders. Shapes follow shared/design/ecosystem.md §3.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/scheduler.h"
#include "server/reasoning_parser.h"
#include "server/tool_parser.h"
#include "template/chat_template.h"
#include "tokenizer/incremental_decoder.h"
#include "tokenizer/tokenizer.h"

namespace dl::api {

struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::optional<std::string> param;
  std::optional<std::string> code;
};
// {"error": {"message", "type", "param", "code"}}
nlohmann::json ErrorBody(const ApiError& e);
ApiError BadRequest(std::string message, std::optional<std::string> param = std::nullopt);
// Maps a scheduler/engine Status to an HTTP error (InvalidArgument 400, ResourceExhausted and
// Unavailable 503, anything else 500).
ApiError FromStatus(const Status& s, std::optional<std::string> param = std::nullopt);

struct ParsedRequest {
  bool chat = false;
  std::string model;                          // empty when the body names none
  std::vector<std::vector<int32_t>> prompts;  // one choice per prompt (chat: exactly one)
  SamplingParams sampling;
  std::vector<std::string> stop_strings;
  bool stream = false;
  bool include_usage = false;
  int32_t logprobs = -1;  // top-N alternatives per token; -1 = no logprobs
  // Chat: tool calls are parsed when the request has tools and tool_choice is "auto".
  nlohmann::ordered_json tools;  // the request's tools array, or null
  bool parse_tool_calls = false;
  bool parallel_tool_calls = true;  // false: only the first call is returned
  // Chat: reasoning (<think>) is split off when the tokenizer has the markers (reasoning_parser.h).
  bool parse_reasoning = false;
  ReasoningParser::Mode reasoning_start = ReasoningParser::Mode::kContentOnly;
  bool include_reasoning = true;  // vLLM's field: false drops reasoning_content
  // Fields this server does not know, accepted with a logged warning (vLLM's behaviour).
  std::vector<std::string> ignored_fields;
};

// Defaults for sampling fields a request leaves out: the model's generation_config.json (as vLLM's
// --generation-config auto), else OpenAI's.
struct SamplingDefaults {
  std::optional<double> temperature, top_p, min_p, repetition_penalty;
  std::optional<int64_t> top_k;
  std::optional<int64_t> max_tokens;  // generation_config.json's max_new_tokens
};

struct ParseContext {
  const Tokenizer* tokenizer = nullptr;        // null: only token-id prompts
  const ChatTemplate* chat_template = nullptr;  // null: chat refused with `no_template_reason`
  std::string no_template_reason;
  int32_t max_context = 0;
  int64_t vocab_size = 0;
  SamplingDefaults defaults;
};

// Parses and validates a /v1/completions (chat = false) or /v1/chat/completions body. Every field
// has a status (docs/api.md): implemented; accepted as a documented no-op (OpenAI fields with no
// local meaning: user, metadata, store, ...); refused with a 400 naming it when it would change the
// output and is not implemented; unknown fields are accepted and listed in `ignored_fields` for a
// logged warning, as vLLM does (OpenAI would answer 400).
std::optional<ApiError> ParseRequest(const std::string& body, bool chat, const ParseContext& ctx,
                                     ParsedRequest* out);

// A request body as a JSON object, or the 400 for one that is not valid JSON or not an object.
std::optional<ApiError> ParseBody(const std::string& text, nlohmann::ordered_json* body);

// vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (rendered with the chat template) to
// {"count", "max_model_len", "tokens", "token_strs"}. `body` comes from ParseBody (parsed once for
// the served-name check and the fields). `ignored` receives unknown fields.
std::optional<ApiError> Tokenize(const nlohmann::ordered_json& body, const ParseContext& ctx,
                                 nlohmann::json* response, std::vector<std::string>* ignored);
// vLLM's /detokenize: {"tokens": [ids]} to {"prompt": text} (special tokens included, as vLLM).
std::optional<ApiError> Detokenize(const nlohmann::ordered_json& body, const ParseContext& ctx,
                                   nlohmann::json* response, std::vector<std::string>* ignored);
// The "model" field of a body, when it is a string ("" otherwise), for the served-name check.
std::string RequestedModel(const nlohmann::ordered_json& body);

// The text of one chat choice split for the response: reasoning, content and tool calls, in the
// order the text arrives (ChoiceText's output goes in).
struct ChatDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
  // `later` after this one: its text appended, its calls after these.
  void Append(ChatDelta&& later);
};
class ChatOutput {
 public:
  explicit ChatOutput(const ParsedRequest& req);
  ChatDelta Add(std::string_view text);
  ChatDelta Finish();
  int tool_calls() const { return calls_; }

 private:
  void Take(ReasoningSplit split, ChatDelta* out);

  bool include_reasoning_;
  bool parallel_;
  int calls_ = 0;
  std::optional<ReasoningParser> reasoning_;
  std::optional<ToolCallParser> tools_;
};

// Text of one choice as tokens arrive: UTF-8-safe incremental detokenisation, stop strings (the
// text ends before the first match; text that could be the start of a stop string is held back
// until it is known not to be), and no text for the token that ended the sequence by a stop id.
class ChoiceText {
 public:
  // `keep` lists token ids whose text stays even when the tokenizer flags them special (the chat
  // markers the parsers read); every other special token is skipped, vLLM's default.
  ChoiceText(const Tokenizer* tokenizer, std::vector<std::string> stop_strings,
             std::vector<int32_t> keep = {});
  // Text that can be sent now for `token`. `suppress` drops the token's own text (eos / stop id).
  std::string Add(int32_t token, bool suppress);
  // End of the sequence: whatever is held back.
  std::string Finish();
  bool stopped() const { return stopped_; }
  const std::string& text() const { return text_; }

 private:
  std::string Release(bool final);

  const Tokenizer* tokenizer_;
  std::optional<IncrementalDecoder> decoder_;
  std::vector<int32_t> keep_;
  std::vector<std::string> stops_;
  std::string text_;
  size_t sent_ = 0;
  size_t searched_ = 0;
  bool stopped_ = false;
};

// The ids of the reasoning and tool-call markers this tokenizer has as single tokens.
std::vector<int32_t> ChatMarkerIds(const Tokenizer& tokenizer);

// One token's string for logprobs output.
std::string TokenString(const Tokenizer* tokenizer, int32_t id);

// usage object with prompt_tokens_details.cached_tokens.
nlohmann::json Usage(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// Completions logprobs object for a run of tokens ({tokens, token_logprobs, top_logprobs,
// text_offset}); `offset0` is the text offset of the first token.
nlohmann::json CompletionLogprobs(const Tokenizer* tok, const std::vector<TokenEvent>& events,
                                  size_t offset0);
// Chat logprobs object ({content: [{token, logprob, bytes, top_logprobs}]}).
nlohmann::json ChatLogprobs(const Tokenizer* tok, const std::vector<TokenEvent>& events);

}  // namespace dl::api
