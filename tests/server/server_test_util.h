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

#include "comm/process.h"
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
  bool spec_ngram = false;   // speculative decoding with the n-gram drafter (--spec ngram)
  int spec_k = 4;
  int tp = 1;             // tensor-parallel ranks (CPU reference, in-process)
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

// The built `decodelab` binary (<build>/bin/decodelab; $DECODELAB_TEST_BINARY overrides it).
std::string DecodelabBinary();

// A real `decodelab serve` process on the CPU backend and an ephemeral loopback port: crash cases
// must show that the process, not just an in-process object, survives.
struct ServeProcessOptions {
  std::string model_dir;                // default: TinyModelDir()
  std::vector<std::string> extra_args;  // appended to the serve command line
  std::vector<std::string> env;         // NAME=value added to the environment
  double ready_timeout_s = 60;
};

class ServeProcess {
 public:
  // Null (with a test failure naming the log) when the server does not become ready.
  static std::unique_ptr<ServeProcess> Start(const ServeProcessOptions& options = {});
  ~ServeProcess();

  int port() const { return port_; }
  pid_t pid() const { return child_.pid(); }
  httplib::Client Client(int read_timeout_s = 60) const;
  // The process has not exited and GET /health answers 200.
  bool Alive();
  // Still running and a small greedy completion succeeds: the server is answering, not just alive.
  bool Answers();
  // Everything the process wrote to stdout and stderr so far.
  std::string Log() const;
  // VmRSS of the process in KiB (-1 when unknown).
  long RssKiB() const;
  // Sends `sig` and waits up to `timeout_s` for the exit; returns the seconds it took, or -1 (then
  // the process is killed).
  double SignalAndWait(int sig, double timeout_s);
  const comm::ExitInfo& exit_info() const { return child_.exit_info(); }

 private:
  comm::ChildProcess child_;
  std::string dir_;
  std::string log_path_;
  int port_ = 0;
};

// Raw sockets, for requests an HTTP client will not send (damaged, slow, oversized).
// A connection to 127.0.0.1:`port`; -1 when it is refused.
int Connect(int port);
// Sends all of `data`; false when the peer stops taking it.
bool SendAll(int fd, const std::string& data);
// Reads until the peer closes or `timeout_s` passes.
std::string ReadAll(int fd, double timeout_s);
// The status code of a raw HTTP/1.1 response; 0 when it has no status line.
int StatusOf(const std::string& response);

// Writes a copy of the tiny model into a fresh temporary directory with `chat_template` as its
// chat_template.jinja (empty: none); returns the directory (removed at exit).
std::string TinyModelCopy(const std::string& chat_template);

}  // namespace dl::test
