#include "lab/lab_client.h"

#include <chrono>

#include <httplib.h>

namespace dl::lab {

using nlohmann::json;

double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Result<Endpoint> ParseEndpoint(const std::string& url) {
  std::string rest = url;
  const std::string scheme = "http://";
  if (rest.rfind(scheme, 0) == 0) {
    rest = rest.substr(scheme.size());
  } else if (rest.find("://") != std::string::npos) {
    return InvalidArgument("--endpoint {}: only http:// is supported", url);
  }
  rest = rest.substr(0, rest.find('/'));
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return InvalidArgument("--endpoint {}: expected http://HOST:PORT", url);
  }
  Endpoint ep;
  ep.host = rest.substr(0, colon);
  try {
    ep.port = std::stoi(rest.substr(colon + 1));
  } catch (...) {
    return InvalidArgument("--endpoint {}: bad port", url);
  }
  if (ep.port <= 0 || ep.port > 65535) return InvalidArgument("--endpoint {}: bad port", url);
  return ep;
}

json CompletionBody(const std::vector<int32_t>& prompt, int max_tokens, bool stream) {
  json b = {{"prompt", prompt},
            {"max_tokens", max_tokens},
            {"temperature", 0},
            {"ignore_eos", true},
            {"stream", stream}};
  if (stream) b["stream_options"] = {{"include_usage", true}};
  return b;
}

namespace {

httplib::Client MakeClient(const Endpoint& ep, double timeout_s) {
  httplib::Client cli(ep.host, ep.port);
  const auto secs = static_cast<time_t>(timeout_s);
  cli.set_read_timeout(secs, 0);
  cli.set_write_timeout(secs, 0);
  cli.set_connection_timeout(5, 0);
  return cli;
}

std::string Where(const Endpoint& ep, const char* path) {
  return fmt::format("http://{}:{}{}", ep.host, ep.port, path);
}

}  // namespace

Status StreamCompletion(const Endpoint& ep, const json& body, PromptResult* r, RequestTiming* t,
                        double timeout_s) {
  httplib::Client cli = MakeClient(ep, timeout_s);
  std::string buffer, error, status_body;
  int http_status = 0;
  bool done = false;
  bool timed_out = false;
  const double deadline = MonotonicSeconds() + timeout_s;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  req.response_handler = [&](const httplib::Response& res) {
    t->first_byte = MonotonicSeconds();
    http_status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    const double now = MonotonicSeconds();
    if (now > deadline) {
      timed_out = true;
      return false;
    }
    if (http_status != 200) {
      if (status_body.size() > (1u << 20)) return false;
      status_body.append(data, len);
      return true;
    }
    buffer.append(data, len);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        done = true;
        continue;
      }
      try {
        json j = json::parse(payload);
        if (j.contains("error")) {
          error = j["error"].dump();
          continue;
        }
        if (j.contains("usage") && j["usage"].is_object()) {
          r->cached_tokens =
              j["usage"].value("prompt_tokens_details", json::object()).value("cached_tokens", -1);
        }
        if (j.contains("choices") && !j["choices"].empty()) {
          const json& c = j["choices"][0];
          if (c.contains("token_ids") && c["token_ids"].is_array()) {
            for (const auto& id : c["token_ids"]) {
              r->tokens.push_back(id.get<int32_t>());
              t->arrivals.push_back(now);
            }
          }
          if (c.contains("finish_reason") && c["finish_reason"].is_string()) {
            r->finish_reason = c["finish_reason"].get<std::string>();
          }
        }
      } catch (const json::exception& e) {
        error = fmt::format("unparsable SSE event: {}", e.what());
      }
    }
    return true;
  };
  t->sent = MonotonicSeconds();
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool ok = cli.send(req, res, err);
  if (timed_out) {
    return Status(StatusCode::kDeadlineExceeded,
                  fmt::format("{}: request for {} did not finish within {} s",
                              Where(ep, "/v1/completions"), r->name, timeout_s));
  }
  if (!ok) {
    return Unavailable("{}: request for {} failed: {}", Where(ep, "/v1/completions"), r->name,
                       httplib::to_string(err));
  }
  if (http_status != 200) {
    return Internal("{}: {} got HTTP {}: {}", Where(ep, "/v1/completions"), r->name, http_status,
                    status_body.substr(0, 300));
  }
  if (!error.empty()) {
    return Internal("{}: {}: server error in stream: {}", Where(ep, "/v1/completions"), r->name,
                    error);
  }
  if (!done)
    return DataLoss("{}: {}: stream ended without [DONE]", Where(ep, "/v1/completions"), r->name);
  return Status::Ok();
}

