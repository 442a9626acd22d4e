// Host-side checks of the device communicators (comm/device_communicator.h): the rank-order sum the
// device kernel is compared with, and the refusals that need no GPU. The device collectives themselves
// are tests/gpu/device_comm_gpu_test.cc.
#include "comm/device_communicator.h"

#include <gtest/gtest.h>

#include "base/dtype.h"
#include "cuda/device.h"

namespace dl::comm {
namespace {

// (x0 + x1) + x2 in FP32: 1e8 + 1 rounds back to 1e8 (one ulp there is 8), so the same three values
// sum to 0 or 1 depending on where the 1 comes in the order. BF16 rounds the FP32 sum once.
TEST(DeviceCommunicatorTest, RankOrderSumAddsInRankOrderAndRoundsOnce) {
  EXPECT_EQ(RankOrderSum({1e8f, 1.0f, -1e8f}, DeviceElem::kF32), 0.0f);
  EXPECT_EQ(RankOrderSum({-1e8f, 1.0f, 1e8f}, DeviceElem::kF32), 0.0f);
  EXPECT_EQ(RankOrderSum({-1e8f, 1e8f, 1.0f}, DeviceElem::kF32), 1.0f);
  // BF16 (7 stored mantissa bits: one ulp at 1 is 2^-7) rounds the exact FP32 sum once, to nearest
  // even: 1 + 2^-8 is a tie and goes to 1.0; 1 + 3 * 2^-9 rounds up to 1 + 2^-7, where rounding after
  // every add would have lost each 2^-9 and stayed at 1.0.
  EXPECT_EQ(RankOrderSum({1.0f, 0x1p-9f, 0x1p-9f}, DeviceElem::kBF16), 1.0f);
  EXPECT_EQ(RankOrderSum({1.0f, 0x1p-9f, 0x1p-9f, 0x1p-9f}, DeviceElem::kBF16), 1.0078125f);
  EXPECT_EQ(RoundBf16(RoundBf16(RoundBf16(1.0f + 0x1p-9f) + 0x1p-9f) + 0x1p-9f), 1.0f)
      << "rounding after every add would lose the three halves of an ulp";
  EXPECT_EQ(RankOrderSum({2.5f}, DeviceElem::kF32), 2.5f);
  EXPECT_EQ(DeviceElemBytes(DeviceElem::kF32), 4u);
  EXPECT_EQ(DeviceElemBytes(DeviceElem::kBF16), 2u);
}

TEST(DeviceCommunicatorTest, GroupsNeedRanksAndNcclOneRankPerGpu) {
  EXPECT_FALSE(DeviceGroup::CreateInProcess({}, 1024).ok());
  auto twice = CreateNcclGroup({0, 0});
  ASSERT_FALSE(twice.ok());
#if defined(DECODELAB_HAVE_CUDA) && defined(DECODELAB_HAVE_NCCL_H)
  EXPECT_NE(twice.status().ToString().find("one rank per GPU"), std::string::npos) << twice.status().ToString();
#else
  EXPECT_NE(twice.status().ToString().find("no NCCL support"), std::string::npos) << twice.status().ToString();
#endif
}

// Without a usable GPU the in-process device group fails with an error (no crash, no hang).
TEST(DeviceCommunicatorTest, InProcessGroupWithoutAGpuIsAnError) {
  std::string why;
  if (cuda::DeviceCount(&why) > 0) GTEST_SKIP() << "a GPU is usable: tests/gpu/device_comm_gpu_test.cc covers it";
  auto g = DeviceGroup::CreateInProcess({0, 0}, 1024);
  ASSERT_FALSE(g.ok());
  EXPECT_FALSE(g.status().message().empty());
  auto one = DeviceGroup::CreateOneShot({0, 0}, 1024, {});
  ASSERT_FALSE(one.ok());
  EXPECT_FALSE(one.status().message().empty());
}

// The one-shot group's limits are refused before any GPU work: at most 16 ranks (the kernels' flag
// rows), a grid of 1 to 64 blocks.
TEST(DeviceCommunicatorTest, OneShotLimitsAreRefused) {
  auto many = DeviceGroup::CreateOneShot(std::vector<int>(17, 0), 1024, {});
  ASSERT_FALSE(many.ok());
#if defined(DECODELAB_HAVE_CUDA)
  EXPECT_NE(many.status().message().find("17 ranks"), std::string::npos) << many.status().ToString();
  for (int blocks : {0, 65}) {
    DeviceGroup::OneShotOptions o;
    o.blocks = blocks;
    auto g = DeviceGroup::CreateOneShot({0, 0}, 1024, o);
    ASSERT_FALSE(g.ok());
    EXPECT_NE(g.status().message().find("blocks"), std::string::npos) << g.status().ToString();
  }
#endif
}

}  // namespace
}  // namespace dl::comm
