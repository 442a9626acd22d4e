#include "lab/serve_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include <httplib.h>

#include "base/rng.h"
#include "lab/lab_spec.h"
#include "lab/lab_stats.h"

namespace dl::lab {

using nlohmann::json;

namespace {

struct RequestRecord {
  bool ok = false;
  std::string error;
  int input_len = 0;
  int output_tokens = 0;  // usage.completion_tokens when reported, else the token events counted
  int prompt_tokens = -1;  // usage.prompt_tokens when reported
  double ttft = 0, e2el = 0;
  std::vector<double> itl;
};

// One streamed completion: chunk arrival times from the send. Counts tokens from decodelab's
// token_ids, else one per chunk with text; usage (stream_options.include_usage) has the last word.
RequestRecord StreamOne(const Endpoint& ep, const json& body, double timeout_s) {
  RequestRecord rec;
  httplib::Client cli(ep.host, ep.port);
  cli.set_read_timeout(static_cast<time_t>(timeout_s), 0);
  cli.set_write_timeout(60, 0);
  cli.set_connection_timeout(10, 0);
  std::string buffer, status_body;
  int status = 0;
  std::vector<double> chunks;
  int counted = 0, usage_tokens = -1;
  bool done = false;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    const double now = MonotonicSeconds();
    if (status != 200) {
      status_body.append(data, std::min<size_t>(len, 4096));
      return true;
    }
    buffer.append(data, len);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        done = true;
        continue;
      }
      json j = json::parse(payload, nullptr, false);
      if (j.is_discarded()) {
        rec.error = "unparsable SSE event";
        continue;
      }
      if (j.contains("error")) rec.error = j["error"].dump().substr(0, 300);
      if (j.contains("usage") && j["usage"].is_object() && j["usage"].contains("completion_tokens")) {
        usage_tokens = j["usage"]["completion_tokens"].get<int>();
        if (j["usage"].contains("prompt_tokens") && j["usage"]["prompt_tokens"].is_number_integer()) {
          rec.prompt_tokens = j["usage"]["prompt_tokens"].get<int>();
        }
      }
      if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) continue;
      const json& c = j["choices"][0];
      int n = 0;
      if (c.contains("token_ids") && c["token_ids"].is_array()) {
        n = static_cast<int>(c["token_ids"].size());
      } else if (c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty()) {
        n = 1;
      }
      if (n > 0) {
        chunks.push_back(now);
        counted += n;
      }
    }
    return true;
  };
  const double sent = MonotonicSeconds();
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  if (!cli.send(req, res, err)) {
    rec.error = fmt::format("request failed: {}", httplib::to_string(err));
    return rec;
  }
  if (status != 200) {
    rec.error = fmt::format("HTTP {}: {}", status, status_body.substr(0, 300));
    return rec;
  }
  if (!rec.error.empty()) return rec;
  if (!done || chunks.empty()) {
    rec.error = chunks.empty() ? "no tokens streamed" : "stream ended without [DONE]";
    return rec;
  }
  rec.ok = true;
  rec.output_tokens = usage_tokens >= 0 ? usage_tokens : counted;
  rec.ttft = chunks.front() - sent;
  rec.e2el = chunks.back() - sent;
  for (size_t i = 1; i < chunks.size(); ++i) rec.itl.push_back(chunks[i] - chunks[i - 1]);
  return rec;
}

Result<json> GetJson(const Endpoint& ep, const char* path) {
  httplib::Client cli(ep.host, ep.port);
  cli.set_connection_timeout(10, 0);
  cli.set_read_timeout(30, 0);
  auto res = cli.Get(path);
  if (!res) return Unavailable("http://{}:{}{}: {}", ep.host, ep.port, path, httplib::to_string(res.error()));
  if (res->status != 200) return NotFound("http://{}:{}{}: HTTP {}", ep.host, ep.port, path, res->status);
  json j = json::parse(res->body, nullptr, false);
  if (j.is_discarded()) return DataLoss("http://{}:{}{}: not JSON", ep.host, ep.port, path);
  return j;
}

// The spec-decode counters now; `present` false when the server has no /metrics or exports none.
SpecCounters SpecSnapshot(const Endpoint& ep) {
  httplib::Client cli(ep.host, ep.port);
  cli.set_connection_timeout(10, 0);
  cli.set_read_timeout(30, 0);
  auto res = cli.Get("/metrics");
  if (!res || res->status != 200) return {};
  return ParseSpecCounters(res->body);
}

// vLLM's statistics of a list of seconds, in milliseconds: mean, median, std, p99 (and p90, p95).
void AddStats(json* out, const std::string& name, const std::vector<double>& seconds) {
  std::vector<double> ms;
  for (double s : seconds) ms.push_back(s * 1e3);
  const double mean = Mean(ms);
  double var = 0;
  for (double v : ms) var += (v - mean) * (v - mean);
  (*out)["mean_" + name + "_ms"] = mean;
  (*out)["median_" + name + "_ms"] = Median(ms);
  (*out)["std_" + name + "_ms"] = ms.empty() ? 0.0 : std::sqrt(var / ms.size());
  for (int p : {90, 95, 99}) (*out)[fmt::format("p{}_{}_ms", p, name)] = Percentile(ms, p);
}

}  // namespace

