// Speed statistics of lab.md §3, as pure functions over client-clock arrival times (seconds on a
// monotonic clock, one per streamed token event), so they can be checked against hand-computed
// examples.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl::lab {

// One streamed request as the client saw it.
struct RequestTiming {
  double sent = 0;               // request written
  double first_byte = 0;         // response headers arrived
  std::vector<double> arrivals;  // one per token event, in order
};

// Median (mean of the two middle values for an even count). Empty input: 0.
double Median(std::vector<double> v);
// Percentile with linear interpolation between closest ranks (numpy's default, as vLLM uses).
double Percentile(std::vector<double> v, double pct);
double Mean(const std::vector<double>& v);

// Conventional: over the first 100 token events, the 99 gaps between consecutive events; 1/median
// gap (tok/s). Needs at least 2 events.
Result<double> ConventionalTokS(const std::vector<double>& arrivals);
// Historical: over the same 100 events, rate_i = 1/gap_i with gap_1 measured from the first byte of
// the response; the median of those rates. Needs at least 1 event.
Result<double> HistoricalTokS(double first_byte, const std::vector<double>& arrivals);

// Stream: over the same 100 events, (events - 1) / (last - first): the mean rate from the first
// token to the last. Unlike the two above it does not depend on how tokens are grouped into reads,
// so it is the speed of a speculative run, whose verify emits its accepted tokens together (their
// gaps are ~0 and the median gap says nothing about the rate). Needs at least 2 events apart.
Result<double> StreamTokS(const std::vector<double>& arrivals);

struct Distribution {
  double mean = 0, median = 0, p99 = 0;
  nlohmann::json ToJson() const;  // seconds converted to milliseconds: {mean_ms, median_ms, p99_ms}
};
Distribution Describe(const std::vector<double>& v);

// vllm bench serve's definitions: TTFT = first token - sent; TPOT per request =
// (last - first token) / (tokens - 1) for requests with more than one token; ITL = every gap
// between consecutive tokens of every request, pooled.
struct RunSpeed {
  std::vector<double> conventional;  // per request, tok/s (empty when not per_event)
  std::vector<double> historical;    // per request, tok/s (empty when not per_event)
  std::vector<double> stream;        // per request, tok/s
  double conventional_median = 0;
  double historical_median = 0;
  double stream_median = 0;
  bool per_event = true;  // conventional and historical were computed
  Distribution ttft, tpot, itl;
  int requests = 0;
};
// `per_event` false (a speculative run): conventional and historical are left out, since they
// measure how the tokens were grouped rather than how fast they came; stream is always computed.
Result<RunSpeed> ComputeRunSpeed(const std::vector<RequestTiming>& timings, bool per_event = true);

}  // namespace dl::lab
