#include "server/server.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>

#include <httplib.h>
#include <sys/socket.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "base/sha256.h"
#include "server/api.h"
#include "server/http_guard.h"
#include "server/stats_log.h"
#include "server/unique_id.h"

namespace dl {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// JSON text for the wire. Strings that are not valid UTF-8 (a request path, a token's bytes, a
// message quoting input) get U+FFFD instead of making dump() throw.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void SendJson(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(Dump(body), "application/json");
}

void SendError(httplib::Response& res, const api::ApiError& e) {
  SendJson(res, e.http_status, api::ErrorBody(e));
}

std::string Sse(const json& j) { return "data: " + Dump(j) + "\n\n"; }

// How a stream ends on an error once 200 is sent: an in-band error event (vLLM's form, with the
// HTTP status as its code), then the terminator.
std::string SseErrorTail(const api::ApiError& e) {
  json body = api::ErrorBody(e);
  body["error"]["code"] = e.http_status;
  return Sse(body) + "data: [DONE]\n\n";
}

// 413 for a body of `bytes` over --max-body-bytes (announced by Content-Length or read whole).
api::ApiError BodyTooLarge(uint64_t bytes, size_t limit) {
  api::ApiError e;
  e.http_status = 413;
  e.message = fmt::format("the request body ({} bytes) is larger than the server's limit of {} "
                          "bytes (--max-body-bytes)",
                          bytes, limit);
  e.code = "request_too_large";
  return e;
}

// 404 for a request naming a model this server does not serve.
api::ApiError ModelNotFound(const std::string& requested, const std::string& served) {
  api::ApiError e;
  e.http_status = 404;
  e.message =
      fmt::format("The model `{}` does not exist; this server serves `{}`.", requested, served);
  e.param = "model";
  e.code = "model_not_found";
  return e;
}

// Fields a request carried that this server does not know: accepted with a warning, vLLM's
// behaviour (docs/api.md).
void WarnIgnoredFields(const std::string& path, const std::vector<std::string>& fields) {
  if (fields.empty()) return;
  spdlog::warn("{}: the following fields were present in the request but ignored: {}", path,
               fmt::join(fields, ", "));
}

