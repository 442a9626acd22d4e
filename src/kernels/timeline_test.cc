#include "kernels/timeline.h"

#include <gtest/gtest.h>

namespace dl::kernels {
namespace {

TimelineRecord Rec(uint64_t grid, TimelineTag tag, uint32_t block, uint32_t blocks, uint64_t start,
                   uint64_t waited, uint64_t end) {
  return {grid, static_cast<uint32_t>(tag), block, blocks, start, waited, end};
}

// Three launches, records out of order: a norm (1 block), a GEMV (2 blocks) that starts before the
// norm ends (PDL) and is released when it does, and a second norm that waits on the GEMV.
TEST(TimelineTest, SpansGroupByGridAndMeasureAgainstThePreviousLaunch) {
  const std::vector<TimelineRecord> records = {
      Rec(7, TimelineTag::kGemv, 1, 2, 1400, 2100, 5000),
      Rec(5, TimelineTag::kAddRmsNorm, 0, 1, 1000, 1100, 2000),
      Rec(9, TimelineTag::kAddRmsNorm, 0, 1, 4800, 5300, 6000),
      Rec(7, TimelineTag::kGemv, 0, 2, 1200, 2200, 4000),
  };
  const auto spans = TimelineSpans(records);
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0].grid, 5u);
  EXPECT_EQ(spans[1].grid, 7u);
  EXPECT_EQ(spans[1].blocks, 2u);
  EXPECT_EQ(spans[1].first_start, 200);  // relative to the first launch's start (1000)
  EXPECT_EQ(spans[1].last_start, 400);
  EXPECT_EQ(spans[1].first_waited, 1100);
  EXPECT_EQ(spans[1].last_waited, 1200);
  EXPECT_EQ(spans[1].last_end, 4000);
  EXPECT_EQ(spans[0].exposed, 1000);
  EXPECT_EQ(spans[1].exposed, 3000);
  EXPECT_EQ(spans[2].exposed, 1000);
  EXPECT_EQ(spans[1].prev_end, 1000);

  const auto rows = TimelineSummary(spans);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].name, "add_rmsnorm[1]");
  EXPECT_EQ(rows[0].count, 2);
  EXPECT_DOUBLE_EQ(rows[0].total_exposed_us, 2.0);
  EXPECT_DOUBLE_EQ(rows[0].exposed_us, 1.0);
  EXPECT_EQ(rows[1].name, "gemv[2]");
  EXPECT_DOUBLE_EQ(rows[1].lag_us, -0.8);     // started 800 ns before the norm ended
  EXPECT_DOUBLE_EQ(rows[1].release_us, 0.1);  // first block released 100 ns after it
  EXPECT_DOUBLE_EQ(rows[1].after_us, 2.9);
  const std::string text = FormatTimeline(rows, spans);
  EXPECT_NE(text.find("sum of exposed 5.0 us = first start to last end 5.0 us"), std::string::npos) << text;
  // From the first norm at or after the middle launch (index 1 of 3 is the GEMV, so the second norm).
  const std::string launches = FormatLaunches(spans, 4);
  EXPECT_NE(launches.find("add_rmsnorm[1]                 0.00     0.00      0.50      0.50     1.20     1.00"),
            std::string::npos)
      << launches;
  EXPECT_EQ(launches.find("gemv"), std::string::npos) << launches;
}

// A launch whose end is behind an earlier one's exposes nothing; a record with an unknown tag is
// named, not dropped; a launch that never waited has no release time.
TEST(TimelineTest, OverlappedLaunchesExposeNothing) {
  const auto spans = TimelineSpans({Rec(1, TimelineTag::kMoeGateUp, 0, 1, 0, 0, 1000),
                                    Rec(2, static_cast<TimelineTag>(99), 0, 1, 100, 0, 500)});
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[1].exposed, 0);
  EXPECT_EQ(spans[1].first_waited, -1);
  const auto rows = TimelineSummary(spans);
  EXPECT_EQ(rows[1].name, "unknown[1]");
  EXPECT_DOUBLE_EQ(rows[1].release_us, 0.0);
  EXPECT_TRUE(TimelineSpans({}).empty());
}

}  // namespace
}  // namespace dl::kernels
