// The lab's HTTP client: streamed greedy completions with a client-clock timestamp per SSE event,
// the "next" request, and /v1/decodelab/state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "lab/lab_checks.h"
#include "lab/lab_stats.h"

namespace dl::lab {

// Seconds on the client's monotonic clock.
double MonotonicSeconds();

struct Endpoint {
  std::string host = "127.0.0.1";
  int port = 0;
};
// "http://127.0.0.1:8000" (trailing slash and path ignored).
Result<Endpoint> ParseEndpoint(const std::string& url);

// The request body every lab request uses: greedy, ignore_eos, streamed with usage.
nlohmann::json CompletionBody(const std::vector<int32_t>& prompt, int max_tokens, bool stream);

// Streams one completion; fills result tokens/finish/cached and the timing of every token event.
// The whole request must end within `timeout_s` (a server trickling bytes cannot hold it longer).
Status StreamCompletion(const Endpoint& ep, const nlohmann::json& body, PromptResult* result,
                        RequestTiming* timing, double timeout_s = 600);
// Non-streamed completion with max_tokens 1: the "next" token after prompt, within `timeout_s`.
Result<int32_t> NextToken(const Endpoint& ep, const std::vector<int32_t>& prompt,
                          double timeout_s = 600);
Result<nlohmann::json> GetState(const Endpoint& ep);
// GET /metrics (Prometheus text), e.g. for the spec-decode counters (lab/lab_spec.h).
Result<std::string> GetMetricsText(const Endpoint& ep);
// True once GET /health answers 200.
bool Healthy(const Endpoint& ep);

}  // namespace dl::lab