// The OpenAI envelope for whatever escaped a route: an exception must never leave a handler.
void SendUnexpected(httplib::Response& res, std::exception_ptr ep) {
  std::string what = "unknown exception";
  try {
    if (ep) std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  try {
    res.headers.erase("Content-Type");
    SendError(res, api::FromStatus(Internal("internal error: {}", what)));
  } catch (...) {
    res.status = 500;
    res.body.clear();
  }
}

// One catch-all per route.
httplib::Server::Handler Guarded(httplib::Server::Handler h) {
  return [h = std::move(h)](const httplib::Request& req, httplib::Response& res) {
    try {
      h(req, res);
    } catch (...) {
      SendUnexpected(res, std::current_exception());
    }
  };
}

http::Limits LimitsOf(const ServerOptions& o) {
  http::Limits l;
  const int threads = std::max(4, o.http_threads);
  l.max_connections = o.max_connections > 0 ? std::min(o.max_connections, threads) : threads;
  l.max_body_bytes = o.max_body_bytes;
  l.max_header_bytes = o.max_header_bytes;
  l.max_header_count = o.max_header_count;
  l.header_timeout_s = o.header_timeout_s;
  l.body_timeout_s = o.body_timeout_s;
  l.keep_alive_timeout_s = 2;
  l.write_timeout_s = 30;
  return l;
}

// What the access log needs of the request a worker thread is serving: set by the pre-routing
// handler and the generation routes, read by httplib's logger on the same thread after the
// response (streams included) is written.
struct AccessState {
  std::optional<Clock::time_point> start;
  int64_t prompt_tokens = -1;
  int64_t completion_tokens = -1;
};
thread_local AccessState t_access;

// Everything one generation request needs while its tokens come back, shared between the handler
// and (for streams) the content provider, which outlives the handler call.
struct Job {
  api::ParsedRequest req;
  std::vector<std::shared_ptr<RequestState>> states;
  std::vector<api::ChoiceText> texts;
  std::vector<std::vector<TokenEvent>> events;  // per choice, for non-streaming output
  std::vector<int32_t> counts;                  // tokens consumed per choice
  std::vector<std::string> finish;              // "" while running
  std::vector<size_t> text_offsets;
  std::vector<int32_t> cached;                  // per choice
  std::vector<int32_t> prompt_tokens;
  std::vector<int64_t> stop_ids;                // ids that end a sequence (eos unless ignored, stop ids)
  std::vector<api::ChatOutput> chat_out;        // chat: reasoning / content / tool calls per choice
  std::string id;
  std::string model;
  int64_t created = 0;
  const Tokenizer* tokenizer = nullptr;

  void CancelAll() {
    for (auto& s : states) s->Cancel();
  }
  bool IsStopId(int32_t t) const {
    return std::find(stop_ids.begin(), stop_ids.end(), t) != stop_ids.end();
  }
  // What one token of a choice adds to the response: text (completions), or its reasoning,
  // content and finished tool calls (chat).
  struct Piece {
    std::string text;
    api::ChatDelta chat;
  };
  // Feeds one token of choice i and sets finish[i] when it is the last one (max_tokens reached, a
  // stop id, or a stop string; "tool_calls" when a chat choice called tools).
  Piece Consume(size_t i, const TokenEvent& ev) {
    Piece p;
    p.text = ConsumeText(i, ev);
    if (req.chat) {
      p.chat = chat_out[i].Add(p.text);
      if (!finish[i].empty()) {
        p.chat.Append(chat_out[i].Finish());
        if (chat_out[i].tool_calls() > 0) finish[i] = "tool_calls";
      }
    }
    return p;
  }
  std::string ConsumeText(size_t i, const TokenEvent& ev) {
    const bool stop_id = IsStopId(ev.token);
    ++counts[i];
    std::string delta = texts[i].Add(ev.token, stop_id);
    if (texts[i].stopped() || stop_id) {
      finish[i] = "stop";
    } else if (counts[i] >= req.sampling.max_tokens) {
      finish[i] = "length";
    }
    if (!finish[i].empty()) {
      delta += texts[i].Finish();
      // A stop string can still complete in the flushed text.
      if (texts[i].stopped()) finish[i] = "stop";
      states[i]->Cancel();  // no-op when the engine already finished it; frees pages otherwise
    }
    return delta;
  }
};

json ToolCallsJson(const std::vector<api::ToolCall>& calls, int first_index) {
  json out = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    out.push_back({{"index", first_index + static_cast<int>(k)},
                   {"id", calls[k].id},
                   {"type", "function"},
                   {"function", {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}});
  }
  return out;
}

// `piece` is choice i's latest Consume: ChatOutput's count of calls already includes its calls.
json ChunkJson(const Job& job, size_t i, const Job::Piece& piece, const TokenEvent& ev, bool first) {
  const std::string& delta = piece.text;
  json choice = {{"index", i}};
  if (job.req.chat) {
    json d = json::object();
    if (first) d["role"] = "assistant";
    d["content"] = piece.chat.content;
    if (!piece.chat.reasoning.empty()) d["reasoning_content"] = piece.chat.reasoning;
    if (!piece.chat.tool_calls.empty()) {
      // Every earlier call of the choice went out in an earlier chunk.
      const int first_index =
          job.chat_out[i].tool_calls() - static_cast<int>(piece.chat.tool_calls.size());
      d["tool_calls"] = ToolCallsJson(piece.chat.tool_calls, first_index);
    }
    choice["delta"] = d;
    choice["logprobs"] = job.req.logprobs >= 0 ? api::ChatLogprobs(job.tokenizer, {ev}) : json(nullptr);
  } else {
    choice["text"] = delta;
    choice["logprobs"] = job.req.logprobs >= 0
                             ? api::CompletionLogprobs(job.tokenizer, {ev}, job.text_offsets[i])
                             : json(nullptr);
  }
  choice["finish_reason"] = job.finish[i].empty() ? json(nullptr) : json(job.finish[i]);
  choice["token_ids"] = {ev.token};
  json chunk = {{"id", job.id},
                {"object", job.req.chat ? "chat.completion.chunk" : "text_completion"},
                {"created", job.created},
                {"model", job.model},
                {"choices", json::array({choice})}};
  if (job.req.include_usage) chunk["usage"] = nullptr;
  return chunk;
}


json UsageOf(const Job& job) {
  int64_t prompt = 0, completion = 0, cached = 0;
  for (size_t i = 0; i < job.states.size(); ++i) {
    prompt += job.prompt_tokens[i];
    completion += job.counts[i];
    cached += job.cached[i];
  }
  return api::Usage(prompt, completion, cached);
}

// Collects state updates of choice i; returns false with `error` set when the engine ended the
// request early (shutdown, internal error).
bool PollChoice(Job& job, size_t i, std::chrono::milliseconds wait, std::vector<TokenEvent>* out,
                Status* error) {
  RequestState::Update u;
  job.states[i]->Poll(&u, wait);
  job.prompt_tokens[i] = u.prompt_tokens;
  job.cached[i] = u.cached_tokens;
  for (auto& ev : u.tokens) {
    if (!job.finish[i].empty()) break;
    out->push_back(std::move(ev));
    // The caller consumes; we only need to know when the engine gave up early.
  }
  if (u.finished && job.finish[i].empty() &&
      (u.reason == FinishReason::kError || u.reason == FinishReason::kCancelled)) {
    // Tokens in `out` are still delivered; the error comes after them.
    *error = u.error.ok() ? Status(StatusCode::kCancelled, "request cancelled") : u.error;
    return false;
  }
  return true;
}

// The streaming provider runs while cpp-httplib writes the response, outside its try block: an
// exception there would end the process. Anything it throws ends the stream with an error event.
httplib::ContentProviderWithoutLength GuardedStream(std::shared_ptr<Job> job,
                                                    httplib::ContentProviderWithoutLength p) {
  return [job, p = std::move(p)](size_t offset, httplib::DataSink& sink) -> bool {
    try {
      return p(offset, sink);
    } catch (...) {
      job->CancelAll();
      try {
        const std::string tail =
            SseErrorTail(api::FromStatus(Internal("internal error while streaming")));
        if (sink.write(tail.data(), tail.size())) sink.done();
      } catch (...) {
      }
      return false;
    }
  };
}

// A label value in the Prometheus text format: backslash, double quote and newline escaped.
json SpecJson(const SchedulerOptions& o, const SpecStats& st) {
  const bool on = o.drafter != nullptr && o.num_draft_tokens > 0;
  return {{"drafter", on ? o.drafter->name() : "none"},
          {"num_speculative_tokens", on ? o.num_draft_tokens : 0},
          {"num_drafts", st.num_drafts},
          {"num_draft_tokens", st.num_draft_tokens},
          {"num_accepted_tokens", st.num_accepted_tokens},
          {"num_accepted_tokens_per_pos", st.accepted_per_pos},
          {"mean_acceptance_length", st.mean_acceptance_length()},
          {"acceptance_rate", st.acceptance_rate()}};
}

std::string PrometheusLabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// `num_draft_tokens` > 0: speculative decoding is on and its counters are exported (vLLM exports
// them only with a speculative config too).
std::string MetricsText(const SchedulerStats& s, const std::string& model, int32_t num_draft_tokens) {
  std::string out;
  const std::string label = fmt::format("model_name=\"{}\"", PrometheusLabelValue(model));
  auto gauge = [&](const char* name, const char* help, double v) {
    out += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{}{{{}}} {}\n", name, help, name, name, label, v);
  };
  auto counter = [&](const char* name, const char* help, double v) {
    out += fmt::format("# HELP {} {}\n# TYPE {} counter\n{}{{{}}} {}\n", name, help, name, name, label, v);
  };
  auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    uint64_t cum = 0;
    for (size_t b = 0; b < h.bounds.size(); ++b) {
      cum += h.counts[b];
      out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, label, h.bounds[b], cum);
    }
    out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, label, h.count);
    out += fmt::format("{}_sum{{{}}} {}\n{}_count{{{}}} {}\n", name, label, h.sum, name, label, h.count);
  };
  gauge("vllm:num_requests_running", "Number of requests in the running batch.", s.running);
  gauge("vllm:num_requests_waiting", "Number of requests waiting to be admitted.", s.waiting);
  gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage);
  counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
          static_cast<double>(s.prompt_tokens_total));
  counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
          static_cast<double>(s.generation_tokens_total));
  counter("vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.",
          static_cast<double>(s.preemptions_total));
  counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
          static_cast<double>(s.prompt_tokens_total));
  counter("vllm:prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
          static_cast<double>(s.cached_prompt_tokens_total));
  out += "# HELP vllm:request_success_total Count of finished requests by finish reason.\n"
         "# TYPE vllm:request_success_total counter\n";
  for (const char* r : {"stop", "length", "abort", "error"}) {
    auto it = s.finished_total.find(r);
    out += fmt::format("vllm:request_success_total{{{},finished_reason=\"{}\"}} {}\n", label, r,
                       it == s.finished_total.end() ? 0 : it->second);
  }
  histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            s.ttft);
  histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            s.itl);
  histogram("vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.", s.e2e);
  histogram("vllm:request_queue_time_seconds",
            "Histogram of time spent waiting for admission in seconds.", s.queue_time);
  gauge("decodelab:kv_pages_used", "KV pages in use (all groups, prefix cache included).",
        s.kv_pages_used);
  gauge("decodelab:kv_pages_total", "KV pages in the pools (all groups).", s.kv_pages_total);
  gauge("decodelab:prefix_cache_blocks", "Blocks held by the prefix cache.", s.prefix_cache_blocks);
  counter("decodelab:engine_steps_total", "Scheduler steps run.", static_cast<double>(s.steps_total));
  if (num_draft_tokens > 0) {
    // vLLM's names (vllm/v1/spec_decode/metrics.py); a draft is one verify of a sequence with drafts.
    counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.",
            static_cast<double>(s.spec.num_drafts));
    counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
            static_cast<double>(s.spec.num_draft_tokens));
    counter("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
            static_cast<double>(s.spec.num_accepted_tokens));
    out += "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.\n"
           "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n";
    for (int32_t pos = 0; pos < num_draft_tokens; ++pos) {
      const uint64_t v = static_cast<size_t>(pos) < s.spec.accepted_per_pos.size() ? s.spec.accepted_per_pos[pos] : 0;
      out += fmt::format("vllm:spec_decode_num_accepted_tokens_per_pos_total{{{},position=\"{}\"}} {}\n", label, pos, v);
    }
    gauge("decodelab:spec_decode_mean_acceptance_length",
          "Tokens per verify step so far: 1 + accepted / drafts (0 before the first draft).",
          s.spec.mean_acceptance_length());
  }
  return out;
}

}  // namespace

