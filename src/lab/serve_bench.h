// `decodelab bench serve`: the counterpart of `vllm bench serve`. Random token prompts go to an
// OpenAI-compatible /v1/completions endpoint (decodelab or any other server), streamed, greedy,
// ignore_eos, at most `concurrency` in flight, arriving at `request_rate` per second (Poisson; inf:
// all at once). The summary uses vLLM's definitions and key names: TTFT (send to first token), ITL
// (gaps between streamed chunks), TPOT per request ((E2E - TTFT) / (output tokens - 1)), E2EL, and
// request/output/total token throughput over the whole run.
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
};

// Runs the benchmark; `progress` gets a line now and then (may be empty).
Result<nlohmann::json> RunServeBench(const Endpoint& ep, const ServeBenchOptions& o,
                                     const std::function<void(const std::string&)>& progress);

}  // namespace dl::lab
