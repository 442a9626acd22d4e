#include "server/api.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

namespace dl::api {

using ojson = nlohmann::ordered_json;

nlohmann::json ErrorBody(const ApiError& e) {
  nlohmann::json err = {{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (e.param) err["param"] = *e.param;
  if (e.code) err["code"] = *e.code;
  return {{"error", err}};
}

ApiError BadRequest(std::string message, std::optional<std::string> param) {
  ApiError e;
  e.http_status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

ApiError FromStatus(const Status& s, std::optional<std::string> param) {
  ApiError e;
  e.message = s.message();
  e.param = std::move(param);
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      e.http_status = 400;
      break;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable:
    case StatusCode::kCancelled:
      e.http_status = 503;
      e.type = "server_error";
      e.code = "service_unavailable";
      e.param.reset();
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      e.code = "internal_error";
      e.param.reset();
  }
  return e;
}

std::optional<ApiError> ParseBody(const std::string& text, ojson* body) {
  try {
    *body = ojson::parse(text);
  } catch (const std::exception& e) {
    return BadRequest(fmt::format("the request body is not valid JSON: {}", e.what()));
  }
  if (!body->is_object()) return BadRequest("the request body must be a JSON object");
  return std::nullopt;
}

namespace {

std::string TypeName(const ojson& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "boolean";
  if (v.is_number_integer()) return "integer";
  if (v.is_number()) return "number";
  if (v.is_string()) return "string";
  if (v.is_array()) return "array";
  return "object";
}

// An integer field: JSON integers, or numbers with an integral value (16.0), as pydantic accepts.
std::optional<ApiError> GetInt(const ojson& body, const char* key, int64_t lo, int64_t hi,
                               std::optional<int64_t>* out) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  const ojson& v = *it;
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi)) {
      return BadRequest(fmt::format("{} must be at most {} (got {})", key, hi, u), key);
    }
    x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float() && std::isfinite(v.get<double>()) &&
             std::floor(v.get<double>()) == v.get<double>() && std::fabs(v.get<double>()) < 9e18) {
    x = static_cast<int64_t>(v.get<double>());
  } else {
    return BadRequest(fmt::format("{} must be an integer (got {})", key, TypeName(v)), key);
  }
  if (x < lo || x > hi) {
    return BadRequest(fmt::format("{} must be in [{}, {}] (got {})", key, lo, hi, x), key);
  }
  *out = x;
  return std::nullopt;
}

std::optional<ApiError> GetNumber(const ojson& body, const char* key, double lo, double hi,
                                  bool lo_open, std::optional<double>* out) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) {
    return BadRequest(fmt::format("{} must be a number (got {})", key, TypeName(*it)), key);
  }
  const double x = it->get<double>();
  if (!std::isfinite(x) || x > hi || x < lo || (lo_open && x == lo)) {
    return BadRequest(fmt::format("{} must be in {}{}, {}] (got {})", key, lo_open ? "(" : "[", lo,
                                  hi, x),
                      key);
  }
  *out = x;
  return std::nullopt;
}

std::optional<ApiError> GetBool(const ojson& body, const char* key, bool* out) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) {
    return BadRequest(fmt::format("{} must be a boolean (got {})", key, TypeName(*it)), key);
  }
  *out = it->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> TokenIds(const ojson& arr, const ParseContext& ctx, const char* param,
                                 std::vector<int32_t>* out) {
  for (const auto& t : arr) {
    if (!t.is_number_integer()) {
      return BadRequest(fmt::format("{}: token ids must be integers (got {})", param, TypeName(t)),
                        param);
    }
    const int64_t id = t.is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(
                                                    t.get<uint64_t>(), uint64_t{INT64_MAX}))
                                              : t.get<int64_t>();
    if (id < 0 || id >= ctx.vocab_size) {
      return BadRequest(fmt::format("{}: token id {} is outside the vocabulary [0, {})", param, id,
                                    ctx.vocab_size),
                        param);
    }
    out->push_back(static_cast<int32_t>(id));
  }
  return std::nullopt;
}

std::optional<ApiError> EncodeText(const std::string& text, const ParseContext& ctx,
                                   bool add_special, const char* param, std::vector<int32_t>* out) {
  if (!ctx.tokenizer) {
    return BadRequest(
        "this model has no tokenizer (tokenizer.json): send the prompt as token ids", param);
  }
  auto ids = ctx.tokenizer->Encode(text, add_special);
  if (!ids.ok()) return BadRequest(fmt::format("{}: {}", param, ids.status().message()), param);
  *out = std::move(ids).value();
  return std::nullopt;
}

