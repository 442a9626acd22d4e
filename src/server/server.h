// `decodelab serve`: an OpenAI-compatible HTTP endpoint over the scheduler.
//
// Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize and
// /detokenize (vLLM's), GET /health, GET /metrics (Prometheus text with vLLM's metric names),
// GET /v1/decodelab/state (engine identity for the lab). HTTP threads parse request bodies into
// native types (api.h), hand them to the scheduler's engine thread and stream its tokens back, one
// token per SSE event.
//
// Extensions beyond OpenAI, all additive: every choice (and every streamed chunk's choice) carries
// "token_ids" (the generated ids, one per chunk when streaming), so clients can check exactness
// without re-tokenizing; vLLM's extra request fields (top_k, min_p, repetition_penalty, ignore_eos,
// stop_token_ids, chat_template_kwargs, ...) are accepted; `stop` may mix strings and token ids;
// chat responses carry reasoning_content and tool_calls parsed from Laguna's markers. docs/api.md
// lists every route and request field with its status.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "engine/scheduler.h"
#include "server/api.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace httplib {
class Server;
}

namespace dl {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0 = an ephemeral port (see Server::port())
  std::string api_key;  // empty = no authentication
  size_t max_body_bytes = 16u << 20;  // after decoding; compressed bodies are refused (415)
  int http_threads = 160;  // each open SSE stream pins one
  // Client limits (src/server/http_guard.h, docs/security.md).
  int max_connections = 0;  // connections served at once, beyond it 503; 0 = http_threads
  size_t max_header_bytes = 32u << 10;  // request line + headers (431)
  size_t max_header_count = 100;        // header fields (431)
  double header_timeout_s = 10;         // request line + headers must arrive within this (408)
  double body_timeout_s = 60;           // the body within this after the headers (408)
  size_t max_json_depth = 128;          // nesting of arrays/objects in a request body (400)
  std::string served_model_name;
  std::string model_root;  // reported in /v1/models "root"
  nlohmann::json model_identity = nlohmann::json::object();  // shape/seed/dir, for /state
  bool access_log = false;          // one log line per request (AccessLine in stats_log.h)
  double log_stats_interval_s = 0;  // vLLM's periodic throughput line every N s; 0 = off
};

class Server {
 public:
  // `engine` and `scheduler` must outlive the server. `tokenizer` and `chat_template` may be absent
  // (token-id prompts still work; chat gets a 400 naming `chat_template_error`).
  Server(Engine& engine, Scheduler& scheduler, ServerOptions options,
         std::optional<Tokenizer> tokenizer, std::optional<ChatTemplate> chat_template,
         std::string chat_template_error);
  ~Server();

  // Binds the listening socket (so port() is known before Run).
  Status Bind();
  int port() const { return port_; }
  std::string url() const;
  // Serves until Stop(); returns once the listener is closed.
  Status Run();
  // Refuses new requests (503), ends in-flight requests (streams get an error event and [DONE]),
  // stops the scheduler and closes the listener; connection threads blocked on a silent client wake
  // within 100 ms. Safe from any thread, idempotent.
  void Stop();

 private:
  void Routes();
  api::ParseContext Context() const;
  // A request body over the size or nesting limits, as the error to send.
  std::optional<api::ApiError> BodyError(const std::string& body) const;
  void LogStatsLoop();

  Engine& engine_;
  Scheduler& scheduler_;
  ServerOptions options_;
  std::optional<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> chat_template_;
  std::string chat_template_error_;
  std::unique_ptr<httplib::Server> http_;
  std::atomic<bool> stopping_{false};
  int port_ = 0;
  std::atomic<int> listen_fd_{-1};
  std::string binary_sha256_;
  int64_t created_ = 0;
  std::thread stats_thread_;
  std::mutex stats_mu_;
  std::condition_variable stats_cv_;
  bool stats_stop_ = false;
};

}  // namespace dl
