#include "comm/rank_barrier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace dl::comm {
namespace {

// Many meetings in a row: nobody leaves a meeting before everyone arrived, and the last arrival's
// status is every rank's result of that meeting.
TEST(RankBarrierTest, EveryRankLeavesAfterAllArrivedWithTheLastArrivalsStatus) {
  constexpr int kRanks = 4, kMeetings = 200;
  RankBarrier barrier(kRanks, 30.0, "test group");
  std::atomic<int> arrived{0};
  std::vector<int> bad(kRanks, 0), failed_meetings(kRanks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      for (int m = 0; m < kMeetings; ++m) {
        ++arrived;
        const Status st = barrier.Arrive(r, "meeting", [&]() -> Status {
          return m % 7 == 3 ? InvalidArgument("meeting {} disagrees", m) : Status::Ok();
        });
        if (arrived.load() < kRanks * (m + 1)) ++bad[r];
        if (!st.ok()) ++failed_meetings[r];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(bad[r], 0) << "rank " << r << " left a meeting early";
    EXPECT_EQ(failed_meetings[r], (kMeetings + 3) / 7) << "rank " << r;
  }
}

TEST(RankBarrierTest, TimeoutNamesTheMissingRanksAndEndsTheGroup) {
  RankBarrier barrier(3, 0.2, "test group");
  Status st0, st1;
  std::thread a([&] { st0 = barrier.Arrive(0, "all-reduce"); });
  std::thread b([&] { st1 = barrier.Arrive(1, "all-reduce"); });
  a.join();
  b.join();
  const Status& first = st0.code() == StatusCode::kDeadlineExceeded ? st0 : st1;
  EXPECT_EQ(first.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(first.message().find("in all-reduce for rank(s) 2"), std::string::npos) << first.ToString();
  EXPECT_NE(first.message().find("test group"), std::string::npos) << first.ToString();
  // Both waiting ranks got the group's end, and so does the late one.
  EXPECT_FALSE(st0.ok());
  EXPECT_FALSE(st1.ok());
  EXPECT_EQ(barrier.Arrive(2, "all-reduce").code(), StatusCode::kDeadlineExceeded);
}

TEST(RankBarrierTest, AbortReleasesWaitersWithTheFirstReason) {
  RankBarrier barrier(2, 30.0, "test group");
  Status waited;
  std::thread t([&] { waited = barrier.Arrive(0, "all-gather"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  barrier.Abort(1, Unavailable("rank 1's forward failed"));
  barrier.Abort(0, Internal("a later abort"));
  t.join();
  EXPECT_EQ(waited.code(), StatusCode::kUnavailable);
  EXPECT_NE(waited.ToString().find("aborted by rank 1"), std::string::npos) << waited.ToString();
  EXPECT_EQ(barrier.Arrive(1, "all-gather").code(), StatusCode::kUnavailable);
  RankBarrier ok_abort(2, 30.0, "g");
  ok_abort.Abort(0, Status::Ok());
  EXPECT_EQ(ok_abort.Arrive(1, "x").code(), StatusCode::kCancelled);
}

}  // namespace
}  // namespace dl::comm