std::optional<ApiError> ParsePrompt(const ojson& body, const ParseContext& ctx, ParsedRequest* out) {
  bool add_special = true;
  if (auto e = GetBool(body, "add_special_tokens", &add_special)) return e;
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return BadRequest("prompt is required", "prompt");
  const ojson& p = *it;
  auto add = [&](std::vector<int32_t> ids) -> std::optional<ApiError> {
    if (ids.empty()) return BadRequest("prompt is empty", "prompt");
    out->prompts.push_back(std::move(ids));
    return std::nullopt;
  };
  if (p.is_string()) {
    std::vector<int32_t> ids;
    if (p.get<std::string>().empty()) return BadRequest("prompt is empty", "prompt");
    if (auto e = EncodeText(p.get<std::string>(), ctx, add_special, "prompt", &ids)) return e;
    return add(std::move(ids));
  }
  if (!p.is_array()) {
    return BadRequest(fmt::format("prompt must be a string, an array of token ids, or an array of "
                                  "either (got {})",
                                  TypeName(p)),
                      "prompt");
  }
  if (p.empty()) return BadRequest("prompt is empty", "prompt");
  if (p[0].is_number()) {
    std::vector<int32_t> ids;
    if (auto e = TokenIds(p, ctx, "prompt", &ids)) return e;
    return add(std::move(ids));
  }
  for (const auto& item : p) {
    std::vector<int32_t> ids;
    if (item.is_string()) {
      if (item.get<std::string>().empty()) return BadRequest("prompt is empty", "prompt");
      if (auto e = EncodeText(item.get<std::string>(), ctx, add_special, "prompt", &ids)) return e;
    } else if (item.is_array()) {
      if (auto e = TokenIds(item, ctx, "prompt", &ids)) return e;
    } else {
      return BadRequest(fmt::format("prompt list items must be strings or arrays of token ids (got "
                                    "{})",
                                    TypeName(item)),
                        "prompt");
    }
    if (auto e = add(std::move(ids))) return e;
  }
  return std::nullopt;
}

std::optional<ApiError> ParseMessages(const ojson& body, const ParseContext& ctx,
                                      ParsedRequest* out) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) return BadRequest("messages is required", "messages");
  if (!it->is_array() || it->empty()) {
    return BadRequest("messages must be a non-empty array of {role, content} objects", "messages");
  }
  ojson messages = ojson::array();
  for (size_t i = 0; i < it->size(); ++i) {
    const ojson& m = (*it)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object()) return BadRequest(param + " must be an object", param);
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return BadRequest(param + ".role must be a string", param + ".role");
    }
    static const char* kRoles[] = {"system", "developer", "user", "assistant", "tool"};
    if (std::find(std::begin(kRoles), std::end(kRoles), role->get<std::string>()) ==
        std::end(kRoles)) {
      return BadRequest(fmt::format("{}.role must be system, developer, user, assistant or tool "
                                    "(got \"{}\")",
                                    param, role->get<std::string>()),
                        param + ".role");
    }
    ojson msg = m;
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      msg["content"] = "";
    } else if (content->is_array()) {
      std::string text;
      for (const auto& part : *content) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          return BadRequest(param + ".content: only parts of type \"text\" are supported",
                            param + ".content");
        }
        text += part["text"].get<std::string>();
      }
      msg["content"] = text;
    } else if (!content->is_string()) {
      return BadRequest(param + ".content must be a string or an array of text parts",
                        param + ".content");
    }
    messages.push_back(std::move(msg));
  }
  if (!ctx.chat_template) return BadRequest(ctx.no_template_reason, "messages");
  ojson tctx = ojson::object();
  if (auto kw = body.find("chat_template_kwargs"); kw != body.end() && !kw->is_null()) {
    if (!kw->is_object()) {
      return BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs");
    }
    for (auto& [k, v] : kw->items()) tctx[k] = v;
  }
  tctx["messages"] = messages;
  if (!out->tools.is_null()) tctx["tools"] = out->tools;
  bool add_generation_prompt = true;
  if (auto e = GetBool(body, "add_generation_prompt", &add_generation_prompt)) return e;
  tctx["add_generation_prompt"] = add_generation_prompt;
  tctx["bos_token"] = ctx.chat_template->bos_token();
  tctx["eos_token"] = ctx.chat_template->eos_token();
  auto text = ctx.chat_template->Render(tctx);
  if (!text.ok()) {
    return BadRequest("rendering the chat template: " + text.status().message(), "messages");
  }
  std::vector<int32_t> ids;
  // The template writes its own special tokens (vLLM's chat default add_special_tokens=false).
  bool add_special = false;
  if (auto e = GetBool(body, "add_special_tokens", &add_special)) return e;
  if (auto e = EncodeText(*text, ctx, add_special, "messages", &ids)) return e;
  if (ids.empty()) return BadRequest("the rendered chat prompt is empty", "messages");
  out->prompts.push_back(std::move(ids));
  return std::nullopt;
}

