// Bounded load test on loopback: 64 concurrent streaming clients send 1000 requests in total to the
// tiny model. Every request must complete with its full token count, no KV page may leak, and the
// process's resident memory must not grow beyond a small allowance after a warm-up round.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "tests/server/server_test_util.h"

namespace dl::test {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

long RssKiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

struct Round {
  int ok = 0;
  int failed = 0;
  std::vector<double> latencies;
  double seconds = 0;
};

Round RunRound(int port, int clients, int total, int max_tokens) {
  Round r;
  std::atomic<int> next{0};
  std::mutex mu;
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      httplib::Client cli("127.0.0.1", port);
      cli.set_read_timeout(60, 0);
      while (true) {
        const int i = next.fetch_add(1);
        if (i >= total) break;
        std::vector<int32_t> prompt;
        for (int k = 0; k < 6 + i % 7; ++k) prompt.push_back(40 + (i * 31 + k * 17 + c) % 450);
        json body = {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0},
                     {"ignore_eos", true}, {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
        const auto ts = Clock::now();
        auto s = PostStream(cli, "/v1/completions", body);
        const double lat = std::chrono::duration<double>(Clock::now() - ts).count();
        bool good = s.status == 200 && s.data.size() == static_cast<size_t>(max_tokens) + 2 &&
                    s.data.back() == "[DONE]";
        if (good) {
          auto usage = json::parse(s.data[s.data.size() - 2], nullptr, false);
          good = usage.is_object() && usage["usage"]["completion_tokens"] == max_tokens;
        }
        std::lock_guard lock(mu);
        if (good) {
          ++r.ok;
          r.latencies.push_back(lat);
        } else {
          if (r.failed < 5) {
            std::fprintf(stderr, "request %d failed: status %d (%s), %zu events, tail '%s'\n", i,
                         s.status, s.error.c_str(), s.data.size(),
                         s.raw.substr(s.raw.size() > 200 ? s.raw.size() - 200 : 0).c_str());
          }
          ++r.failed;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::sort(r.latencies.begin(), r.latencies.end());
  return r;
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double pos = p / 100.0 * (sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

TEST(ServerLoadTest, SixtyFourStreamingClientsThousandRequests) {
  auto server = TestServer::Start({.max_batch = 64, .max_waiting = 1024, .http_threads = 160});
  ASSERT_NE(server, nullptr);
  const int kMaxTokens = 6;
  // Warm-up round: thread pools, allocator arenas and KV pools reach their working size.
  Round warm = RunRound(server->port(), 64, 128, kMaxTokens);
  EXPECT_EQ(warm.failed, 0);
  const long rss_before = RssKiB();
  Round r = RunRound(server->port(), 64, 1000, kMaxTokens);
  const long rss_after = RssKiB();
  std::printf(
      "load: %d ok, %d failed in %.2f s = %.1f req/s; latency p50 %.1f ms, p99 %.1f ms; RSS %ld -> "
      "%ld KiB\n",
      r.ok, r.failed, r.seconds, r.ok / r.seconds, Percentile(r.latencies, 50) * 1e3,
      Percentile(r.latencies, 99) * 1e3, rss_before, rss_after);
  EXPECT_EQ(r.ok, 1000);
  EXPECT_EQ(r.failed, 0);
  // Idle again: every page is back.
  auto cli = server->Client();
  int used = -1;
  for (int i = 0; i < 300 && used != 0; ++i) {
    used = KvPagesUsed(cli);
    if (used != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(used, 0);
  EXPECT_EQ(server->scheduler().Stats().running, 0);
  // Memory stable: no per-request growth (1000 requests leaking even 16 KiB each would be 16 MiB).
  EXPECT_LT(rss_after - rss_before, 16 * 1024) << "RSS grew from " << rss_before << " to "
                                               << rss_after << " KiB";
}

}  // namespace
}  // namespace dl::test
