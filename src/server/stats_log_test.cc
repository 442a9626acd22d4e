#include "server/stats_log.h"

#include <gtest/gtest.h>

namespace dl {
namespace {

TEST(StatsLogTest, ThroughputLineIsVllmsOverTheInterval) {
  SchedulerStats a, b;
  a.prompt_tokens_total = 100;
  a.generation_tokens_total = 1000;
  b.prompt_tokens_total = 150;
  b.generation_tokens_total = 1400;
  b.cached_prompt_tokens_total = 25;
  b.running = 2;
  b.waiting = 1;
  b.kv_usage = 0.125;
  EXPECT_EQ(ThroughputLine(a, b, 10.0, "GPU KV cache"),
            "Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 40.0 tokens/s, "
            "Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: "
            "50.0%");
  EXPECT_TRUE(IntervalHadActivity(a, b));
  EXPECT_FALSE(IntervalHadActivity(a, a));
  SchedulerStats waiting = a;
  waiting.waiting = 1;
  EXPECT_TRUE(IntervalHadActivity(a, waiting));
}

TEST(StatsLogTest, AccessLine) {
  AccessRecord r{"127.0.0.1:5120", "POST", "/v1/completions", 200, 12, 20, 0.1534};
  EXPECT_EQ(AccessLine(r),
            "127.0.0.1:5120 \"POST /v1/completions\" 200 prompt_tokens=12 completion_tokens=20 0.153s");
  AccessRecord g{"127.0.0.1:1", "GET", "/health", 200, -1, -1, 0.0004};
  EXPECT_EQ(AccessLine(g), "127.0.0.1:1 \"GET /health\" 200 0.000s");
}

}  // namespace
}  // namespace dl