// Request fields and their status (docs/api.md has the same table for users).
enum class Field { kImplemented, kNoOp, kRefused };
struct FieldRule {
  const char* name;
  Field status;
  bool completions, chat;
  // kRefused: the value that asks for nothing (accepted); null always is.
  const char* neutral_json = nullptr;
  const char* why = nullptr;
};

constexpr const char* kNoConstrainedDecoding =
    "decodelab has no constrained (guided) decoding";

const FieldRule kFieldRules[] = {
    // Implemented.
    {"model", Field::kImplemented, true, true},
    {"prompt", Field::kImplemented, true, false},
    {"messages", Field::kImplemented, false, true},
    {"max_tokens", Field::kImplemented, true, true},
    {"max_completion_tokens", Field::kImplemented, true, true},
    {"temperature", Field::kImplemented, true, true},
    {"top_p", Field::kImplemented, true, true},
    {"top_k", Field::kImplemented, true, true},
    {"min_p", Field::kImplemented, true, true},
    {"seed", Field::kImplemented, true, true},
    {"presence_penalty", Field::kImplemented, true, true},
    {"frequency_penalty", Field::kImplemented, true, true},
    {"repetition_penalty", Field::kImplemented, true, true},
    {"logit_bias", Field::kImplemented, true, true},
    {"stop", Field::kImplemented, true, true},
    {"stop_token_ids", Field::kImplemented, true, true},
    {"ignore_eos", Field::kImplemented, true, true},
    {"stream", Field::kImplemented, true, true},
    {"stream_options", Field::kImplemented, true, true},
    {"n", Field::kImplemented, true, true},
    {"best_of", Field::kImplemented, true, false},
    {"logprobs", Field::kImplemented, true, true},
    {"top_logprobs", Field::kImplemented, false, true},
    {"echo", Field::kImplemented, true, false},
    {"suffix", Field::kImplemented, true, false},
    {"response_format", Field::kImplemented, true, true},
    {"add_special_tokens", Field::kImplemented, true, true},
    {"tools", Field::kImplemented, false, true},
    {"tool_choice", Field::kImplemented, false, true},
    {"parallel_tool_calls", Field::kImplemented, false, true},
    {"chat_template_kwargs", Field::kImplemented, false, true},
    {"add_generation_prompt", Field::kImplemented, false, true},
    {"include_reasoning", Field::kImplemented, false, true},
    // OpenAI fields with no local meaning.
    {"user", Field::kNoOp, true, true},
    {"metadata", Field::kNoOp, true, true},
    {"store", Field::kNoOp, true, true},
    {"service_tier", Field::kNoOp, true, true},
    {"prompt_cache_key", Field::kNoOp, true, true},
    {"safety_identifier", Field::kNoOp, true, true},
    {"prediction", Field::kNoOp, false, true},
    // Would change the output; not implemented.
    {"modalities", Field::kRefused, false, true, R"(["text"])", "only text output exists"},
    {"audio", Field::kRefused, false, true, nullptr, "only text output exists"},
    {"functions", Field::kRefused, false, true, nullptr, "the deprecated form: use tools"},
    {"function_call", Field::kRefused, false, true, nullptr, "the deprecated form: use tool_choice"},
    {"reasoning_effort", Field::kRefused, false, true, nullptr,
     "Laguna's template has no effort levels; use chat_template_kwargs.enable_thinking"},
    {"verbosity", Field::kRefused, false, true, nullptr, "Laguna has no verbosity control"},
    {"web_search_options", Field::kRefused, false, true, nullptr, "there is no web search"},
    {"min_tokens", Field::kRefused, true, true, "0", "not implemented"},
    {"bad_words", Field::kRefused, true, true, "[]", "not implemented"},
    {"allowed_token_ids", Field::kRefused, true, true, nullptr, "not implemented"},
    {"use_beam_search", Field::kRefused, true, true, "false", "beam search is not implemented"},
    {"length_penalty", Field::kRefused, true, true, "1", "beam search is not implemented"},
    {"include_stop_str_in_output", Field::kRefused, true, true, "false", "not implemented"},
    {"skip_special_tokens", Field::kRefused, true, true, "true",
     "special tokens are always skipped in text (token_ids has every id)"},
    {"spaces_between_special_tokens", Field::kRefused, true, true, "true", "not implemented"},
    {"truncate_prompt_tokens", Field::kRefused, true, true, nullptr, "not implemented"},
    {"prompt_logprobs", Field::kRefused, true, true, nullptr, "not implemented"},
    {"return_tokens_as_token_ids", Field::kRefused, true, true, "false",
     "not implemented (token_ids carries the ids)"},
    {"guided_json", Field::kRefused, true, true, nullptr, kNoConstrainedDecoding},
    {"guided_regex", Field::kRefused, true, true, nullptr, kNoConstrainedDecoding},
    {"guided_choice", Field::kRefused, true, true, nullptr, kNoConstrainedDecoding},
    {"guided_grammar", Field::kRefused, true, true, nullptr, kNoConstrainedDecoding},
    {"structured_outputs", Field::kRefused, true, true, nullptr, kNoConstrainedDecoding},
    {"chat_template", Field::kRefused, false, true, nullptr,
     "per-request templates are not accepted; start the server with --chat-template FILE"},
    {"documents", Field::kRefused, false, true, nullptr, "not implemented"},
    {"continue_final_message", Field::kRefused, false, true, "false", "not implemented"},
    {"echo", Field::kRefused, false, true, "false", "not implemented for chat"},
    {"priority", Field::kRefused, true, true, "0", "requests are served first come, first served"},
};