Server::Server(Engine& engine, Scheduler& scheduler, ServerOptions options,
               std::optional<Tokenizer> tokenizer, std::optional<ChatTemplate> chat_template,
               std::string chat_template_error)
    : engine_(engine),
      scheduler_(scheduler),
      options_(std::move(options)),
      tokenizer_(std::move(tokenizer)),
      chat_template_(std::move(chat_template)),
      chat_template_error_(std::move(chat_template_error)),
      http_(std::make_unique<http::GuardedServer>(LimitsOf(options_), &stopping_)) {
  created_ = static_cast<int64_t>(std::time(nullptr));
  auto sha = Sha256OfSelf();
  binary_sha256_ = sha.ok() ? *sha : "unknown (" + sha.status().message() + ")";
  // Not httplib::default_socket_options: it sets SO_REUSEPORT, with which a second server binds a
  // busy port and the kernel splits connections between two models. SO_REUSEADDR alone still lets
  // a restarted server bind while old connections sit in TIME_WAIT.
  // Remember the listening socket: the packaged cpp-httplib listens with a backlog of 5, which
  // drops connections when many clients connect at once; Bind raises it.
  http_->set_socket_options([this](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd_.store(static_cast<int>(sock));
  });
  Routes();
}

Server::~Server() { Stop(); }

