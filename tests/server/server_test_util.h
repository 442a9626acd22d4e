// Helpers for the black-box server tests: a tiny model directory written with the model library, a
// server started in-process on an ephemeral 127.0.0.1 port, and an HTTP/SSE client.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/scheduler.h"
#include "server/server.h"

namespace dl::test {

// A tiny model (make-model writer: config, weights, tokenizer) plus a small chat template, written
// once per process into a temporary directory.
const std::string& TinyModelDir();

struct ServerConfig {
  int max_batch = 4;
  int max_waiting = 256;
  bool prefix_caching = false;
  std::string api_key;
  size_t max_body_bytes = 1 << 20;
  int max_seq_len = 512;
  int prefill_chunk = 16;
  bool with_chat_template = true;
  int http_threads = 160;
  std::string served_model_name = "tiny-test";
  std::string model_dir;  // empty: TinyModelDir()
};

class TestServer {
 public:
  static std::unique_ptr<TestServer> Start(const ServerConfig& config = {});
  ~TestServer();
  void Stop();
  int port() const { return server_->port(); }
  httplib::Client Client() const;
  Engine& engine() { return *engine_; }
  Scheduler& scheduler() { return *scheduler_; }

 private:
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<Server> server_;
  std::thread thread_;
};

struct HttpResult {
  int status = 0;
  std::string body;
  nlohmann::json json;  // parsed body when it is JSON
};
HttpResult PostJson(httplib::Client& cli, const std::string& path, const nlohmann::json& body,
                    const std::string& api_key = "");
HttpResult PostRaw(httplib::Client& cli, const std::string& path, const std::string& body);
HttpResult Get(httplib::Client& cli, const std::string& path, const std::string& api_key = "");

// A streamed response split into SSE events ("data: ..." payloads, in order), with the raw text.
struct SseResult {
  int status = 0;
  std::string raw;
  std::vector<std::string> data;  // payload of each data: event
  bool aborted = false;           // on_event asked to stop
  std::string error;              // client-side error (connection, read), empty when none
};
// POSTs `body` and splits the stream; `on_event` (optional) sees each payload as it arrives and
// returns false to drop the connection.
SseResult PostStream(httplib::Client& cli, const std::string& path, const nlohmann::json& body,
                     std::function<bool(const std::string&)> on_event = nullptr);

// KV pages in use, from /v1/decodelab/state.
int KvPagesUsed(httplib::Client& cli);

}  // namespace dl::test