const FieldRule* FindRule(const std::string& name, bool chat) {
  for (const auto& r : kFieldRules) {
    if (name == r.name && (chat ? r.chat : r.completions)) return &r;
  }
  return nullptr;
}

// Sorts the body's fields: refuses those that would change the output and are not implemented,
// lists unknown ones.
std::optional<ApiError> CheckFields(const ojson& body, bool chat, ParsedRequest* out) {
  for (auto it = body.begin(); it != body.end(); ++it) {
    const FieldRule* r = FindRule(it.key(), chat);
    if (!r) {
      out->ignored_fields.push_back(it.key());
      continue;
    }
    if (r->status != Field::kRefused || it->is_null()) continue;
    if (r->neutral_json && *it == ojson::parse(r->neutral_json)) continue;
    return BadRequest(fmt::format("{} is not supported on {}: {}", it.key(),
                                  chat ? "/v1/chat/completions" : "/v1/completions", r->why),
                      it.key());
  }
  return std::nullopt;
}

std::optional<ApiError> ParseLogitBias(const ojson& body, const ParseContext& ctx,
                                       SamplingParams* s) {
  auto it = body.find("logit_bias");
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_object()) {
    return BadRequest("logit_bias must be an object mapping token ids to biases", "logit_bias");
  }
  for (auto e = it->begin(); e != it->end(); ++e) {
    const std::string& key = e.key();
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (key.empty() || ec != std::errc() || end != key.data() + key.size()) {
      return BadRequest(fmt::format("logit_bias key \"{}\" is not a token id", key), "logit_bias");
    }
    if (id < 0 || id >= ctx.vocab_size) {
      return BadRequest(fmt::format("logit_bias token id {} is outside the vocabulary [0, {})", id,
                                    ctx.vocab_size),
                        "logit_bias");
    }
    if (!e->is_number() || !std::isfinite(e->get<double>())) {
      return BadRequest(fmt::format("logit_bias[\"{}\"] must be a number", key), "logit_bias");
    }
    // OpenAI's range; larger values are clamped, as vLLM does.
    s->logit_bias[static_cast<int32_t>(id)] =
        static_cast<float>(std::clamp(e->get<double>(), -100.0, 100.0));
  }
  return std::nullopt;
}

std::optional<ApiError> ParseResponseFormat(const ojson& body) {
  auto it = body.find("response_format");
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_object() || !it->contains("type") || !(*it)["type"].is_string()) {
    return BadRequest("response_format must be an object with a string \"type\"", "response_format");
  }
  const std::string type = (*it)["type"];
  if (type == "text") return std::nullopt;  // the default: plain text
  if (type == "json_object" || type == "json_schema") {
    return BadRequest(fmt::format("response_format type \"{}\" is not supported: {}", type,
                                  kNoConstrainedDecoding),
                      "response_format");
  }
  return BadRequest(fmt::format("response_format type \"{}\" is unknown (text, json_object, "
                                "json_schema)",
                                type),
                    "response_format");
}