std::string Server::url() const { return fmt::format("http://{}:{}", options_.host, port_); }

Status Server::Bind() {
  if (options_.port == 0) {
    port_ = http_->bind_to_any_port(options_.host);
    if (port_ <= 0) return Unavailable("cannot bind an ephemeral port on {}", options_.host);
  } else {
    errno = 0;
    if (!http_->bind_to_port(options_.host, options_.port)) {
      const int err = errno;
      return Unavailable("cannot listen on {}:{}: {}", options_.host, options_.port,
                         err == EADDRINUSE ? "the address is already in use (another server?)"
                         : err != 0        ? std::strerror(err)
                                           : "not an address of this machine");
    }
    port_ = options_.port;
  }
  // listen() again on a listening socket only changes its backlog (Linux).
  if (listen_fd_.load() >= 0) (void)::listen(listen_fd_.load(), 4096);
  return Status::Ok();
}

void Server::LogStatsLoop() {
  const auto interval = std::chrono::duration<double>(options_.log_stats_interval_s);
  const std::string kv_label = engine_.runner->backend_name() == "cpu-reference" ? "KV cache" : "GPU KV cache";
  SchedulerStats before = scheduler_.Stats();
  auto t0 = Clock::now();
  bool was_active = false;
  std::unique_lock lock(stats_mu_);
  while (!stats_cv_.wait_for(lock, interval, [this] { return stats_stop_; })) {
    const SchedulerStats now = scheduler_.Stats();
    const auto t1 = Clock::now();
    const bool active = IntervalHadActivity(before, now);
    // Like vLLM: a line while anything happens, and one more when it stops.
    if (active || was_active) {
      spdlog::info("{}", ThroughputLine(before, now, std::chrono::duration<double>(t1 - t0).count(),
                                        kv_label));
    }
    was_active = active;
    before = now;
    t0 = t1;
  }
}

