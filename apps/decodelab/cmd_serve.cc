// decodelab serve: the OpenAI-compatible HTTP endpoint (src/server) over the continuous-batching
// scheduler (src/engine/scheduler.h).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <thread>

#include <pthread.h>
#include <spdlog/spdlog.h>

#include "apps/decodelab/commands.h"
#include "engine/dflash_drafter.h"
#include "apps/decodelab/engine_flags.h"
#include "base/file_util.h"
#include "server/server.h"
#include "tokenizer/tokenizer_writer.h"

namespace dl::app {
namespace {

struct ServeFlags {
  EngineFlags engine;
  SpecFlags spec;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  std::string api_key_file;
  int max_batch = 8;
  int max_num_batched_tokens = 0;  // 0: max(prefill chunk, max batch)
  int max_waiting = 1024;
  bool prefix_caching = false;
  size_t max_body_bytes = 16u << 20;
  std::string served_model_name;
  int http_threads = 160;
  int max_connections = 0;
  double header_timeout_s = 10;
  double body_timeout_s = 60;
  double shutdown_timeout_s = 10;
  std::string chat_template;
  bool access_log = false;
  double log_stats_interval = 10;
  bool disable_log_stats = false;
};

// The API key from --api-key, --api-key-file or $DECODELAB_API_KEY (at most one of them): a key in
// a file or the environment does not show in `ps`.
Result<std::string> ResolveApiKey(const ServeFlags& f) {
  const char* env = std::getenv("DECODELAB_API_KEY");
  const bool from_env = env != nullptr && *env != '\0';
  const int sources = !f.api_key.empty() + !f.api_key_file.empty() + from_env;
  if (sources > 1) {
    return InvalidArgument(
        "give the API key once: --api-key, --api-key-file and $DECODELAB_API_KEY are exclusive");
  }
  if (!f.api_key_file.empty()) {
    DL_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(f.api_key_file, 64 << 10));
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) {
      text.pop_back();
    }
    if (text.empty()) return InvalidArgument("--api-key-file {}: the file is empty", f.api_key_file);
    if (text.find_first_of("\r\n") != std::string::npos) {
      return InvalidArgument("--api-key-file {}: the key must be one line", f.api_key_file);
    }
    return text;
  }
  if (from_env) return std::string(env);
  return f.api_key;
}