// tools, tool_choice and parallel_tool_calls (chat).
std::optional<ApiError> ParseTools(const ojson& body, ParsedRequest* out) {
  bool have_tools = false;
  if (auto it = body.find("tools"); it != body.end() && !it->is_null()) {
    if (!it->is_array()) return BadRequest("tools must be an array of function tools", "tools");
    for (size_t i = 0; i < it->size(); ++i) {
      const ojson& t = (*it)[i];
      const std::string param = fmt::format("tools[{}]", i);
      if (!t.is_object() || t.value("type", "") != "function" || !t.contains("function") ||
          !t["function"].is_object()) {
        return BadRequest(param + " must be {\"type\": \"function\", \"function\": {...}}", param);
      }
      const ojson& f = t["function"];
      if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty()) {
        return BadRequest(param + ".function.name must be a non-empty string",
                          param + ".function.name");
      }
      if (f.contains("parameters") && !f["parameters"].is_null() && !f["parameters"].is_object()) {
        return BadRequest(param + ".function.parameters must be a JSON Schema object",
                          param + ".function.parameters");
      }
    }
    out->tools = *it;
    have_tools = !it->empty();
  }
  std::string choice = have_tools ? "auto" : "none";
  if (auto it = body.find("tool_choice"); it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      choice = it->get<std::string>();
      if (choice == "required") {
        return BadRequest(
            "tool_choice \"required\" is not supported: forcing a call needs constrained "
            "decoding, which decodelab does not have; use \"auto\"",
            "tool_choice");
      }
      if (choice != "auto" && choice != "none") {
        return BadRequest(fmt::format("tool_choice must be \"none\", \"auto\", \"required\" or a "
                                      "named function (got \"{}\")",
                                      choice),
                          "tool_choice");
      }
    } else if (it->is_object()) {
      const std::string name = it->contains("function") && (*it)["function"].is_object()
                                   ? (*it)["function"].value("name", "")
                                   : "";
      return BadRequest(fmt::format("tool_choice naming a function (\"{}\") is not supported: "
                                    "forcing a call needs constrained decoding, which decodelab "
                                    "does not have; use \"auto\"",
                                    name),
                        "tool_choice");
    } else {
      return BadRequest("tool_choice must be a string or an object", "tool_choice");
    }
  }
  if (auto e = GetBool(body, "parallel_tool_calls", &out->parallel_tool_calls)) return e;
  out->parse_tool_calls = have_tools && choice == "auto";
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ParseRequest(const std::string& body_text, bool chat,
                                     const ParseContext& ctx, ParsedRequest* out) {
  *out = ParsedRequest{};
  out->chat = chat;
  ojson body;
  if (auto e = ParseBody(body_text, &body)) return e;
  try {
    if (auto e = CheckFields(body, chat, out)) return e;
    if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
      if (!it->is_string()) return BadRequest("model must be a string", "model");
      out->model = it->get<std::string>();
    }
    // Sampling and limits first: cheap checks before tokenizing.
    SamplingParams& s = out->sampling;
    std::optional<int64_t> n, max_tokens, top_k, seed, logprobs, top_logprobs;
    std::optional<double> temperature, top_p, min_p, presence, frequency, repetition;
    if (auto e = GetInt(body, "n", INT64_MIN, INT64_MAX, &n)) return e;
    if (n && *n != 1) return BadRequest("only n=1 is supported", "n");
    if (auto it = body.find("best_of"); it != body.end() && !it->is_null() && *it != 1) {
      return BadRequest("best_of is not supported", "best_of");
    }
    if (auto it = body.find("echo"); !chat && it != body.end() && it->is_boolean() && it->get<bool>()) {
      return BadRequest("echo is not supported", "echo");
    }
    if (auto it = body.find("suffix"); !chat && it != body.end() && !it->is_null()) {
      return BadRequest("suffix is not supported", "suffix");
    }
    // max_completion_tokens (OpenAI's newer name) wins over max_tokens, as in vLLM.
    const char* max_key = "max_tokens";
    if (body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null()) {
      max_key = "max_completion_tokens";
    }
    if (auto e = GetInt(body, max_key, 1, INT32_MAX, &max_tokens)) return e;
    if (auto e = GetNumber(body, "temperature", 0.0, 2.0, false, &temperature)) return e;
    if (auto e = GetNumber(body, "top_p", 0.0, 1.0, true, &top_p)) return e;
    if (auto e = GetInt(body, "top_k", -1, INT32_MAX, &top_k)) return e;
    if (auto e = GetNumber(body, "min_p", 0.0, 1.0, false, &min_p)) return e;
    if (auto e = GetNumber(body, "presence_penalty", -2.0, 2.0, false, &presence)) return e;
    if (auto e = GetNumber(body, "frequency_penalty", -2.0, 2.0, false, &frequency)) return e;
    if (auto e = GetNumber(body, "repetition_penalty", 0.0, 1e9, true, &repetition)) return e;
    if (auto e = GetInt(body, "seed", INT64_MIN, INT64_MAX, &seed)) return e;
    const SamplingDefaults& d = ctx.defaults;
    s.temperature = static_cast<float>(temperature.value_or(d.temperature.value_or(1.0)));
    s.top_p = static_cast<float>(top_p.value_or(d.top_p.value_or(1.0)));
    s.top_k = static_cast<int32_t>(top_k.value_or(d.top_k.value_or(0)));
    s.min_p = static_cast<float>(min_p.value_or(d.min_p.value_or(0.0)));
    s.presence_penalty = static_cast<float>(presence.value_or(0.0));
    s.frequency_penalty = static_cast<float>(frequency.value_or(0.0));
    s.repetition_penalty = static_cast<float>(repetition.value_or(d.repetition_penalty.value_or(1.0)));
    if (auto e = ParseLogitBias(body, ctx, &s)) return e;
    if (seed) s.seed = static_cast<uint64_t>(*seed);
    if (auto e = ParseResponseFormat(body)) return e;
    if (auto e = GetBool(body, "ignore_eos", &s.ignore_eos)) return e;
    if (auto e = GetBool(body, "stream", &out->stream)) return e;
    if (auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
      if (!it->is_object()) return BadRequest("stream_options must be an object", "stream_options");
      if (!out->stream) {
        return BadRequest("stream_options is only allowed when stream is true", "stream_options");
      }
      if (auto e = GetBool(*it, "include_usage", &out->include_usage)) {
        e->param = "stream_options.include_usage";
        return e;
      }
      for (auto o = it->begin(); o != it->end(); ++o) {
        if (o.key() == "include_usage") continue;
        // vLLM's usage in every chunk changes what is sent: refused, not dropped.
        if (o.key() == "continuous_usage_stats" || o.key() == "include_obfuscation") {
          if (o->is_null() || *o == false) continue;
          return BadRequest(fmt::format("stream_options.{} is not supported", o.key()),
                            "stream_options." + o.key());
        }
        out->ignored_fields.push_back("stream_options." + o.key());
      }
    }
    // Stop strings and ids.
    if (auto it = body.find("stop"); it != body.end() && !it->is_null()) {
      auto add = [&](const ojson& v) -> std::optional<ApiError> {
        if (v.is_string()) {
          if (!v.get<std::string>().empty()) out->stop_strings.push_back(v.get<std::string>());
        } else if (v.is_number_integer()) {
          std::vector<int32_t> id;
          if (auto e = TokenIds(ojson::array({v}), ctx, "stop", &id)) return e;
          s.stop_token_ids.push_back(id[0]);
        } else {
          return BadRequest("stop must be a string or an array of strings (or token ids)", "stop");
        }
        return std::nullopt;
      };
      if (it->is_array()) {
        for (const auto& v : *it) {
          if (auto e = add(v)) return e;
        }
      } else if (auto e = add(*it)) {
        return e;
      }
    }
    if (auto it = body.find("stop_token_ids"); it != body.end() && !it->is_null()) {
      if (!it->is_array()) {
        return BadRequest("stop_token_ids must be an array of token ids", "stop_token_ids");
      }
      if (auto e = TokenIds(*it, ctx, "stop_token_ids", &s.stop_token_ids)) return e;
    }
    // Logprobs: an integer on completions, a boolean plus top_logprobs on chat.
    if (chat) {
      bool want = false;
      if (auto e = GetBool(body, "logprobs", &want)) return e;
      if (auto e = GetInt(body, "top_logprobs", 0, 20, &top_logprobs)) return e;
      if (top_logprobs && !want) {
        return BadRequest("top_logprobs requires logprobs to be true", "top_logprobs");
      }
      if (want) out->logprobs = static_cast<int32_t>(top_logprobs.value_or(0));
    } else {
      if (auto it = body.find("logprobs"); it != body.end() && it->is_boolean()) {
        return BadRequest("logprobs must be an integer on /v1/completions (the number of top "
                          "alternatives)",
                          "logprobs");
      }
      if (auto e = GetInt(body, "logprobs", 0, 20, &logprobs)) return e;
      if (logprobs) out->logprobs = static_cast<int32_t>(*logprobs);
    }
    s.logprobs = out->logprobs;
    // Prompt(s).
    if (chat) {
      if (auto e = ParseTools(body, out)) return e;
      if (auto e = GetBool(body, "include_reasoning", &out->include_reasoning)) return e;
      if (auto e = ParseMessages(body, ctx, out)) return e;
      if (ctx.tokenizer) {
        const ReasoningTokens ids = ReasoningTokens::From(*ctx.tokenizer);
        out->parse_reasoning = ids.usable();
        out->reasoning_start = ReasoningParser::StartMode(out->prompts[0], ids);
      }
    } else if (auto e = ParsePrompt(body, ctx, out)) {
      return e;
    }
    size_t longest = 0;
    for (const auto& p : out->prompts) longest = std::max(longest, p.size());
    if (static_cast<int64_t>(longest) >= ctx.max_context) {
      return BadRequest(fmt::format("this model's maximum context length is {} tokens; the prompt "
                                    "has {} tokens, leaving no room to generate",
                                    ctx.max_context, longest),
                        chat ? "messages" : "prompt");
    }
    if (max_tokens) {
      s.max_tokens = static_cast<int32_t>(*max_tokens);
    } else if (ctx.defaults.max_tokens) {
      s.max_tokens = static_cast<int32_t>(std::min<int64_t>(
          *ctx.defaults.max_tokens, ctx.max_context - static_cast<int64_t>(longest)));
    } else {
      // OpenAI's completions default is 16; chat defaults to the rest of the context (vLLM).
      s.max_tokens = chat ? ctx.max_context - static_cast<int32_t>(longest) : 16;
    }
    if (static_cast<int64_t>(longest) + s.max_tokens > ctx.max_context) {
      return BadRequest(fmt::format("this model's maximum context length is {} tokens; the request "
                                    "asks for {} ({} in the prompt + {} to generate)",
                                    ctx.max_context, longest + s.max_tokens, longest, s.max_tokens),
                        max_key);
    }
  } catch (const std::exception& e) {
    return BadRequest(fmt::format("invalid request: {}", e.what()));
  }
  return std::nullopt;
}