Status Server::Run() {
  if (port_ == 0) DL_RETURN_IF_ERROR(Bind());
  if (options_.log_stats_interval_s > 0 && !stats_thread_.joinable()) {
    stats_thread_ = std::thread([this] { LogStatsLoop(); });
  }
  if (!http_->listen_after_bind() && !stopping_.load()) {
    return Internal("the HTTP listener on {} stopped unexpectedly", url());
  }
  return Status::Ok();
}

void Server::Stop() {
  if (stopping_.exchange(true)) return;
  // Ends every request first, so each stream writes its error event and [DONE] and returns.
  scheduler_.Stop();
  http_->stop();
  {
    std::lock_guard lock(stats_mu_);
    stats_stop_ = true;
  }
  stats_cv_.notify_all();
  if (stats_thread_.joinable() && stats_thread_.get_id() != std::this_thread::get_id()) {
    stats_thread_.join();
  }
}

std::optional<api::ApiError> Server::BodyError(const std::string& body) const {
  // The decoded size (a chunked body has no Content-Length to check up front) and the nesting depth:
  // parsing, copying and converting request JSON all recurse over it.
  if (body.size() > options_.max_body_bytes) {
    return BodyTooLarge(body.size(), options_.max_body_bytes);
  }
  if (http::JsonNestingExceeds(body, options_.max_json_depth)) {
    return api::BadRequest(
        fmt::format("the request body nests arrays and objects deeper than {} levels", options_.max_json_depth));
  }
  return std::nullopt;
}

api::ParseContext Server::Context() const {
  api::ParseContext ctx;
  ctx.tokenizer = tokenizer_ ? &*tokenizer_ : nullptr;
  ctx.chat_template = chat_template_ ? &*chat_template_ : nullptr;
  ctx.no_template_reason = chat_template_error_;
  ctx.max_context = scheduler_.max_context();
  ctx.vocab_size = engine_.config().vocab_size;
  // Fields a request leaves out take the model's generation_config.json values (vLLM's default).
  const GenerationConfig& g = engine_.config().generation;
  ctx.defaults = {.temperature = g.temperature,
                  .top_p = g.top_p,
                  .min_p = g.min_p,
                  .repetition_penalty = g.repetition_penalty,
                  .top_k = g.top_k,
                  .max_tokens = g.max_new_tokens};
  return ctx;
}

