#include "server/stats_log.h"

#include <fmt/format.h>

namespace dl {

std::string ThroughputLine(const SchedulerStats& before, const SchedulerStats& now, double seconds,
                           const std::string& kv_label) {
  const double s = seconds > 0 ? seconds : 1.0;
  const double prompt = static_cast<double>(now.prompt_tokens_total - before.prompt_tokens_total);
  const double gen = static_cast<double>(now.generation_tokens_total - before.generation_tokens_total);
  const double cached =
      static_cast<double>(now.cached_prompt_tokens_total - before.cached_prompt_tokens_total);
  return fmt::format(
      "Avg prompt throughput: {:.1f} tokens/s, Avg generation throughput: {:.1f} tokens/s, "
      "Running: {} reqs, Waiting: {} reqs, {} usage: {:.1f}%, Prefix cache hit rate: {:.1f}%",
      prompt / s, gen / s, now.running, now.waiting, kv_label, now.kv_usage * 100.0,
      prompt > 0 ? 100.0 * cached / prompt : 0.0);
}

bool IntervalHadActivity(const SchedulerStats& before, const SchedulerStats& now) {
  return now.running > 0 || now.waiting > 0 ||
         now.prompt_tokens_total != before.prompt_tokens_total ||
         now.generation_tokens_total != before.generation_tokens_total;
}

std::string AccessLine(const AccessRecord& r) {
  std::string line = fmt::format("{} \"{} {}\" {}", r.remote, r.method, r.path, r.status);
  if (r.prompt_tokens >= 0) {
    line += fmt::format(" prompt_tokens={} completion_tokens={}", r.prompt_tokens, r.completion_tokens);
  }
  return line + fmt::format(" {:.3f}s", r.seconds);
}

}  // namespace dl
