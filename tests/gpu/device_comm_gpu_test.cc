// The in-process device communicator (comm/device_communicator.h) on one GPU: 2 and 3 ranks as threads,
// each with its own stream, sharing the device. AllReduceSum must give every rank the host's
// rank-order FP32 sum bit for bit (FP32: the CPU InProcessGroup's bits; BF16: that sum rounded once),
// run to run; AllGather must place every rank's bytes in rank order. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "base/rng.h"
#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "cuda/buffer.h"
#include "cuda/device.h"
#include "tests/gpu/gpu_skip.h"

namespace dl::comm {
namespace {

// Values whose FP32 sums round differently in different orders: mixed magnitudes and signs.
float ValueAt(int rank, int64_t i, uint64_t seed) {
  // Every 97th element cancels: 2^24, 1, -2^24 on ranks 0, 1, 2 (exact in BF16). In rank order the 1
  // is lost ((2^24 + 1) rounds to 2^24 in FP32, sum 0); in reverse order it survives (sum 1), so an
  // order other than the ranks' shows even after the BF16 rounding of the result.
  if (i % 97 == 0) return rank == 0 ? 16777216.0f : rank == 1 ? 1.0f : rank == 2 ? -16777216.0f : 0.0f;
  const int64_t k = (i + rank) % 3;  // the ranks' magnitudes differ per element
  const float scale = k == 0 ? 1e4f : (k == 1 ? 1.0f : 1e-3f);
  return scale * NormalAt(seed + static_cast<uint64_t>(rank) * 7919, static_cast<uint64_t>(i));
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Runs `collectives` all-reduces on every rank of a one-GPU group (each rank a thread with its own
// stream; between collectives each rank rewrites its input on its stream, so the double-buffered
// staging is exercised) and returns every rank's result of the last one, as FP32 values.
std::vector<std::vector<float>> RunAllReduce(int ranks, int64_t count, DeviceElem elem, int collectives,
                                             uint64_t seed) {
  const size_t eb = DeviceElemBytes(elem);
  auto group = DeviceGroup::CreateInProcess(std::vector<int>(ranks, 0), count * eb, 60.0);
  EXPECT_TRUE(group.ok()) << group.status().ToString();
  if (!group.ok()) return {};
  std::vector<std::vector<float>> results(ranks);
  std::vector<Status> statuses(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      Status& st = statuses[r];
      if (cudaSetDevice(0) != cudaSuccess) return void(st = Internal("cudaSetDevice"));
      auto stream = cuda::Stream::Create();
      auto buf = cuda::DeviceBuffer::Create(count * eb);
      if (!stream.ok() || !buf.ok()) return void(st = Internal("stream or buffer"));
      std::vector<uint8_t> host(count * eb);
      for (int k = 0; k < collectives; ++k) {
        for (int64_t i = 0; i < count; ++i) {
          const float v = ValueAt(r, i, seed + k);
          if (elem == DeviceElem::kF32) {
            std::memcpy(host.data() + i * 4, &v, 4);
          } else {
            const uint16_t b = FloatToBf16(v);
            std::memcpy(host.data() + i * 2, &b, 2);
          }
        }
        // Pageable host memory: the copy is complete when it returns, ordered on the stream.
        if (cudaMemcpyAsync(buf->data(), host.data(), host.size(), cudaMemcpyHostToDevice, stream->get()) !=
            cudaSuccess) {
          return void(st = Internal("upload"));
        }
        st = group.value()->rank(r).AllReduceSum(buf->data(), count, elem, stream->get());
        if (!st.ok()) return;
      }
      if (cudaMemcpyAsync(host.data(), buf->data(), host.size(), cudaMemcpyDeviceToHost, stream->get()) !=
              cudaSuccess ||
          !stream->Synchronize().ok()) {
        return void(st = Internal("download"));
      }
      results[r].resize(count);
      for (int64_t i = 0; i < count; ++i) {
        if (elem == DeviceElem::kF32) {
          std::memcpy(&results[r][i], host.data() + i * 4, 4);
        } else {
          uint16_t b;
          std::memcpy(&b, host.data() + i * 2, 2);
          results[r][i] = Bf16ToFloat(b);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  EXPECT_EQ(group.value()->rank(0).collectives_issued(), collectives);
  return results;
}

void ExpectRankOrderSum(int ranks, DeviceElem elem) {
  SKIP_WITHOUT_GPU();
  const int64_t count = 100003;  // not a multiple of any block size
  const int collectives = 5;
  const uint64_t seed = 1234;
  const auto got = RunAllReduce(ranks, count, elem, collectives, seed);
  ASSERT_EQ(static_cast<int>(got.size()), ranks);
  int64_t differs_from_reverse = 0;
  for (int64_t i = 0; i < count; ++i) {
    std::vector<float> per_rank(ranks);
    for (int r = 0; r < ranks; ++r) {
      const float v = ValueAt(r, i, seed + collectives - 1);
      per_rank[r] = elem == DeviceElem::kBF16 ? RoundBf16(v) : v;
    }
    const float want = RankOrderSum(per_rank, elem);
    std::vector<float> reversed(per_rank.rbegin(), per_rank.rend());
    if (Bits(RankOrderSum(reversed, elem)) != Bits(want)) ++differs_from_reverse;
    for (int r = 0; r < ranks; ++r) {
      ASSERT_EQ(Bits(got[r][i]), Bits(want)) << "rank " << r << " element " << i << ": " << got[r][i] << " vs "
                                             << want;
    }
  }
  // The data is such that the order matters somewhere (for 3 ranks), so the check above pins it.
  if (ranks >= 3) EXPECT_GT(differs_from_reverse, 0);
  // Run to run: the same bits again.
  const auto again = RunAllReduce(ranks, count, elem, collectives, seed);
  ASSERT_EQ(again.size(), got.size());
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(Bits(again[r][i]), Bits(got[r][i]));
  }
}

TEST(DeviceCommGpuTest, AllReduceF32TwoRanksOnOneGpuIsTheRankOrderSum) { ExpectRankOrderSum(2, DeviceElem::kF32); }
TEST(DeviceCommGpuTest, AllReduceF32ThreeRanksOnOneGpuIsTheRankOrderSum) { ExpectRankOrderSum(3, DeviceElem::kF32); }
TEST(DeviceCommGpuTest, AllReduceBf16TwoRanksOnOneGpuIsTheRankOrderSum) { ExpectRankOrderSum(2, DeviceElem::kBF16); }
TEST(DeviceCommGpuTest, AllReduceBf16ThreeRanksOnOneGpuIsTheRankOrderSum) {
  ExpectRankOrderSum(3, DeviceElem::kBF16);
}

// FP32 on the device gives the CPU InProcessGroup's bits (the same rank order, the same rounding).
TEST(DeviceCommGpuTest, AllReduceF32EqualsTheCpuInProcessGroup) {
  SKIP_WITHOUT_GPU();
  const int ranks = 3;
  const int64_t count = 4099;
  const auto device = RunAllReduce(ranks, count, DeviceElem::kF32, 1, 77);
  ASSERT_EQ(static_cast<int>(device.size()), ranks);
  auto cpu = InProcessGroup::Create(ranks, 60.0);
  std::vector<std::vector<float>> host(ranks, std::vector<float>(count));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < count; ++i) host[r][i] = ValueAt(r, i, 77);
    threads.emplace_back([&, r] { EXPECT_TRUE(cpu->rank(r).AllReduceSum(host[r]).ok()); });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(Bits(device[r][i]), Bits(host[r][i])) << "rank " << r << " " << i;
  }
}

TEST(DeviceCommGpuTest, AllGatherPlacesEveryRanksBytesInRankOrder) {
  SKIP_WITHOUT_GPU();
  for (int ranks : {2, 3}) {
    const size_t bytes = 1001;
    auto group = DeviceGroup::CreateInProcess(std::vector<int>(ranks, 0), bytes, 60.0);
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    std::vector<std::vector<uint8_t>> out(ranks);
    std::vector<Status> statuses(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        cudaSetDevice(0);
        auto stream = cuda::Stream::Create();
        auto local = cuda::DeviceBuffer::Create(bytes);
        auto all = cuda::DeviceBuffer::Create(bytes * ranks);
        if (!stream.ok() || !local.ok() || !all.ok()) return void(statuses[r] = Internal("alloc"));
        std::vector<uint8_t> mine(bytes);
        for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<uint8_t>(r * 37 + i * 11);
        if (!local->CopyFromHost(mine.data(), bytes).ok()) return void(statuses[r] = Internal("upload"));
        // Twice: the second lands in the other staging slot.
        for (int k = 0; k < 2 && statuses[r].ok(); ++k) {
          statuses[r] = group.value()->rank(r).AllGather(local->data(), bytes, all->data(), stream->get());
        }
        if (!statuses[r].ok()) return;
        if (!stream->Synchronize().ok()) return void(statuses[r] = Internal("sync"));
        out[r].resize(bytes * ranks);
        if (!all->CopyToHost(out[r].data(), bytes * ranks).ok()) statuses[r] = Internal("download");
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks; ++r) {
      ASSERT_TRUE(statuses[r].ok()) << statuses[r].ToString();
      for (int q = 0; q < ranks; ++q) {
        for (size_t i = 0; i < bytes; ++i) {
          ASSERT_EQ(out[r][q * bytes + i], static_cast<uint8_t>(q * 37 + i * 11)) << "rank " << r << " from " << q;
        }
      }
    }
  }
}

// Sizes the ranks disagree on, or beyond the staging capacity, fail on every rank (no rank hangs).
TEST(DeviceCommGpuTest, MismatchedOrOversizedCollectivesFailOnEveryRank) {
  SKIP_WITHOUT_GPU();
  auto group = DeviceGroup::CreateInProcess({0, 0}, 1024, 10.0);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  auto buf = cuda::DeviceBuffer::Create(4096);
  auto stream = cuda::Stream::Create();
  ASSERT_TRUE(buf.ok() && stream.ok());
  Status s0, s1;
  std::thread t([&] {
    cudaSetDevice(0);
    s1 = group.value()->rank(1).AllReduceSum(buf->data(), 8, DeviceElem::kF32, stream->get());
  });
  s0 = group.value()->rank(0).AllReduceSum(buf->data(), 16, DeviceElem::kF32, stream->get());
  t.join();
  EXPECT_FALSE(s0.ok());
  EXPECT_FALSE(s1.ok());
  EXPECT_NE(s0.message().find("bytes"), std::string::npos) << s0.ToString();

  auto group2 = DeviceGroup::CreateInProcess({0, 0}, 1024, 10.0);
  ASSERT_TRUE(group2.ok());
  std::thread t2([&] {
    cudaSetDevice(0);
    s1 = group2.value()->rank(1).AllReduceSum(buf->data(), 512, DeviceElem::kF32, stream->get());
  });
  s0 = group2.value()->rank(0).AllReduceSum(buf->data(), 512, DeviceElem::kF32, stream->get());
  t2.join();
  EXPECT_FALSE(s0.ok());
  EXPECT_FALSE(s1.ok());
  EXPECT_NE(s0.ToString().find("capacity"), std::string::npos) << s0.ToString();
}

}  // namespace
}  // namespace dl::comm