// ---- /tokenize, /detokenize ----

namespace {

void ListUnknown(const ojson& body, std::initializer_list<const char*> known,
                 std::vector<std::string>* ignored) {
  for (auto it = body.begin(); it != body.end(); ++it) {
    if (std::find_if(known.begin(), known.end(), [&](const char* k) { return it.key() == k; }) ==
        known.end()) {
      ignored->push_back(it.key());
    }
  }
}

}  // namespace

std::string RequestedModel(const ojson& body) {
  auto it = body.find("model");
  if (it == body.end() || !it->is_string()) return "";
  return it->get<std::string>();
}

std::optional<ApiError> Tokenize(const ojson& body, const ParseContext& ctx,
                                 nlohmann::json* response, std::vector<std::string>* ignored) {
  if (!ctx.tokenizer) {
    return BadRequest("this model has no tokenizer (tokenizer.json): nothing to tokenize with");
  }
  try {
    const bool chat = body.contains("messages");
    if (chat == body.contains("prompt")) {
      return BadRequest("give exactly one of prompt (text) or messages (chat)");
    }
    ListUnknown(body,
                {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                 "chat_template_kwargs", "tools", "return_token_strs"},
                ignored);
    ParsedRequest r;
    if (chat) {
      if (auto e = ParseTools(body, &r)) return e;
      if (auto e = ParseMessages(body, ctx, &r)) return e;
    } else {
      if (!body["prompt"].is_string()) return BadRequest("prompt must be a string", "prompt");
      bool add_special = true;
      if (auto e = GetBool(body, "add_special_tokens", &add_special)) return e;
      std::vector<int32_t> ids;
      if (auto e = EncodeText(body["prompt"].get<std::string>(), ctx, add_special, "prompt", &ids)) {
        return e;
      }
      r.prompts.push_back(std::move(ids));
    }
    bool strs = false;
    if (auto e = GetBool(body, "return_token_strs", &strs)) return e;
    const std::vector<int32_t>& ids = r.prompts.at(0);
    nlohmann::json token_strs = nullptr;
    if (strs) {
      token_strs = nlohmann::json::array();
      for (int32_t id : ids) token_strs.push_back(ctx.tokenizer->IdToToken(id).value_or(""));
    }
    *response = {{"count", ids.size()},
                 {"max_model_len", ctx.max_context},
                 {"tokens", ids},
                 {"token_strs", token_strs}};
  } catch (const std::exception& e) {
    return BadRequest(fmt::format("invalid request: {}", e.what()));
  }
  return std::nullopt;
}

