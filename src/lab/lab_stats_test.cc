#include "lab/lab_stats.h"

#include <gtest/gtest.h>

namespace dl::lab {
namespace {

TEST(LabStats, MedianAndPercentile) {
  EXPECT_DOUBLE_EQ(Median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(Median({4, 1, 3, 2}), 2.5);
  // numpy.percentile([1,2,3,4,5], 99) = 4 + 0.96 * (5 - 4) = 4.96.
  EXPECT_NEAR(Percentile({5, 1, 4, 2, 3}, 99), 4.96, 1e-12);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4, 5}, 50), 3);
  EXPECT_DOUBLE_EQ(Mean({1, 2, 6}), 3);
}

TEST(LabStats, ConventionalUsesTheFirst99Gaps) {
  // 150 events: the first 100 are 10 ms apart except 20 gaps of 30 ms; events after the 100th are
  // 1 s apart and must be ignored. Median of the 99 gaps is 10 ms -> 100 tok/s.
  std::vector<double> t = {0};
  for (int i = 1; i < 100; ++i) t.push_back(t.back() + (i % 5 == 0 ? 0.030 : 0.010));
  for (int i = 0; i < 50; ++i) t.push_back(t.back() + 1.0);
  auto r = ConventionalTokS(t);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(*r, 100.0, 1e-6);
}

TEST(LabStats, ConventionalVersusHistorical) {
  // Gaps (s): first byte -> event 1 = 0.5, then 0.1, 0.2, 0.4.
  // Conventional: gaps 0.1, 0.2, 0.4 -> median 0.2 -> 5 tok/s.
  // Historical: rates 2, 10, 5, 2.5 -> median (2.5 + 5) / 2 = 3.75 tok/s.
  const std::vector<double> t = {1.5, 1.6, 1.8, 2.2};
  auto c = ConventionalTokS(t);
  auto h = HistoricalTokS(1.0, t);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(h.ok());
  EXPECT_NEAR(*c, 5.0, 1e-9);
  EXPECT_NEAR(*h, 3.75, 1e-9);
}

TEST(LabStats, TooFewEventsIsAnError) {
  EXPECT_FALSE(ConventionalTokS({1.0}).ok());
  EXPECT_FALSE(HistoricalTokS(0.0, {}).ok());
}

TEST(LabStats, VllmDefinitions) {
  // Request A: sent 0, tokens at 0.5, 0.6, 0.8 -> TTFT 0.5, TPOT (0.8-0.5)/2 = 0.15, ITL 0.1, 0.2.
  // Request B: sent 10, tokens at 10.2, 10.5 -> TTFT 0.2, TPOT 0.3, ITL 0.3.
  RequestTiming a{0, 0.4, {0.5, 0.6, 0.8}};
  RequestTiming b{10, 10.1, {10.2, 10.5}};
  auto s = ComputeRunSpeed({a, b});
  ASSERT_TRUE(s.ok());
  EXPECT_NEAR(s->ttft.mean, 0.35, 1e-9);
  EXPECT_NEAR(s->ttft.median, 0.35, 1e-9);
  EXPECT_NEAR(s->tpot.mean, 0.225, 1e-9);
  EXPECT_NEAR(s->itl.median, 0.2, 1e-9);
  EXPECT_NEAR(s->itl.mean, 0.2, 1e-9);
  // A: conventional 1/median(0.1,0.2)=1/0.15; B: 1/0.3. Median over requests = their mean.
  EXPECT_NEAR(s->conventional_median, 0.5 * (1 / 0.15 + 1 / 0.3), 1e-9);
  // A historical: rates 10, 10, 5 -> 10; B: 10, 1/0.3 -> (10 + 3.333..)/2.
  EXPECT_NEAR(s->historical[0], 10, 1e-9);
  EXPECT_NEAR(s->historical[1], 0.5 * (10 + 1 / 0.3), 1e-9);
  EXPECT_EQ(s->requests, 2);
  // Stream: A (3 - 1) / 0.3, B 1 / 0.3; the median over requests is their mean.
  EXPECT_NEAR(s->stream[0], 2 / 0.3, 1e-9);
  EXPECT_NEAR(s->stream_median, 0.5 * (2 / 0.3 + 1 / 0.3), 1e-9);
}

TEST(LabStats, StreamIgnoresHowTokensAreGrouped) {
  // A speculative stream: verifies every 30 ms emit 3 tokens that arrive together. The median gap
  // is 0, so the conventional statistic has no value; the stream rate is 3 tokens per 30 ms over
  // the 100-event window: 99 gaps span 33 verifies = 0.99 s -> 100 tok/s.
  std::vector<double> t;
  for (int v = 0; v < 40; ++v) {
    for (int k = 0; k < 3; ++k) t.push_back(1.0 + 0.030 * v);
  }
  EXPECT_FALSE(ConventionalTokS(t).ok());
  auto st = StreamTokS(t);
  ASSERT_TRUE(st.ok());
  EXPECT_NEAR(*st, 99 / (0.030 * 33), 1e-9);
  EXPECT_FALSE(StreamTokS({2.0, 2.0}).ok());
  // A speculative run leaves the per-event statistics out instead of failing on them.
  RequestTiming r{0.5, 0.9, t};
  EXPECT_FALSE(ComputeRunSpeed({r}).ok());
  auto s = ComputeRunSpeed({r}, /*per_event=*/false);
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_FALSE(s->per_event);
  EXPECT_TRUE(s->conventional.empty());
  EXPECT_NEAR(s->stream_median, *st, 1e-9);
}

}  // namespace
}  // namespace dl::lab
