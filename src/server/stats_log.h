// The serve-time log lines: vLLM's periodic throughput line and an access-log line per request.
#pragma once

#include <string>

#include "engine/scheduler.h"

namespace dl {

// vLLM's periodic line, over the interval between two snapshots of the scheduler's counters:
// "Avg prompt throughput: 12.5 tokens/s, Avg generation throughput: 40.1 tokens/s, Running: 2 reqs,
// Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 0.0%". `kv_label` names the cache
// ("GPU KV cache" on CUDA, as vLLM says, "KV cache" on the CPU reference).
std::string ThroughputLine(const SchedulerStats& before, const SchedulerStats& now, double seconds,
                           const std::string& kv_label);

// Whether an interval is worth a line: something ran or waited, or tokens moved. vLLM also prints
// one line after activity stops, so the last figures read zero; the caller keeps that state.
bool IntervalHadActivity(const SchedulerStats& before, const SchedulerStats& now);

struct AccessRecord {
  std::string remote;  // "addr:port"
  std::string method, path;
  int status = 0;
  int64_t prompt_tokens = -1;      // -1: not a generation request
  int64_t completion_tokens = -1;
  double seconds = 0;
};
// `127.0.0.1:5120 "POST /v1/completions" 200 prompt_tokens=12 completion_tokens=20 0.153s`.
std::string AccessLine(const AccessRecord& r);

}  // namespace dl