bool IsLoopbackHost(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

int RunServe(const ServeFlags& f) {
  // Signals go to one waiting thread (below), never to a worker in the middle of a step: block them
  // before any thread exists so every thread inherits the mask.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a vanished client must not kill the server

  auto opts = f.engine.ToOptions();
  if (!opts.ok()) return ReportError(opts.status());
  auto spec = f.spec.ToOptions();
  if (!spec.ok()) return ReportError(spec.status());
  if (spec->method == SpecMethod::kDflash && f.prefix_caching) {
    return ReportError(Unimplemented("--enable-prefix-caching with --spec dflash: the DFlash drafter needs the model's "
                                     "hidden states of every prompt position, which cached pages skip"));
  }
  if (Status st = SpecFlags::Size(*spec, &*opts); !st.ok()) return ReportError(st);
  auto api_key = ResolveApiKey(f);
  if (!api_key.ok()) return ReportError(api_key.status());
  if (api_key->empty() && !IsLoopbackHost(f.host)) {
    std::fprintf(stderr,
                 "warning: --host %s accepts connections from other machines and no API key is "
                 "set: anyone who can reach this port can use the model (set --api-key-file or "
                 "$DECODELAB_API_KEY)\n",
                 f.host.c_str());
  }
  if (f.max_batch < 1) return ReportError(InvalidArgument("--max-batch must be at least 1"));
  if (f.max_waiting < 0) return ReportError(InvalidArgument("--max-waiting must be >= 0"));
  // Pools for max_batch full-length sequences; with prefix caching, as much again for cached pages.
  opts->max_sequences = f.max_batch * (f.prefix_caching ? 2 : 1);
  opts->max_batch = f.max_batch;
  opts->max_rows_per_step =
      f.max_num_batched_tokens > 0 ? f.max_num_batched_tokens : std::max(opts->prefill_chunk, f.max_batch);
  if (opts->max_rows_per_step < f.max_batch) {
    return ReportError(InvalidArgument("--max-num-batched-tokens {} is below --max-batch {}: every running "
                                       "sequence needs a row in each step",
                                       opts->max_rows_per_step, f.max_batch));
  }
  spdlog::info("decodelab serve: loading {} ...",
               opts->model_dir.empty() ? "--shape " + opts->shape : opts->model_dir);
  auto engine = LoadEngine(*opts);
  if (!engine.ok()) return ReportError(engine.status());
  // The drafter once the model is loaded (DFlash reads its hidden size, vocabulary and LM head).
  auto drafter = MakeDrafterFor(*spec, *(*engine)->checkpoint, (*engine)->runner.get());
  if (!drafter.ok()) return ReportError(drafter.status());
  Engine& e = **engine;
  spdlog::info("backend: {} ({})", e.runner->backend_name(), e.backend_choice_reason);

  SchedulerOptions so;
  so.max_batch = f.max_batch;
  so.max_waiting = f.max_waiting;
  so.prefill_chunk = opts->prefill_chunk;
  so.enable_prefix_caching = f.prefix_caching;
  so.max_tokens_per_step = opts->max_rows_per_step;
  so.drafter = *drafter;
  so.num_draft_tokens = spec->enabled() ? spec->k : 0;
  if (spec->enabled()) spdlog::info("speculative decoding: {} drafter, up to {} draft tokens per step", (*drafter)->name(), spec->k);

  // Tokenizer and chat template: from the model directory; --shape gets the generated small
  // tokenizer make-model would write for the same vocabulary (and no chat template).
  // --chat-template FILE replaces the model's template; unusable, it stops the start.
  std::optional<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;
  std::string template_error;
  nlohmann::json identity;
  if (!opts->model_dir.empty()) {
    identity = {{"model_dir", std::filesystem::absolute(opts->model_dir).string()}};
    if (std::filesystem::exists(std::filesystem::path(opts->model_dir) / "tokenizer.json")) {
      auto t = Tokenizer::FromFile(opts->model_dir);
      if (!t.ok()) return ReportError(t.status());
      tokenizer = std::move(t).value();
    } else {
      spdlog::warn("{} has no tokenizer.json: only token-id prompts will work", opts->model_dir);
    }
    auto tmpl = LoadChatTemplateForModel(opts->model_dir, f.chat_template);
    if (!tmpl.ok() && !f.chat_template.empty()) {
      return ReportError(tmpl.status().WithContext("--chat-template"));
    }
    if (tmpl.ok()) {
      chat_template = std::move(tmpl).value();
    } else if (tmpl.status().code() == StatusCode::kNotFound) {
      template_error = "this model has no chat template (chat_template.jinja): use /v1/completions";
    } else {
      template_error = "the model's chat template cannot be used: " + tmpl.status().message();
      spdlog::warn("{}", template_error);
    }
  } else {
    identity = {{"shape", opts->shape}, {"seed", opts->seed},
                {"num_layers", e.config().num_hidden_layers}};
    if (e.config().vocab_size >= MinSmallTokenizerVocabSize()) {
      auto text = BuildSmallTokenizerJson(static_cast<int32_t>(e.config().vocab_size));
      if (text.ok()) {
        auto t = Tokenizer::FromJson(*text, "generated tokenizer for --shape " + opts->shape);
        if (t.ok()) tokenizer = std::move(t).value();
      }
    }
    template_error = "models built in memory with --shape have no chat template: use "
                     "/v1/completions, serve a make-model directory, or pass --chat-template FILE";
    if (!f.chat_template.empty()) {
      auto tmpl = LoadChatTemplateForModel("", f.chat_template);
      if (!tmpl.ok()) return ReportError(tmpl.status().WithContext("--chat-template"));
      chat_template = std::move(tmpl).value();
    }
  }
  if (chat_template) spdlog::info("chat template: {}", chat_template->source_name());

  Scheduler scheduler(e, so);
  scheduler.Start();
  ServerOptions sopts;
  sopts.host = f.host;
  sopts.port = f.port;
  sopts.api_key = *api_key;
  sopts.max_body_bytes = f.max_body_bytes;
  sopts.http_threads = f.http_threads;
  sopts.max_connections = f.max_connections;
  sopts.header_timeout_s = f.header_timeout_s;
  sopts.body_timeout_s = f.body_timeout_s;
  // As vLLM: the --model argument as given (org/name stays org/name), not the resolved snapshot.
  sopts.served_model_name = !f.served_model_name.empty() ? f.served_model_name
                            : !f.engine.model_dir.empty() ? f.engine.model_dir
                                                          : opts->shape;
  sopts.model_root = opts->model_dir.empty() ? "shape:" + opts->shape : opts->model_dir;
  sopts.model_identity = identity;
  sopts.access_log = f.access_log;
  sopts.log_stats_interval_s = f.disable_log_stats ? 0.0 : f.log_stats_interval;
  Server server(e, scheduler, sopts, std::move(tokenizer), std::move(chat_template), template_error);
  if (Status st = server.Bind(); !st.ok()) return ReportError(st);

  std::atomic<bool> finished{false};
  std::mutex done_mu;
  std::condition_variable done_cv;
  std::thread signal_thread([&] {
    timespec ts{0, 200'000'000};
    while (!finished.load()) {
      const int sig = sigtimedwait(&sigs, nullptr, &ts);
      if (sig == SIGINT || sig == SIGTERM) {
        spdlog::info("decodelab serve: {} received, stopping (in-flight requests end with an "
                     "error)", sig == SIGINT ? "SIGINT" : "SIGTERM");
        server.Stop();
        // The stop is bounded by design; should anything still hold the process (a handler stuck
        // in a native call), exit anyway rather than ignore the signal.
        std::unique_lock lock(done_mu);
        if (!done_cv.wait_for(lock, std::chrono::duration<double>(f.shutdown_timeout_s),
                              [&] { return finished.load(); })) {
          std::fprintf(stderr, "decodelab serve: still not stopped after %.0f s: exiting now\n",
                       f.shutdown_timeout_s);
          std::fflush(stderr);
          std::_Exit(1);
        }
        return;
      }
    }
  });
  std::printf("decodelab serve: model %s on %s, max batch %d%s, ready at %s\n",
              sopts.served_model_name.c_str(), e.runner->backend_name().c_str(), so.max_batch,
              so.enable_prefix_caching ? ", prefix caching on" : "", server.url().c_str());
  std::fflush(stdout);
  Status st = server.Run();
  server.Stop();
  {
    std::lock_guard lock(done_mu);
    finished.store(true);
  }
  done_cv.notify_all();
  signal_thread.join();
  if (!st.ok()) return ReportError(st);
  spdlog::info("decodelab serve: stopped");
  return 0;
}

}  // namespace