std::optional<ApiError> Detokenize(const ojson& body, const ParseContext& ctx,
                                   nlohmann::json* response, std::vector<std::string>* ignored) {
  if (!ctx.tokenizer) {
    return BadRequest("this model has no tokenizer (tokenizer.json): nothing to detokenize with");
  }
  ListUnknown(body, {"model", "tokens"}, ignored);
  auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) {
    return BadRequest("tokens must be an array of token ids", "tokens");
  }
  std::vector<int32_t> ids;
  if (auto e = TokenIds(*it, ctx, "tokens", &ids)) return e;
  *response = {{"prompt", ctx.tokenizer->Decode(ids, false)}};
  return std::nullopt;
}

// ---- ChoiceText ----

ChoiceText::ChoiceText(const Tokenizer* tokenizer, std::vector<std::string> stop_strings,
                       std::vector<int32_t> keep)
    : tokenizer_(tokenizer), keep_(std::move(keep)), stops_(std::move(stop_strings)) {
  // skip_special_tokens, vLLM's default: control tokens never show up in text. With ids to keep,
  // the decoder sees every token and Add leaves out the other special ones.
  if (tokenizer_) decoder_.emplace(*tokenizer_, keep_.empty());
}

std::string ChoiceText::Add(int32_t token, bool suppress) {
  if (stopped_) return "";
  if (!keep_.empty() && tokenizer_->IsSpecial(token) &&
      std::find(keep_.begin(), keep_.end(), token) == keep_.end()) {
    suppress = true;
  }
  if (!suppress && decoder_) text_ += decoder_->Add(token);
  return Release(false);
}

