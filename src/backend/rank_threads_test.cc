#include "backend/rank_threads.h"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>

namespace dl {
namespace {

// Every rank runs every step, at once (a rank waiting for all the others would otherwise hang), rank
// 0 on the caller's thread and the others each on its own; statuses come back by rank.
TEST(RankThreadsTest, RunsEveryRankAtOnceAndReturnsStatusesByRank) {
  for (int ranks : {1, 2, 4}) {
    RankThreads threads(ranks);
    for (int step = 0; step < 50; ++step) {
      std::atomic<int> arrived{0};
      std::vector<std::thread::id> ids(ranks);
      const auto statuses = threads.Run([&](int r) {
        ids[r] = std::this_thread::get_id();
        ++arrived;
        while (arrived.load() < ranks) std::this_thread::yield();  // a barrier: all ranks run together
        return r % 2 == 1 ? Internal("rank {} failed at step {}", r, step) : Status::Ok();
      });
      ASSERT_EQ(static_cast<int>(statuses.size()), ranks);
      EXPECT_EQ(ids[0], std::this_thread::get_id());
      EXPECT_EQ(std::set<std::thread::id>(ids.begin(), ids.end()).size(), static_cast<size_t>(ranks));
      for (int r = 0; r < ranks; ++r) EXPECT_EQ(statuses[r].ok(), r % 2 == 0) << r;
      const std::string failures = RankThreads::DescribeFailures(statuses);
      if (ranks == 1) {
        EXPECT_EQ(failures, "");
      } else {
        EXPECT_NE(failures.find("rank 1: "), std::string::npos) << failures;
        EXPECT_EQ(failures.find("rank 0"), std::string::npos) << failures;
      }
    }
  }
}

TEST(RankThreadsTest, InjectedFailureIsTakenOnce) {
  InjectedFailures injected;
  injected.Set(2, Unavailable("planted"));
  injected.Set(-1, Unavailable("ignored"));
  EXPECT_TRUE(injected.Take(1).ok());
  const Status first = injected.Take(2);
  EXPECT_EQ(first.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(injected.Take(2).ok()) << "taken once";
  EXPECT_TRUE(injected.Take(7).ok()) << "never set";
}

}  // namespace
}  // namespace dl
