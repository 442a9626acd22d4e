// The CPU side of `decodelab bench comm` (comm/comm_bench.h): the size list, its printing and the bus
// bandwidth arithmetic; and that the graph timing refuses nonsense and, without a GPU, fails cleanly.
#include "comm/comm_bench.h"

#include <gtest/gtest.h>

namespace dl::comm {
namespace {

TEST(CommBenchTest, ParsesSizesWithKAndMSuffixes) {
  auto s = ParseByteSizes("4K,16K,64K,1M");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(*s, (std::vector<size_t>{4096, 16384, 65536, 1048576}));
  auto t = ParseByteSizes("1000,2k,3m,7");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(*t, (std::vector<size_t>{1000, 2048, 3u << 20, 7}));
}

TEST(CommBenchTest, RefusesBadSizesNamingTheItem) {
  for (const char* bad : {"", "4K,", ",4K", "4KB", "K", "-4K", "4.5K", "0", "2048M", "99999999999"}) {
    auto s = ParseByteSizes(bad);
    EXPECT_FALSE(s.ok()) << "'" << bad << "' was accepted";
  }
  auto s = ParseByteSizes("4K,16Q");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("'16Q'"), std::string::npos) << s.status().ToString();
}

TEST(CommBenchTest, FormatsSizesBackExactly) {
  EXPECT_EQ(FormatByteSize(4096), "4K");
  EXPECT_EQ(FormatByteSize(1 << 20), "1M");
  EXPECT_EQ(FormatByteSize(1536), "1536");  // 1.5K: not a whole number of K, so bytes
  EXPECT_EQ(FormatByteSize(3 << 10), "3K");
  EXPECT_EQ(FormatByteSize(7), "7");
  for (size_t b : {size_t{4096}, size_t{16384}, size_t{65536}, size_t{1} << 20, size_t{1000}}) {
    auto back = ParseByteSizes(FormatByteSize(b));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back->at(0), b);
  }
}

// nccl-tests: busbw = algbw * 2 (n - 1) / n.
TEST(CommBenchTest, BusBandwidthFollowsNcclTests) {
  EXPECT_DOUBLE_EQ(AllReduceBusGbps(1'000'000, 1e-3, 2), 1.0);   // algbw 1 GB/s, x 2 * 1 / 2
  EXPECT_DOUBLE_EQ(AllReduceBusGbps(1'000'000, 1e-3, 4), 1.5);   // x 2 * 3 / 4
  EXPECT_DOUBLE_EQ(AllReduceBusGbps(1'000'000, 1e-3, 1), 0.0);   // one rank moves nothing
  EXPECT_DOUBLE_EQ(AllReduceBusGbps(1'000'000, 0.0, 2), 0.0);
}

TEST(CommBenchTest, TimingRefusesNonsense) {
  auto t = TimeAllReduceInGraph({}, 16, DeviceElem::kBF16, 10, 1, 10);
  ASSERT_FALSE(t.ok());
}

}  // namespace
}  // namespace dl::comm
