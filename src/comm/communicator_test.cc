// The tensor-parallel communicators: fixed-order sums (the same bits on every rank, over either
// transport), all-gather of uneven parts, the distributed argmax, and a failing or missing rank
// ending the group with an error instead of a hang.
#include "comm/communicator.h"

#include <bit>
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "comm/tcp_communicator.h"
#include "comm/tcp_group.h"

namespace dl::comm {
namespace {

// Runs fn(rank) on one thread per rank and joins them.
void OnEveryRank(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

std::vector<std::unique_ptr<Communicator>> TcpComms(int n, double timeout_s) {
  auto listener = Listen("127.0.0.1", 0);
  EXPECT_TRUE(listener.ok());
  const Endpoint root{"127.0.0.1", listener->port};
  std::vector<std::unique_ptr<Communicator>> comms(n);
  OnEveryRank(n, [&](int r) {
    auto g = TcpGroup::Create(r, n, r == 0 ? listener->fd : -1, root, DeadlineIn(30));
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    comms[r] = std::make_unique<TcpCommunicator>(std::move(g).value(), timeout_s);
  });
  return comms;
}

// Values whose sum depends on the order of the additions.
std::vector<float> OrderSensitive(int rank) {
  return {rank == 0 ? 1e8f : 1.0f, rank % 2 ? -1e8f : 3.0f, 0.1f * static_cast<float>(rank + 1), -0.0f};
}

std::vector<float> SumInRankOrder(int n) {
  std::vector<float> s = OrderSensitive(0);
  for (int r = 1; r < n; ++r) {
    const auto x = OrderSensitive(r);
    for (size_t i = 0; i < s.size(); ++i) s[i] += x[i];
  }
  return s;
}

TEST(CommunicatorTest, InProcessAllReduceSumsInRankOrderOnEveryRank) {
  const int n = 4;
  auto group = InProcessGroup::Create(n);
  const std::vector<float> expected = SumInRankOrder(n);
  std::vector<std::vector<float>> got(n);
  OnEveryRank(n, [&](int r) {
    for (int repeat = 0; repeat < 3; ++repeat) {
      got[r] = OrderSensitive(r);
      ASSERT_TRUE(group->rank(r).AllReduceSum(got[r]).ok());
    }
  });
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(std::bit_cast<uint32_t>(got[r][i]), std::bit_cast<uint32_t>(expected[i])) << r << " " << i;
    }
    EXPECT_EQ(group->rank(r).collectives_issued(), 3);
  }
}

TEST(CommunicatorTest, TcpAndInProcessGiveTheSameBits) {
  const int n = 3;
  auto tcp = TcpComms(n, 30);
  ASSERT_EQ(tcp.size(), 3u);
  auto group = InProcessGroup::Create(n);
  std::vector<std::vector<float>> a(n), b(n);
  OnEveryRank(n, [&](int r) {
    a[r] = OrderSensitive(r);
    b[r] = OrderSensitive(r);
    ASSERT_TRUE(tcp[r]->AllReduceSum(a[r]).ok());
    ASSERT_TRUE(group->rank(r).AllReduceSum(b[r]).ok());
  });
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < a[r].size(); ++i) {
      EXPECT_EQ(std::bit_cast<uint32_t>(a[r][i]), std::bit_cast<uint32_t>(b[0][i]));
    }
  }
}

TEST(CommunicatorTest, AllGatherOfUnevenPartsOverBothTransports) {
  const int n = 3;
  const std::vector<int64_t> counts = {3, 0, 2};
  auto check = [&](const std::function<Communicator&(int)>& comm) {
    std::vector<std::vector<float>> got(n);
    OnEveryRank(n, [&](int r) {
      std::vector<float> local(counts[r]);
      for (int64_t i = 0; i < counts[r]; ++i) local[i] = static_cast<float>(10 * r + i);
      auto all = AllGatherFloats(comm(r), local, counts);
      ASSERT_TRUE(all.ok()) << all.status().ToString();
      got[r] = *all;
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(got[r], (std::vector<float>{0, 1, 2, 20, 21}));
  };
  auto group = InProcessGroup::Create(n);
  check([&](int r) -> Communicator& { return group->rank(r); });
  auto tcp = TcpComms(n, 30);
  check([&](int r) -> Communicator& { return *tcp[r]; });
}

TEST(CommunicatorTest, DistributedArgmaxTakesTheLowestIdOnTiesAndAndsFiniteness) {
  const int n = 3;
  auto group = InProcessGroup::Create(n);
  // Row 0: ranks 1 and 2 tie at 5 -> rank 1's id. Row 1: rank 0 wins; rank 2's slice is empty and
  // rank 1's held a NaN.
  const ArgmaxCandidate table[3][2] = {{{4.0f, 3, 1}, {2.0f, 0, 1}},
                                       {{5.0f, 12, 1}, {1.0f, 11, 0}},
                                       {{5.0f, 20, 1}, {0.0f, -1, 1}}};
  std::vector<std::vector<ArgmaxCandidate>> got(n);
  OnEveryRank(n, [&](int r) {
    auto best = DistributedArgmax(group->rank(r), std::span<const ArgmaxCandidate>(table[r], 2));
    ASSERT_TRUE(best.ok());
    got[r] = *best;
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(got[r][0].index, 12);
    EXPECT_EQ(got[r][0].finite, 1);
    EXPECT_EQ(got[r][1].index, 0);
    EXPECT_EQ(got[r][1].finite, 0);
  }
}

TEST(CommunicatorTest, AnAbortingRankReleasesTheOthersWithItsReason) {
  const int n = 3;
  auto group = InProcessGroup::Create(n, /*timeout_s=*/60);
  std::vector<Status> st(n);
  OnEveryRank(n, [&](int r) {
    std::vector<float> x(4, 1.0f);
    if (r == 2) {
      group->rank(r).Abort(Internal("out of memory"));
      st[r] = group->rank(r).AllReduceSum(x);
    } else {
      st[r] = group->rank(r).AllReduceSum(x);
    }
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_FALSE(st[r].ok()) << r;
    EXPECT_NE(st[r].message().find("aborted by rank 2"), std::string::npos) << st[r].message();
    EXPECT_NE(st[r].message().find("out of memory"), std::string::npos) << st[r].message();
  }
}

TEST(CommunicatorTest, AMissingRankIsNamedAfterTheTimeout) {
  auto group = InProcessGroup::Create(3, /*timeout_s=*/0.3);
  std::vector<Status> st(2);
  OnEveryRank(2, [&](int r) {  // rank 2 never arrives
    std::vector<float> x(2, 1.0f);
    st[r] = group->rank(r).AllReduceSum(x);
  });
  for (const Status& s : st) {
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("for rank(s) 2"), std::string::npos) << s.message();
  }
}

TEST(CommunicatorTest, TcpAbortEndsThePeersCollectivesAtOnce) {
  const int n = 2;
  auto tcp = TcpComms(n, 30);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Status> st(n);
  OnEveryRank(n, [&](int r) {
    std::vector<float> x(2, 1.0f);
    if (r == 1) {
      tcp[r]->Abort(Internal("rank 1 failed"));
      st[r] = tcp[r]->AllReduceSum(x);
    } else {
      st[r] = tcp[r]->AllReduceSum(x);
    }
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  ASSERT_FALSE(st[0].ok());
  EXPECT_NE(st[0].message().find("rank 0"), std::string::npos) << st[0].message();
  ASSERT_FALSE(st[1].ok());
  EXPECT_NE(st[1].message().find("rank 1 failed"), std::string::npos) << st[1].message();
}

}  // namespace
}  // namespace dl::comm
