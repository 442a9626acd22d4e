#include "server/api.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <random>

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
    if (auto e = EncodeText(p.get<std::string>(), ctx, true, "prompt", &ids)) return e;
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
      if (auto e = EncodeText(item.get<std::string>(), ctx, true, "prompt", &ids)) return e;
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
  if (auto tools = body.find("tools"); tools != body.end() && !tools->is_null()) tctx["tools"] = *tools;
  tctx["add_generation_prompt"] = true;
  tctx["bos_token"] = ctx.chat_template->bos_token();
  tctx["eos_token"] = ctx.chat_template->eos_token();
  auto text = ctx.chat_template->Render(tctx);
  if (!text.ok()) {
    return BadRequest("rendering the chat template: " + text.status().message(), "messages");
  }
  std::vector<int32_t> ids;
  // The template writes its own special tokens.
  if (auto e = EncodeText(*text, ctx, false, "messages", &ids)) return e;
  if (ids.empty()) return BadRequest("the rendered chat prompt is empty", "messages");
  out->prompts.push_back(std::move(ids));
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ParseRequest(const std::string& body_text, bool chat,
                                     const ParseContext& ctx, ParsedRequest* out) {
  *out = ParsedRequest{};
  out->chat = chat;
  ojson body;
  try {
    body = ojson::parse(body_text);
  } catch (const std::exception& e) {
    return BadRequest(fmt::format("the request body is not valid JSON: {}", e.what()));
  }
  if (!body.is_object()) return BadRequest("the request body must be a JSON object");
  try {
    if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
      if (!it->is_string()) return BadRequest("model must be a string", "model");
      out->model = it->get<std::string>();
    }
    // Sampling and limits first: cheap checks before tokenizing.
    SamplingParams& s = out->sampling;
    std::optional<int64_t> n, max_tokens, top_k, seed, logprobs, top_logprobs;
    std::optional<double> temperature, top_p;
    if (auto e = GetInt(body, "n", INT64_MIN, INT64_MAX, &n)) return e;
    if (n && *n != 1) return BadRequest("only n=1 is supported", "n");
    if (auto it = body.find("best_of"); it != body.end() && !it->is_null() && *it != 1) {
      return BadRequest("best_of is not supported", "best_of");
    }
    if (auto it = body.find("echo"); it != body.end() && it->is_boolean() && it->get<bool>()) {
      return BadRequest("echo is not supported", "echo");
    }
    if (auto it = body.find("suffix"); it != body.end() && !it->is_null()) {
      return BadRequest("suffix is not supported", "suffix");
    }
    const char* max_key = "max_tokens";
    if (chat && body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null()) {
      max_key = "max_completion_tokens";
    }
    if (auto e = GetInt(body, max_key, 1, INT32_MAX, &max_tokens)) return e;
    if (auto e = GetNumber(body, "temperature", 0.0, 2.0, false, &temperature)) return e;
    if (auto e = GetNumber(body, "top_p", 0.0, 1.0, true, &top_p)) return e;
    if (auto e = GetInt(body, "top_k", -1, INT32_MAX, &top_k)) return e;
    if (auto e = GetInt(body, "seed", INT64_MIN, INT64_MAX, &seed)) return e;
    s.temperature = static_cast<float>(temperature.value_or(1.0));
    s.top_p = static_cast<float>(top_p.value_or(1.0));
    s.top_k = static_cast<int32_t>(top_k.value_or(0));
    if (seed) s.seed = static_cast<uint64_t>(*seed);
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
      if (auto e = ParseMessages(body, ctx, out)) return e;
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

// ---- ChoiceText ----

ChoiceText::ChoiceText(const Tokenizer* tokenizer, std::vector<std::string> stop_strings)
    : tokenizer_(tokenizer), stops_(std::move(stop_strings)) {
  // skip_special_tokens, vLLM's default: control tokens never show up in text.
  if (tokenizer_) decoder_.emplace(*tokenizer_, true);
}

std::string ChoiceText::Add(int32_t token, bool suppress) {
  if (stopped_) return "";
  if (!suppress && decoder_) text_ += decoder_->Add(token);
  return Release(false);
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
  size_t hold = 0;
  if (!final) {
    const size_t unsent = text_.size() - sent_;
    for (const auto& s : stops_) {
      for (size_t k = std::min(s.size() - 1, unsent); k > hold; --k) {
        if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
      }
    }
  }
  const size_t end = text_.size() - hold;
  std::string out = text_.substr(sent_, end - sent_);
  sent_ = end;
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

std::string NewRequestId(bool chat) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                               std::random_device{}();
  return fmt::format("{}-{:016x}{:08x}", chat ? "chatcmpl" : "cmpl", salt, counter.fetch_add(1));
}

}  // namespace dl::api
