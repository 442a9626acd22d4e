// `decodelab bench serve`: the counterpart of `vllm bench serve`. Random token prompts go to an
// OpenAI-compatible /v1/completions endpoint (decodelab or any other server), streamed, greedy,
// ignore_eos, at most `concurrency` in flight, arriving at `request_rate` per second (Poisson; inf:
// all at once). The summary uses vLLM's definitions and key names: TTFT (send to first token), ITL
// (gaps between streamed chunks), TPOT per request ((E2E - TTFT) / (output tokens - 1)), E2EL, and
// request/output/total token throughput over the whole run. Where the server exports vLLM's
// spec-decode counters in /metrics (decodelab or vLLM with speculation on), the run's acceptance
// (their difference over the run) is added under `vllm bench serve`'s keys (lab/lab_spec.h).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "lab/lab_client.h"

namespace dl::lab {

struct ServeBenchOptions {
  int input_len = 1024;
  int output_len = 1024;
  int num_prompts = 100;
  int concurrency = 0;  // most requests in flight; 0 = num_prompts
  double request_rate = std::numeric_limits<double>::infinity();
  uint64_t seed = 0;
  int64_t vocab_size = 0;  // prompt ids are drawn from [0, vocab_size); 0 = ask the server
  std::string model;       // the request's "model"; empty = the first id of /v1/models
  double request_timeout_s = 3600;
  // Non-empty: every request's prompt is this text (the server tokenizes it; input tokens come from
  // usage.prompt_tokens) instead of `input_len` random ids, e.g. a repetitive code-like prompt for
  // the n-gram drafter.
  std::string prompt_text;
};

// Runs the benchmark; `progress` gets a line now and then (may be empty).
Result<nlohmann::json> RunServeBench(const Endpoint& ep, const ServeBenchOptions& o,
                                     const std::function<void(const std::string&)>& progress);

}  // namespace dl::lab