void AddServeCommand(CLI::App& root, CommandContext& ctx) {
  auto flags = std::make_shared<ServeFlags>();
  CLI::App* cmd = root.add_subcommand(
      "serve",
      "OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, "
      "/metrics, /v1/decodelab/state");
  flags->engine.Add(cmd);
  flags->spec.Add(cmd);
  cmd->add_option("--host", flags->host, "Address to bind (loopback by default)")
      ->default_val("127.0.0.1");
  cmd->add_option("--port", flags->port, "TCP port (0 = any free port; the URL is printed)")
      ->default_val(8000)
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", flags->api_key,
                  "Require 'Authorization: Bearer KEY' on /v1/* (health and metrics stay open); "
                  "visible in `ps`: prefer --api-key-file or $DECODELAB_API_KEY");
  cmd->add_option("--api-key-file", flags->api_key_file,
                  "Read the API key from this file (one line)");
  cmd->add_option("--max-batch", flags->max_batch,
                  "Sequences decoded together (continuous batching); the rest wait")
      ->default_val(8)
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-num-batched-tokens", flags->max_num_batched_tokens,
                  "Token rows per forward: decode rows first, then prefill chunks (default max(prefill "
                  "chunk, max batch))");
  cmd->add_option("--max-waiting", flags->max_waiting,
                  "Queued requests beyond which new ones get HTTP 503")
      ->default_val(1024);
  cmd->add_flag("--enable-prefix-caching", flags->prefix_caching,
                "Reuse KV pages of shared prompt prefixes (off by default: the lab requires "
                "cached_tokens == 0)");
  cmd->add_option("--max-body-bytes", flags->max_body_bytes,
                  "Largest request body accepted (larger: HTTP 413)")
      ->default_val(16u << 20);
  cmd->add_option("--served-model-name", flags->served_model_name,
                  "Model id in /v1/models and responses (default: the --model path or shape)");
  cmd->add_option("--http-threads", flags->http_threads,
                  "HTTP worker threads; each open connection holds one")
      ->default_val(160)
      ->check(CLI::Range(4, 4096));
  cmd->add_option("--max-connections", flags->max_connections,
                  "Connections served at once (0 = --http-threads); more get HTTP 503 at once")
      ->default_val(0)
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--request-header-timeout", flags->header_timeout_s,
                  "Seconds a request line and its headers may take to arrive (HTTP 408)")
      ->default_val(10)
      ->check(CLI::Range(0.1, 3600.0));
  cmd->add_option("--request-body-timeout", flags->body_timeout_s,
                  "Seconds a request body may take to arrive after its headers (HTTP 408)")
      ->default_val(60)
      ->check(CLI::Range(0.1, 3600.0));
  cmd->add_option("--shutdown-timeout", flags->shutdown_timeout_s,
                  "After SIGINT/SIGTERM, exit at the latest after this many seconds")
      ->default_val(10)
      ->check(CLI::Range(1.0, 3600.0));
  cmd->add_option("--chat-template", flags->chat_template,
                  "Jinja chat template file used instead of the model's own")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--access-log", flags->access_log,
                "Log one line per request: client, method, route, status, prompt and completion "
                "tokens, latency");
  cmd->add_option("--log-stats-interval", flags->log_stats_interval,
                  "Seconds between vLLM-style throughput lines (prompt and generation tokens/s, "
                  "running and waiting requests, KV cache usage) while requests run")
      ->default_val(10)
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--disable-log-stats", flags->disable_log_stats,
                "No periodic throughput lines (vLLM's flag)");
  cmd->callback([flags, &ctx] { ctx.exit_code = RunServe(*flags); });
}

}  // namespace dl::app