void Server::Routes() {
  httplib::Server& svr = *http_;
  const std::string model_name = options_.served_model_name;

  svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    AccessState a = t_access;
    t_access = {};
    if (!options_.access_log) return;
    AccessRecord r;
    r.remote = fmt::format("{}:{}", req.remote_addr, req.remote_port);
    r.method = req.method;
    r.path = req.path;
    r.status = res.status;
    r.prompt_tokens = a.prompt_tokens;
    r.completion_tokens = a.completion_tokens;
    r.seconds = a.start ? std::chrono::duration<double>(Clock::now() - *a.start).count() : 0.0;
    spdlog::info("{}", AccessLine(r));
  });

  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    // Before any body is read: cpp-httplib 0.11 would inflate a compressed body without a bound
    // and read a too-long one to its end.
    const std::string encoding = req.get_header_value("Content-Encoding");
    if (!encoding.empty() && encoding != "identity") {
      api::ApiError e;
      e.http_status = 415;
      e.message = "compressed request bodies are not accepted (Content-Encoding: " + encoding +
                  "); send the body uncompressed";
      e.code = "unsupported_content_encoding";
      http::CloseCurrentConnectionAfterResponse();
      res.set_header("Connection", "close");
      SendError(res, e);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.has_header("Content-Length")) {
      const std::string len = req.get_header_value("Content-Length");
      uint64_t n = 0;
      const bool numeric = !len.empty() && len.size() <= 19 &&
                           std::all_of(len.begin(), len.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (numeric) n = std::stoull(len);
      if (!numeric || n > options_.max_body_bytes) {
        api::ApiError e = numeric ? BodyTooLarge(n, options_.max_body_bytes)
                                  : api::BadRequest("Content-Length is not a number");
        if (!numeric) e.code = "bad_request";
        http::CloseCurrentConnectionAfterResponse();
        res.set_header("Connection", "close");
        SendError(res, e);
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    t_access = {Clock::now(), -1, -1};
    // Health and metrics stay open, as in vLLM; the model's routes need the key.
    if (req.path.rfind("/v1/", 0) != 0 && req.path != "/tokenize" && req.path != "/detokenize") {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    if (!options_.api_key.empty()) {
      const std::string auth = req.get_header_value("Authorization");
      if (auth != "Bearer " + options_.api_key) {
        api::ApiError e;
        e.http_status = 401;
        e.message = auth.empty() ? "missing API key: send Authorization: Bearer <key>"
                                 : "incorrect API key provided";
        e.code = "invalid_api_key";
        SendError(res, e);
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (stopping_.load()) {
      SendError(res, api::FromStatus(Unavailable("the server is shutting down")));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  // cpp-httplib 0.11 calls the error handler outside its try block: nothing may escape it.
  svr.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // our own error bodies
    try {
      api::ApiError e;
      e.http_status = res.status;
      if (res.status == 404) {
        e.message = fmt::format("no route {} {}", req.method, req.path);
        e.code = "not_found";
      } else if (res.status == 413) {
        e.message = "the request body is larger than the server's limit (--max-body-bytes)";
        e.code = "request_too_large";
      } else {
        e.message = fmt::format("HTTP {}", res.status);
        if (res.status >= 500) e.type = "server_error";
      }
      SendError(res, e);
    } catch (...) {
      res.body.clear();
    }
  });

  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    SendUnexpected(res, ep);
  });

  svr.Get("/health", Guarded([this](const httplib::Request&, httplib::Response& res) {
    res.status = stopping_.load() ? 503 : 200;
  }));

  svr.Get("/metrics", Guarded([this, model_name](const httplib::Request&, httplib::Response& res) {
    res.set_content(MetricsText(scheduler_.Stats(), model_name, scheduler_.options().num_draft_tokens), "text/plain; version=0.0.4");
  }));

  svr.Get("/v1/models", Guarded([this, model_name](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", model_name},
              {"object", "model"},
              {"created", created_},
              {"owned_by", "decodelab"},
              {"root", options_.model_root},
              {"parent", nullptr},
              {"max_model_len", scheduler_.max_context()},
              {"permission", json::array()}};
    SendJson(res, 200, {{"object", "list"}, {"data", json::array({m})}});
  }));

  svr.Get("/v1/decodelab/state", Guarded([this, model_name](const httplib::Request&, httplib::Response& res) {
    const json d = engine_.runner->Describe();
    const auto stats = scheduler_.Stats();
    json scales = engine_.runner->kv_scales().ToJson();
    scales["rank"] = 0;
    // Tensor parallelism: every rank's own scales (the lab's scale audit compares each).
    json scales_by_rank = json::array({scales});
    int world_size = 1;
    if (d.contains("tensor_parallel")) {
      world_size = d["tensor_parallel"].value("size", 1);
      scales_by_rank = json::array();
      for (const auto& r : d["tensor_parallel"]["ranks"]) {
        json s = r["kv_scales"];
        s["rank"] = r["rank"];
        scales_by_rank.push_back(s);
      }
    }
    json topology = d.contains("topology") ? d["topology"] : json("not applicable");
    json state = {
        {"engine", "decodelab"},
        {"version", "0.1.0"},
        {"binary_sha256", binary_sha256_},
        {"model", model_name},
        {"model_identity", options_.model_identity},
        {"vocab_size", engine_.config().vocab_size},
        {"backend", engine_.runner->backend_name()},
        {"backend_choice_reason", engine_.backend_choice_reason},
        {"kernel_presets", d.value("kernel_presets", json("cpu-reference"))},
        {"fallback", d.value("fallback", false)},
        {"fallback_ops", d.value("fallback_ops", json::array())},
        {"kv_dtype", d.value("kv_dtype", json(nullptr))},
        {"page_size", engine_.kv->spec().page_size},
        {"kv_scales", scales_by_rank},
        {"topology", topology},
        {"topology_applicable", topology.is_array()},
        {"world_size", world_size},
        {"tensor_parallel", d.value("tensor_parallel", json(nullptr))},
        {"scheduler",
         {{"max_batch", scheduler_.options().max_batch},
          {"max_waiting", scheduler_.options().max_waiting},
          {"prefill_chunk", scheduler_.options().prefill_chunk},
          {"max_num_batched_tokens", scheduler_.options().max_tokens_per_step},
          {"max_model_len", scheduler_.max_context()},
          {"prefix_caching", scheduler_.options().enable_prefix_caching}}},
        {"kv_pages", {{"used", stats.kv_pages_used}, {"total", stats.kv_pages_total},
                      {"prefix_cache", scheduler_.prefix_cache_pages()}}},
        {"requests", {{"running", stats.running}, {"waiting", stats.waiting}}},
        {"speculative", SpecJson(scheduler_.options(), stats.spec)},
        {"runner", d},
    };
    SendJson(res, 200, state);
  }));

  // vLLM's tokenizer routes.
  auto tokens_route = [this, model_name](bool tokenize) {
    return [this, model_name, tokenize](const httplib::Request& req, httplib::Response& res) {
      if (auto e = BodyError(req.body)) return SendError(res, *e);
      // Parsed once: an unparsable body is a 400 before any model check, as it always was.
      nlohmann::ordered_json body;
      if (auto e = api::ParseBody(req.body, &body)) return SendError(res, *e);
      const std::string requested = api::RequestedModel(body);
      if (!requested.empty() && requested != model_name) {
        return SendError(res, ModelNotFound(requested, model_name));
      }
      json out;
      std::vector<std::string> ignored;
      const api::ParseContext ctx = Context();
      auto e = tokenize ? api::Tokenize(body, ctx, &out, &ignored)
                        : api::Detokenize(body, ctx, &out, &ignored);
      WarnIgnoredFields(req.path, ignored);
      if (e) return SendError(res, *e);
      SendJson(res, 200, out);
    };
  };
  svr.Post("/tokenize", Guarded(tokens_route(true)));
  svr.Post("/detokenize", Guarded(tokens_route(false)));

  auto generate = [this, model_name](bool chat) {
    return [this, model_name, chat](const httplib::Request& req, httplib::Response& res) {
      if (auto e = BodyError(req.body)) return SendError(res, *e);
      const api::ParseContext ctx = Context();
      auto job = std::make_shared<Job>();
      if (auto e = api::ParseRequest(req.body, chat, ctx, &job->req)) return SendError(res, *e);
      WarnIgnoredFields(req.path, job->req.ignored_fields);
      if (!job->req.model.empty() && job->req.model != model_name) {
        return SendError(res, ModelNotFound(job->req.model, model_name));
      }
      job->id = api::UniqueId(chat ? "chatcmpl" : "cmpl");
      job->model = model_name;
      job->created = static_cast<int64_t>(std::time(nullptr));
      job->tokenizer = ctx.tokenizer;
      const SamplingParams& sp = job->req.sampling;
      if (!sp.ignore_eos) {
        for (int64_t id : engine_.config().eos_token_ids) job->stop_ids.push_back(id);
      }
      for (int32_t id : sp.stop_token_ids) job->stop_ids.push_back(id);
      const size_t n = job->req.prompts.size();
      for (size_t i = 0; i < n; ++i) {
        GenerationRequest g;
        g.prompt = job->req.prompts[i];
        g.sampling = sp;
        auto st = scheduler_.Submit(std::move(g));
        if (!st.ok()) {
          job->CancelAll();
          return SendError(res, api::FromStatus(st.status(), chat ? "messages" : "prompt"));
        }
        job->states.push_back(*st);
        const bool parse = job->req.parse_reasoning || job->req.parse_tool_calls;
        job->texts.emplace_back(ctx.tokenizer, job->req.stop_strings,
                                parse && ctx.tokenizer ? api::ChatMarkerIds(*ctx.tokenizer)
                                                       : std::vector<int32_t>{});
        if (chat) job->chat_out.emplace_back(job->req);
      }
      job->events.resize(n);
      job->counts.assign(n, 0);
      job->finish.assign(n, "");
      job->text_offsets.assign(n, 0);
      job->cached.assign(n, 0);
      job->prompt_tokens.assign(n, 0);
      for (size_t i = 0; i < n; ++i) job->prompt_tokens[i] = static_cast<int32_t>(job->req.prompts[i].size());

      if (!job->req.stream) {
        std::vector<std::string> text(n);
        std::vector<api::ChatDelta> message(n);
        for (size_t i = 0; i < n; ++i) {
          while (job->finish[i].empty()) {
            std::vector<TokenEvent> evs;
            Status error;
            const bool ok = PollChoice(*job, i, std::chrono::milliseconds(200), &evs, &error);
            for (auto& ev : evs) {
              if (!job->finish[i].empty()) break;
              Job::Piece p = job->Consume(i, ev);
              text[i] += p.text;
              message[i].Append(std::move(p.chat));
              job->events[i].push_back(std::move(ev));
            }
            if (!ok && job->finish[i].empty()) {
              job->CancelAll();
              return SendError(res, api::FromStatus(error));
            }
            // Nobody will read the answer: free the batch slot and the KV pages now, as a
            // vanished stream does.
            if (job->finish[i].empty() && http::CurrentClientGone()) {
              job->CancelAll();
              res.status = 499;
              return;
            }
          }
        }
        json choices = json::array();
        for (size_t i = 0; i < n; ++i) {
          std::vector<int32_t> ids;
          for (const auto& e : job->events[i]) ids.push_back(e.token);
          json c = {{"index", i}};
          if (chat) {
            const api::ChatDelta& m = message[i];
            json msg = {{"role", "assistant"}, {"content", m.content}};
            // OpenAI's shape: content is null beside tool calls when the model wrote none.
            if (!m.tool_calls.empty() &&
                m.content.find_first_not_of(" \t\r\n") == std::string::npos) {
              msg["content"] = nullptr;
            }
            if (job->req.parse_reasoning && job->req.include_reasoning) {
              msg["reasoning_content"] = m.reasoning.empty() ? json(nullptr) : json(m.reasoning);
            }
            if (!m.tool_calls.empty()) msg["tool_calls"] = ToolCallsJson(m.tool_calls, 0);
            c["message"] = msg;
            c["logprobs"] = job->req.logprobs >= 0 ? api::ChatLogprobs(job->tokenizer, job->events[i])
                                                   : json(nullptr);
          } else {
            c["text"] = text[i];
            c["logprobs"] = job->req.logprobs >= 0
                                ? api::CompletionLogprobs(job->tokenizer, job->events[i], 0)
                                : json(nullptr);
          }
          c["finish_reason"] = job->finish[i];
          c["token_ids"] = ids;
          choices.push_back(c);
        }
        json body = {{"id", job->id},
                     {"object", chat ? "chat.completion" : "text_completion"},
                     {"created", job->created},
                     {"model", job->model},
                     {"choices", choices},
                     {"usage", UsageOf(*job)}};
        t_access.prompt_tokens = body["usage"]["prompt_tokens"];
        t_access.completion_tokens = body["usage"]["completion_tokens"];
        return SendJson(res, 200, body);
      }

      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      const bool access_log = options_.access_log;
      res.set_chunked_content_provider(
          "text/event-stream",
          GuardedStream(job, [job, access_log](size_t, httplib::DataSink& sink) -> bool {
            auto last_write = Clock::now();
            // The worker thread writing this stream is the one httplib's logger runs on next; only
            // the access log reads the counts.
            auto count_tokens = [&] {
              if (!access_log) return;
              const json usage = UsageOf(*job);
              t_access.prompt_tokens = usage["prompt_tokens"];
              t_access.completion_tokens = usage["completion_tokens"];
            };
            auto write = [&](const std::string& s) {
              if (!sink.write(s.data(), s.size())) {
                job->CancelAll();  // client gone: the engine returns the pages
                return false;
              }
              last_write = Clock::now();
              return true;
            };
            const size_t n = job->states.size();
            std::vector<bool> first(n, true);
            const auto wait = std::chrono::milliseconds(n == 1 ? 100 : 5);
            while (true) {
              bool all_done = true;
              for (size_t i = 0; i < n; ++i) {
                if (!job->finish[i].empty()) continue;
                all_done = false;
                std::vector<TokenEvent> evs;
                Status error;
                const bool ok = PollChoice(*job, i, wait, &evs, &error);
                for (auto& ev : evs) {
                  if (!job->finish[i].empty()) break;
                  const Job::Piece piece = job->Consume(i, ev);
                  if (!write(Sse(ChunkJson(*job, i, piece, ev, first[i])))) return false;
                  job->text_offsets[i] += piece.text.size();
                  first[i] = false;
                }
                if (!ok && job->finish[i].empty()) {
                  job->CancelAll();
                  write(SseErrorTail(api::FromStatus(error)));
                  count_tokens();
                  sink.done();
                  return true;
                }
              }
              if (all_done) break;
              // A comment line now and then: detects a vanished client while the request waits.
              if (Clock::now() - last_write > std::chrono::seconds(2) && !write(": keep-alive\n\n")) {
                return false;
              }
            }
            if (job->req.include_usage) {
              json chunk = {{"id", job->id},
                            {"object", job->req.chat ? "chat.completion.chunk" : "text_completion"},
                            {"created", job->created},
                            {"model", job->model},
                            {"choices", json::array()},
                            {"usage", UsageOf(*job)}};
              if (!write(Sse(chunk))) return false;
            }
            if (!write("data: [DONE]\n\n")) return false;
            count_tokens();
            sink.done();
            return true;
          }),
          [job](bool) { job->CancelAll(); });
    };
  };
  svr.Post("/v1/completions", Guarded(generate(false)));
  svr.Post("/v1/chat/completions", Guarded(generate(true)));
}

}  // namespace dl