Result<json> RunServeBench(const Endpoint& ep, const ServeBenchOptions& o,
                           const std::function<void(const std::string&)>& progress) {
  if (o.input_len < 1 || o.output_len < 1 || o.num_prompts < 1 || o.concurrency < 0 || !(o.request_rate > 0)) {
    return InvalidArgument("bench serve: --input-len, --output-len, --num-prompts >= 1, --concurrency >= 0 and "
                           "--request-rate > 0 please");
  }
  std::string model = o.model;
  if (model.empty()) {
    DL_ASSIGN_OR_RETURN(json models, GetJson(ep, "/v1/models"));
    if (!models.contains("data") || !models["data"].is_array() || models["data"].empty() ||
        !models["data"][0].contains("id")) {
      return DataLoss("bench serve: /v1/models lists no model; pass --model-name");
    }
    model = models["data"][0]["id"].get<std::string>();
  }
  int64_t vocab = o.vocab_size;
  if (vocab <= 0 && o.prompt_text.empty()) {
    auto state = GetJson(ep, "/v1/decodelab/state");
    if (state.ok() && state->contains("vocab_size") && (*state)["vocab_size"].is_number_integer()) {
      vocab = (*state)["vocab_size"].get<int64_t>();
    }
    if (vocab <= 0) {
      return FailedPrecondition("bench serve: the server does not report its vocabulary size (not decodelab?): "
                                "pass --vocab-size");
    }
  }
  // Prompts and arrival times, both from the seed alone.
  std::vector<std::vector<int32_t>> prompts(o.prompt_text.empty() ? o.num_prompts : 0);
  const uint64_t key = StreamKey(o.seed, "decodelab-bench-serve-prompts-v1");
  for (int i = 0; i < static_cast<int>(prompts.size()); ++i) {
    prompts[i].resize(o.input_len);
    for (int j = 0; j < o.input_len; ++j) {
      prompts[i][j] = static_cast<int32_t>(SplitMix64(key ^ SplitMix64(static_cast<uint64_t>(i) * o.input_len + j)) %
                                           static_cast<uint64_t>(vocab));
    }
  }
  std::vector<double> arrival(o.num_prompts, 0.0);
  if (std::isfinite(o.request_rate)) {
    std::mt19937_64 rng(o.seed);
    std::exponential_distribution<double> gap(o.request_rate);
    double t = 0;
    for (double& a : arrival) a = (t += gap(rng));
  }
  const int workers = o.concurrency > 0 ? std::min(o.concurrency, o.num_prompts) : o.num_prompts;
  std::vector<RequestRecord> records(o.num_prompts);
  std::atomic<int> next{0}, finished{0};
  std::mutex progress_mu;
  const SpecCounters spec_before = SpecSnapshot(ep);
  const double start = MonotonicSeconds();
  auto work = [&] {
    while (true) {
      const int i = next.fetch_add(1);
      if (i >= o.num_prompts) return;
      const double wait = start + arrival[i] - MonotonicSeconds();
      if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      json body = {{"model", model},
                   {"prompt", o.prompt_text.empty() ? json(prompts[i]) : json(o.prompt_text)},
                   {"max_tokens", o.output_len},
                   {"temperature", 0},
                   {"ignore_eos", true},
                   {"stream", true},
                   {"stream_options", {{"include_usage", true}}}};
      records[i] = StreamOne(ep, body, o.request_timeout_s);
      records[i].input_len = o.prompt_text.empty() ? o.input_len : std::max(0, records[i].prompt_tokens);
      const int done = finished.fetch_add(1) + 1;
      if (progress && (done % std::max(1, o.num_prompts / 10) == 0 || done == o.num_prompts)) {
        std::lock_guard lock(progress_mu);
        progress(fmt::format("{}/{} requests done ({:.1f} s)", done, o.num_prompts, MonotonicSeconds() - start));
      }
    }
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) threads.emplace_back(work);
  for (auto& t : threads) t.join();
  const double duration = MonotonicSeconds() - start;
  const SpecDelta spec = SpecDifference(spec_before, SpecSnapshot(ep));

  std::vector<double> ttft, tpot, itl, e2el;
  int64_t in_tokens = 0, out_tokens = 0;
  int completed = 0;
  json errors = json::array();
  for (const RequestRecord& r : records) {
    if (!r.ok) {
      if (errors.size() < 10) errors.push_back(r.error);
      continue;
    }
    ++completed;
    in_tokens += r.input_len;
    out_tokens += r.output_tokens;
    ttft.push_back(r.ttft);
    e2el.push_back(r.e2el);
    if (r.output_tokens > 1) tpot.push_back((r.e2el - r.ttft) / (r.output_tokens - 1));
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
  }
  json out = {{"endpoint", fmt::format("http://{}:{}", ep.host, ep.port)},
              {"model_id", model},
              {"backend", "openai"},
              {"num_prompts", o.num_prompts},
              {"input_len", o.prompt_text.empty() ? json(o.input_len) : json(nullptr)},  // text: see usage
              {"output_len", o.output_len},
              {"max_concurrency", workers},
              {"request_rate", std::isfinite(o.request_rate) ? json(o.request_rate) : json("inf")},
              {"seed", o.seed},
              {"duration", duration},
              {"completed", completed},
              {"failed", o.num_prompts - completed},
              {"errors", errors},
              {"total_input_tokens", in_tokens},
              {"total_output_tokens", out_tokens},
              {"request_throughput", completed / duration},
              {"output_throughput", out_tokens / duration},
              {"total_token_throughput", (in_tokens + out_tokens) / duration}};
  AddStats(&out, "ttft", ttft);
  AddStats(&out, "tpot", tpot);
  AddStats(&out, "itl", itl);
  AddStats(&out, "e2el", e2el);
  // As vLLM: the acceptance keys only where the server speculates.
  if (spec.enabled) out.update(spec.ToBenchServeJson());
  return out;
}

}  // namespace dl::lab