Result<int32_t> NextToken(const Endpoint& ep, const std::vector<int32_t>& prompt,
                          double timeout_s) {
  httplib::Client cli = MakeClient(ep, timeout_s);
  const double deadline = MonotonicSeconds() + timeout_s;
  bool timed_out = false;
  std::string body;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = CompletionBody(prompt, 1, false).dump();
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    if (MonotonicSeconds() > deadline || body.size() > (16u << 20)) {
      timed_out = true;
      return false;
    }
    body.append(data, len);
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool ok = cli.send(req, res, err);
  if (timed_out) {
    return Status(StatusCode::kDeadlineExceeded,
                  fmt::format("{}: next request did not finish within {} s (or answered more "
                              "than 16 MiB)",
                              Where(ep, "/v1/completions"), timeout_s));
  }
  if (!ok) {
    return Unavailable("{}: next request failed: {}", Where(ep, "/v1/completions"),
                       httplib::to_string(err));
  }
  if (res.status != 200) {
    return Internal("{}: next request got HTTP {}: {}", Where(ep, "/v1/completions"), res.status,
                    body.substr(0, 300));
  }
  try {
    json j = json::parse(body);
    const auto& ids = j.at("choices").at(0).at("token_ids");
    if (ids.size() != 1) {
      return DataLoss("{}: next request returned {} tokens, expected 1",
                      Where(ep, "/v1/completions"), ids.size());
    }
    return ids[0].get<int32_t>();
  } catch (const json::exception& e) {
    return DataLoss("{}: next request: malformed response: {}", Where(ep, "/v1/completions"),
                    e.what());
  }
}

Result<json> GetState(const Endpoint& ep) {
  httplib::Client cli = MakeClient(ep, 30);
  auto res = cli.Get("/v1/decodelab/state");
  if (!res) {
    return Unavailable("{}: {}", Where(ep, "/v1/decodelab/state"), httplib::to_string(res.error()));
  }
  if (res->status != 200) {
    return Internal("{}: HTTP {}", Where(ep, "/v1/decodelab/state"), res->status);
  }
  try {
    return json::parse(res->body);
  } catch (const json::exception& e) {
    return DataLoss("{}: not JSON: {}", Where(ep, "/v1/decodelab/state"), e.what());
  }
}

Result<std::string> GetMetricsText(const Endpoint& ep) {
  httplib::Client cli = MakeClient(ep, 30);
  auto res = cli.Get("/metrics");
  if (!res) return Unavailable("{}: {}", Where(ep, "/metrics"), httplib::to_string(res.error()));
  if (res->status != 200) return Internal("{}: HTTP {}", Where(ep, "/metrics"), res->status);
  if (res->body.size() > (16u << 20))
    return DataLoss("{}: more than 16 MiB", Where(ep, "/metrics"));
  return res->body;
}

bool Healthy(const Endpoint& ep) {
  httplib::Client cli(ep.host, ep.port);
  cli.set_connection_timeout(1, 0);
  cli.set_read_timeout(2, 0);
  auto res = cli.Get("/health");
  return res && res->status == 200;
}

}  // namespace dl::lab