std::vector<int32_t> ChatMarkerIds(const Tokenizer& tokenizer) {
  std::vector<int32_t> ids;
  for (std::string_view m : {kThinkStart, kThinkEnd, kToolCallStart, kToolCallEnd, kArgKeyStart,
                             kArgKeyEnd, kArgValueStart, kArgValueEnd}) {
    if (auto id = tokenizer.TokenToId(m)) ids.push_back(*id);
  }
  return ids;
}

std::string ChoiceText::Finish() {
  if (stopped_) return "";
  if (decoder_) text_ += decoder_->Flush();
  return Release(true);
}

std::string ChoiceText::Release(bool final) {
  if (!stops_.empty()) {
    // Text before sent_ never holds the start of a match: it would have been held back.
    size_t earliest = std::string::npos;
    for (const auto& s : stops_) earliest = std::min(earliest, text_.find(s, sent_));
    if (earliest != std::string::npos) {
      text_.resize(earliest);
      stopped_ = true;
      std::string out = text_.substr(sent_);
      sent_ = text_.size();
      return out;
    }
  }
  // Unsent text that could still become a stop string stays back (the longest such end).
  size_t hold = 0;
  if (!final) {
    const std::string_view unsent = std::string_view(text_).substr(sent_);
    for (const auto& s : stops_) hold = std::max(hold, PartialMarkerSuffix(unsent, s));
  }
  const size_t end = text_.size() - hold;
  std::string out = text_.substr(sent_, end - sent_);
  sent_ = end;
  return out;
}

// ---- ChatOutput ----

void ChatDelta::Append(ChatDelta&& later) {
  reasoning += later.reasoning;
  content += later.content;
  for (auto& c : later.tool_calls) tool_calls.push_back(std::move(c));
}

ChatOutput::ChatOutput(const ParsedRequest& req)
    : include_reasoning_(req.include_reasoning), parallel_(req.parallel_tool_calls) {
  if (req.parse_reasoning) reasoning_.emplace(req.reasoning_start);
  if (req.parse_tool_calls) tools_.emplace(req.tools);
}

void ChatOutput::Take(ReasoningSplit split, ChatDelta* out) {
  if (include_reasoning_) out->reasoning += split.reasoning;
  if (!tools_) {
    out->content += split.content;
    return;
  }
  ToolParse t = tools_->Add(split.content);
  out->content += t.content;
  for (auto& c : t.calls) {
    // parallel_tool_calls=false: one call per response, the first the model wrote.
    if (!parallel_ && calls_ > 0) continue;
    ++calls_;
    out->tool_calls.push_back(std::move(c));
  }
}

ChatDelta ChatOutput::Add(std::string_view text) {
  ChatDelta out;
  if (reasoning_) {
    Take(reasoning_->Add(text), &out);
  } else {
    Take({"", std::string(text)}, &out);
  }
  return out;
}

ChatDelta ChatOutput::Finish() {
  ChatDelta out;
  if (reasoning_) Take(reasoning_->Finish(), &out);
  // Calls come only from Add (Take above); Finish gives back held or unclosed text.
  if (tools_) out.content += tools_->Finish().content;
  return out;
}

std::string TokenString(const Tokenizer* tokenizer, int32_t id) {
  if (!tokenizer) return "";
  return tokenizer->Decode(std::span<const int32_t>(&id, 1), false);
}

nlohmann::json Usage(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

nlohmann::json CompletionLogprobs(const Tokenizer* tok, const std::vector<TokenEvent>& events,
                                  size_t offset0) {
  nlohmann::json tokens = nlohmann::json::array(), lps = nlohmann::json::array(),
                 tops = nlohmann::json::array(), offsets = nlohmann::json::array();
  size_t offset = offset0;
  for (const auto& e : events) {
    const std::string s = TokenString(tok, e.token);
    tokens.push_back(s);
    lps.push_back(e.logprob);
    nlohmann::json top = nlohmann::json::object();
    for (const auto& t : e.top) top[TokenString(tok, t.token)] = t.logprob;
    tops.push_back(top);
    offsets.push_back(offset);
    offset += s.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

namespace {
nlohmann::json Bytes(const std::string& s) {
  nlohmann::json b = nlohmann::json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}
}  // namespace

nlohmann::json ChatLogprobs(const Tokenizer* tok, const std::vector<TokenEvent>& events) {
  nlohmann::json content = nlohmann::json::array();
  for (const auto& e : events) {
    const std::string s = TokenString(tok, e.token);
    nlohmann::json top = nlohmann::json::array();
    for (const auto& t : e.top) {
      const std::string ts = TokenString(tok, t.token);
      top.push_back({{"token", ts}, {"logprob", t.logprob}, {"bytes", Bytes(ts)}});
    }
    content.push_back({{"token", s}, {"logprob", e.logprob}, {"bytes", Bytes(s)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

}  // namespace dl::api
