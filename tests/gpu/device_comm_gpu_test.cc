// The in-process device communicators (comm/device_communicator.h) on one GPU: 2 and 3 ranks as
// threads, each with its own stream, sharing the device. AllReduceSum must give every rank the host's
// rank-order FP32 sum bit for bit (FP32: the CPU InProcessGroup's bits; BF16: that sum rounded once),
// run to run; AllGather must place every rank's bytes in rank order. The one-shot group must do the
// same inside CUDA graphs replayed many times with no host meeting (its epochs live on the device),
// and a rank that never comes must end a spinning peer with an error, not a hang. Skips without a GPU.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "base/rng.h"
#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "comm/process.h"
#include "comm/rank_barrier.h"
#include "comm/tcp_communicator.h"
#include "comm/tcp_group.h"
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

// ---- The one-shot group inside CUDA graphs ----

// Element i of rank r's input in replay k, as the buffer holds it (BF16: rounded).
float InputAt(int rank, int64_t i, uint64_t seed, DeviceElem elem) {
  const float v = ValueAt(rank, i, seed);
  return elem == DeviceElem::kBF16 ? RoundBf16(v) : v;
}

void Upload(const std::vector<float>& values, DeviceElem elem, std::vector<uint8_t>* host) {
  host->resize(values.size() * DeviceElemBytes(elem));
  for (size_t i = 0; i < values.size(); ++i) {
    if (elem == DeviceElem::kF32) {
      std::memcpy(host->data() + i * 4, &values[i], 4);
    } else {
      const uint16_t b = FloatToBf16(values[i]);
      std::memcpy(host->data() + i * 2, &b, 2);
    }
  }
}

float Download(const std::vector<uint8_t>& host, int64_t i, DeviceElem elem) {
  if (elem == DeviceElem::kF32) {
    float f;
    std::memcpy(&f, host.data() + i * 4, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, host.data() + i * 2, 2);
  return Bf16ToFloat(b);
}

// Runs `body(r)` on one thread per rank and returns their statuses (a failed rank aborts the group,
// so no other rank waits for it forever).
std::vector<Status> OnEveryRank(DeviceGroup& group, const std::function<Status(int)>& body) {
  const int n = group.size();
  std::vector<Status> statuses(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      if (cudaSetDevice(0) != cudaSuccess) {
        statuses[r] = Internal("cudaSetDevice");
      } else {
        statuses[r] = body(r);
      }
      if (!statuses[r].ok()) group.rank(r).Abort(statuses[r]);
    });
  }
  for (auto& t : threads) t.join();
  return statuses;
}

// One rank's side of ExpectOneShotInGraphs (and of the ranks-as-processes test): with `capture`, the
// calls captured in one graph, `after_capture` (the ranks' meeting, for threads), then `replays`
// replays; without, the same calls enqueued eagerly each time. Counts wrong elements and bytes into
// `mismatches`, elements whose reversed-order sum differs into `order_sensitive`.
Status CheckOneShotRank(DeviceCommunicator& comm, int r, int ranks, DeviceElem elem, const std::vector<int64_t>& counts,
                        int replays, uint64_t seed, bool capture, const std::function<Status()>& after_capture,
                        int64_t* mismatches, int64_t* order_sensitive) {
  const size_t eb = DeviceElemBytes(elem);
  const size_t gather_bytes = 1001;  // odd: the byte-wide gather
  DL_ASSIGN_OR_RETURN(auto stream, cuda::Stream::Create());
  // One input buffer per all-reduce (so each is checked on its own), the gather's local and out.
  std::vector<cuda::DeviceBuffer> bufs;
  for (int64_t c : counts) {
    DL_ASSIGN_OR_RETURN(auto b, cuda::DeviceBuffer::Create(std::max<size_t>(16, c * eb)));
    bufs.push_back(std::move(b));
  }
  DL_ASSIGN_OR_RETURN(auto local, cuda::DeviceBuffer::Create(gather_bytes));
  DL_ASSIGN_OR_RETURN(auto gathered, cuda::DeviceBuffer::Create(gather_bytes * ranks));
  cudaStream_t s = stream.get();
  auto enqueue = [&]() -> Status {
    DL_RETURN_IF_ERROR(comm.AllReduceSum(bufs[0].data(), counts[0], elem, s));
    DL_RETURN_IF_ERROR(comm.AllGather(local.data(), gather_bytes, gathered.data(), s));
    for (size_t k = 1; k < counts.size(); ++k) DL_RETURN_IF_ERROR(comm.AllReduceSum(bufs[k].data(), counts[k], elem, s));
    return Status::Ok();
  };
  cudaGraphExec_t exec = nullptr;
  Status st;
  if (capture) {
    if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return Internal("begin capture");
    st = enqueue();
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(s, &graph);
    DL_RETURN_IF_ERROR(st);
    if (ended != cudaSuccess) return Internal("end capture: {}", cudaGetErrorString(ended));
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) return Internal("instantiate");
    cudaGraphDestroy(graph);
  }
  // Every rank has captured and instantiated before any replays (as CudaTpRunner does): a rank
  // still setting up must not need the device while a peer's kernel spins. From here on the ranks
  // never meet on the host.
  DL_RETURN_IF_ERROR(after_capture());
  std::vector<uint8_t> host, mine(gather_bytes), all(gather_bytes * ranks);
  for (int k = 0; k < replays && st.ok(); ++k) {
    for (size_t b = 0; b < counts.size(); ++b) {
      std::vector<float> in(counts[b]);
      for (int64_t i = 0; i < counts[b]; ++i) in[i] = InputAt(r, i, seed + 31 * k + b, elem);
      Upload(in, elem, &host);
      DL_RETURN_IF_ERROR(bufs[b].CopyFromHost(host.data(), host.size()));
    }
    for (size_t i = 0; i < gather_bytes; ++i) mine[i] = static_cast<uint8_t>(r * 37 + i * 11 + k);
    DL_RETURN_IF_ERROR(local.CopyFromHost(mine.data(), gather_bytes));
    if (capture) {
      if (cudaGraphLaunch(exec, s) != cudaSuccess) return Internal("launch");
    } else {
      DL_RETURN_IF_ERROR(enqueue());
    }
    DL_RETURN_IF_ERROR(stream.Synchronize());
    DL_RETURN_IF_ERROR(comm.DeviceError());
    for (size_t b = 0; b < counts.size(); ++b) {
      host.resize(counts[b] * eb);
      DL_RETURN_IF_ERROR(bufs[b].CopyToHost(host.data(), host.size()));
      for (int64_t i = 0; i < counts[b]; ++i) {
        std::vector<float> per_rank(ranks);
        for (int q = 0; q < ranks; ++q) per_rank[q] = InputAt(q, i, seed + 31 * k + b, elem);
        const float want = RankOrderSum(per_rank, elem);
        if (Bits(Download(host, i, elem)) != Bits(want)) ++*mismatches;
        std::vector<float> reversed(per_rank.rbegin(), per_rank.rend());
        if (Bits(RankOrderSum(reversed, elem)) != Bits(want)) ++*order_sensitive;
      }
    }
    DL_RETURN_IF_ERROR(gathered.CopyToHost(all.data(), all.size()));
    for (int q = 0; q < ranks; ++q) {
      for (size_t i = 0; i < gather_bytes; ++i) {
        if (all[q * gather_bytes + i] != static_cast<uint8_t>(q * 37 + i * 11 + k)) ++*mismatches;
      }
    }
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  return st;
}

// A captured graph per rank holding, in order: the all-reduce of `counts[0]` elements, an all-gather
// of 1001 bytes, the all-reduces of counts[1..] (in place on prefixes of one buffer; every call
// advances the epochs, so calls alternate slots within a replay too). Each rank's thread then replays
// it `replays` times on its own, with no host meeting: before each replay it uploads that replay's
// inputs, after it downloads and checks every element against RankOrderSum of that replay's inputs,
// and the gathered bytes. Every rank must see the same bits. With `two_shot_min_bytes`, the
// all-reduces of at least that many bytes take the two-shot kernel, the others one-shot, in one graph.
void ExpectOneShotInGraphs(int ranks, DeviceElem elem, const std::vector<int64_t>& counts, int replays,
                           size_t two_shot_min_bytes = 0) {
  SKIP_WITHOUT_GPU();
  const size_t eb = DeviceElemBytes(elem);
  const int64_t max_count = *std::max_element(counts.begin(), counts.end());
  const size_t gather_bytes = 1001;  // odd: the byte-wide gather
  DeviceGroup::OneShotOptions o;
  // The capacity holds the largest collective: the widest all-reduce or the gather's per-rank bytes.
  const size_t capacity = std::max<size_t>(max_count * eb, gather_bytes);
  o.capacity_bytes = capacity;
  o.two_shot_min_bytes = two_shot_min_bytes;
  auto group = DeviceGroup::CreateOneShot(std::vector<int>(ranks, 0), capacity, o, 60.0);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  ASSERT_EQ(group.value()->rank(0).transport(), "device-oneshot");
  EXPECT_EQ(group.value()->rank(0).all_reduce_rule(),
            two_shot_min_bytes > 0 ? fmt::format("two-shot>={}", two_shot_min_bytes) : "");
  ASSERT_TRUE(group.value()->rank(0).capturable());
  const uint64_t seed = 900 + ranks;
  std::vector<int64_t> mismatches(ranks, 0), order_sensitive(ranks, 0);
  RankBarrier captured(ranks, 60.0, "test ranks");
  auto run = [&](int r) -> Status {
    return CheckOneShotRank(group.value()->rank(r), r, ranks, elem, counts, replays, seed, /*capture=*/true,
                            [&] { return captured.Arrive(r, "captured"); }, &mismatches[r], &order_sensitive[r]);
  };
  const auto statuses = OnEveryRank(**group, [&](int r) {
    Status st = run(r);
    if (!st.ok()) captured.Abort(r, st);  // no peer waits at the test's meeting for a failed rank
    return st;
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
    EXPECT_EQ(mismatches[r], 0) << "rank " << r;
    // The data makes the order matter (3 ranks: the planted 2^24, 1, -2^24), so equality pins it.
    if (ranks >= 3) {
      EXPECT_GT(order_sensitive[r], 0) << "rank " << r;
    }
    // Collectives count when recorded, not when replayed.
    EXPECT_EQ(group.value()->rank(r).collectives_issued(), static_cast<int64_t>(counts.size()) + 1);
  }
}

// Sizes: odd counts (the scalar tail after 16-byte units, a count below one unit, one element) and
// the largest, in one graph, replayed 40 times (each replay advances every block's epoch 5 times).
TEST(DeviceCommGpuTest, OneShotBf16TwoRanksInAGraphIsTheRankOrderSum) {
  ExpectOneShotInGraphs(2, DeviceElem::kBF16, {100003, 1, 7, 4099}, 40);
}
TEST(DeviceCommGpuTest, OneShotBf16ThreeRanksInAGraphIsTheRankOrderSum) {
  ExpectOneShotInGraphs(3, DeviceElem::kBF16, {100003, 1, 7, 4099}, 40);
}
TEST(DeviceCommGpuTest, OneShotF32TwoRanksInAGraphIsTheRankOrderSum) {
  ExpectOneShotInGraphs(2, DeviceElem::kF32, {65537, 3, 1024}, 40);
}
TEST(DeviceCommGpuTest, OneShotF32ThreeRanksInAGraphIsTheRankOrderSum) {
  ExpectOneShotInGraphs(3, DeviceElem::kF32, {65537, 3, 1024}, 40);
}

// The two-shot kernel (each rank sums the units it owns, then every rank copies each unit from its
// owner) gives the one-shot's bits: the same checks against RankOrderSum, with the large sizes on
// two-shot and the small ones on one-shot in the same graph (the two kinds share flags and epochs),
// at 2, 3 and 4 ranks (4: the units' owners rotate over more ranks than some threads have units).
TEST(DeviceCommGpuTest, TwoShotBf16TwoRanksInAGraphIsTheRankOrderSum) {
  ExpectOneShotInGraphs(2, DeviceElem::kBF16, {100003, 1, 7, 4099}, 40, /*two_shot_min_bytes=*/1000);
}
TEST(DeviceCommGpuTest, TwoShotBf16ThreeRanksInAGraphIsTheRankOrderSum) {
  ExpectOneShotInGraphs(3, DeviceElem::kBF16, {100003, 1, 7, 4099}, 40, /*two_shot_min_bytes=*/1000);
}
TEST(DeviceCommGpuTest, TwoShotF32FourRanksInAGraphIsTheRankOrderSum) {
  ExpectOneShotInGraphs(4, DeviceElem::kF32, {65537, 3, 1024, 200001}, 40, /*two_shot_min_bytes=*/4096);
}
// Every size on two-shot, a tiny graph replayed 1,000 times (two meetings per call).
TEST(DeviceCommGpuTest, TwoShotSurvivesAThousandReplays) {
  ExpectOneShotInGraphs(3, DeviceElem::kBF16, {9, 4100}, 1000, /*two_shot_min_bytes=*/1);
}

// Many replays of a tiny graph (the epochs' parity alternates 1,000 times; ranks never meet on the host).
TEST(DeviceCommGpuTest, OneShotSurvivesAThousandReplays) { ExpectOneShotInGraphs(2, DeviceElem::kBF16, {9}, 1000); }

// Outside a capture the one-shot group takes the host-meeting path: the same bits, and sizes above the
// one-shot capacity work there; inside a capture such a size is a clear error on every rank.
TEST(DeviceCommGpuTest, OneShotGroupEagerPathAndCapacity) {
  SKIP_WITHOUT_GPU();
  DeviceGroup::OneShotOptions o;
  o.capacity_bytes = 1024;
  auto group = DeviceGroup::CreateOneShot({0, 0}, 8192, o, 10.0);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  const int64_t count = 1000;  // 4000 F32 bytes: above the one-shot capacity, within the staging
  std::vector<std::vector<float>> got(2);
  auto eager = OnEveryRank(**group, [&](int r) -> Status {
    DL_ASSIGN_OR_RETURN(auto stream, cuda::Stream::Create());
    DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(count * 4));
    std::vector<float> in(count);
    for (int64_t i = 0; i < count; ++i) in[i] = ValueAt(r, i, 5);
    DL_RETURN_IF_ERROR(buf.CopyFromHost(in.data(), count * 4));
    DL_RETURN_IF_ERROR(group.value()->rank(r).AllReduceSum(buf.data(), count, DeviceElem::kF32, stream.get()));
    DL_RETURN_IF_ERROR(stream.Synchronize());
    got[r].resize(count);
    return buf.CopyToHost(got[r].data(), count * 4);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(eager[r].ok()) << eager[r].ToString();
    for (int64_t i = 0; i < count; ++i) {
      ASSERT_EQ(Bits(got[r][i]), Bits(RankOrderSum({ValueAt(0, i, 5), ValueAt(1, i, 5)}, DeviceElem::kF32)));
    }
  }
  auto captured = OnEveryRank(**group, [&](int r) -> Status {
    DL_ASSIGN_OR_RETURN(auto stream, cuda::Stream::Create());
    DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(count * 4));
    if (cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      return Internal("begin capture");
    }
    Status st = group.value()->rank(r).AllReduceSum(buf.data(), count, DeviceElem::kF32, stream.get());
    cudaGraph_t graph = nullptr;
    (void)cudaStreamEndCapture(stream.get(), &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return st;
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(captured[r].ok()) << "rank " << r;
    EXPECT_NE(captured[r].ToString().find("one-shot capacity"), std::string::npos) << captured[r].ToString();
  }
}

// A rank that never replays: its peer's one-shot kernel gives up after the group's timeout (a
// DeadlineExceeded from DeviceError, not a hang); and a group aborted from the host releases a peer
// that is spinning at once.
TEST(DeviceCommGpuTest, OneShotWaitsEndOnTimeoutAndOnAbort) {
  SKIP_WITHOUT_GPU();
  for (const bool abort : {false, true}) {
    SCOPED_TRACE(abort ? "abort" : "timeout");
    DeviceGroup::OneShotOptions o;
    o.capacity_bytes = 4096;
    auto group = DeviceGroup::CreateOneShot({0, 0}, 4096, o, 2.0);
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    std::vector<cudaGraphExec_t> execs(2, nullptr);
    std::vector<cuda::Stream> streams(2);
    std::vector<cuda::DeviceBuffer> bufs(2);
    auto captured = OnEveryRank(**group, [&](int r) -> Status {
      DL_ASSIGN_OR_RETURN(streams[r], cuda::Stream::Create());
      DL_ASSIGN_OR_RETURN(bufs[r], cuda::DeviceBuffer::Create(4096));
      DL_RETURN_IF_ERROR(bufs[r].Fill(0));
      if (cudaStreamBeginCapture(streams[r].get(), cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        return Internal("begin capture");
      }
      Status st = group.value()->rank(r).AllReduceSum(bufs[r].data(), 1024, DeviceElem::kBF16, streams[r].get());
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(streams[r].get(), &graph);
      DL_RETURN_IF_ERROR(st);
      if (ended != cudaSuccess || cudaGraphInstantiate(&execs[r], graph, 0) != cudaSuccess) return Internal("graph");
      cudaGraphDestroy(graph);
      return Status::Ok();
    });
    ASSERT_TRUE(captured[0].ok() && captured[1].ok()) << captured[0].ToString() << " / " << captured[1].ToString();
    // Only rank 0 replays.
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(cudaGraphLaunch(execs[0], streams[0].get()), cudaSuccess);
    if (abort) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      group.value()->rank(1).Abort(Internal("rank 1 gave up"));
    }
    ASSERT_TRUE(streams[0].Synchronize().ok());
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const Status err = group.value()->rank(0).DeviceError();
    ASSERT_FALSE(err.ok());
    EXPECT_EQ(err.code(), abort ? StatusCode::kCancelled : StatusCode::kDeadlineExceeded) << err.ToString();
    if (abort) {
      EXPECT_LT(waited, 1.5) << "the abort should end the wait well before the 2 s timeout";
    } else {
      EXPECT_GE(waited, 1.9);
    }
    EXPECT_TRUE(group.value()->rank(1).DeviceError().ok()) << "rank 1 never ran";
    for (auto e : execs) cudaGraphExecDestroy(e);
  }
}

// ---- Ranks as processes: CreateOneShotIpcRank ----------------------------------------------------
//
// Rank 0 is this test; ranks 1.. are this binary re-executed (`__ipc-rank`, main() below), meeting
// rank 0 over a TcpGroup on 127.0.0.1 for the handle exchange only. Every rank runs
// CheckOneShotRank on its own (no host meeting after the exchange) and checks its own results
// against RankOrderSum; a child's verdict is its exit code. On one GPU the ranks' kernels are in
// different contexts, which the GPU time-slices (no MPS): a spinning rank waits for the switch to
// its peer's context, so this is slow, and it is the correctness of that case that is tested.

const std::vector<int64_t> kIpcCounts = {100003, 1, 7, 4099};

DeviceGroup::OneShotOptions IpcOptions(DeviceElem elem) {
  DeviceGroup::OneShotOptions o;
  o.capacity_bytes = std::max<size_t>(100003 * DeviceElemBytes(elem), 1001);
  return o;
}

// mode: "graph" (captured, replayed), "eager" (the same calls enqueued directly), "abort" (rank 0
// enqueues one all-reduce; the other ranks abort instead of joining).
Status RunIpcRank(int rank, int ranks, Communicator& host, DeviceElem elem, const std::string& mode, int replays,
                  int64_t* mismatches, int64_t* order_sensitive) {
  if (cudaSetDevice(0) != cudaSuccess) return Internal("cudaSetDevice(0)");
  // The abort case's timeout is short: a wait that the peer's abort did not end fails soon.
  auto ipc = CreateOneShotIpcRank(rank, ranks, 0, IpcOptions(elem), mode == "abort" ? 15.0 : 60.0, ExchangeOver(host));
  if (!ipc.ok()) {
    host.Abort(ipc.status());
    return ipc.status();
  }
  DeviceCommunicator& comm = **ipc;
  if (comm.transport() != "device-oneshot-ipc") return Internal("transport {}", comm.transport());
  if (mode == "abort") {
    if (rank != 0) {
      comm.Abort(Status(StatusCode::kCancelled, "test abort"));
      // Stay until rank 0 has seen it (the exchange's TCP group is the meeting).
      std::vector<float> one = {1.0f};
      return host.AllReduceSum(one);
    }
    DL_ASSIGN_OR_RETURN(auto stream, cuda::Stream::Create());
    DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(64));
    const auto t0 = std::chrono::steady_clock::now();
    DL_RETURN_IF_ERROR(comm.AllReduceSum(buf.data(), 16, elem, stream.get()));
    DL_RETURN_IF_ERROR(stream.Synchronize());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const Status device = comm.DeviceError();
    std::vector<float> one = {1.0f};
    DL_RETURN_IF_ERROR(host.AllReduceSum(one));
    if (device.code() != StatusCode::kCancelled) return Internal("rank 0's wait ended with {}", device.ToString());
    if (s > 30.0) return Internal("rank 0's wait took {} s: the peer's abort did not reach it", s);
    std::printf("[ipc] rank 0 left its wait after %.3f s: %s\n", s, device.ToString().c_str());
    return Status::Ok();
  }
  Status st = CheckOneShotRank(comm, rank, ranks, elem, kIpcCounts, replays, 1200 + ranks, mode == "graph",
                               [] { return Status::Ok(); }, mismatches, order_sensitive);
  if (!st.ok()) comm.Abort(st);
  // Collectives count when recorded (graph) or enqueued (eager).
  const int64_t per_pass = static_cast<int64_t>(kIpcCounts.size()) + 1;
  const int64_t want = mode == "graph" ? per_pass : per_pass * replays;
  if (st.ok() && comm.collectives_issued() != want) {
    return Internal("rank {} counted {} collectives, not {}", rank, comm.collectives_issued(), want);
  }
  return st;
}

// The child's side: `__ipc-rank RANK RANKS PORT ELEM MODE REPLAYS`.
int IpcRankMain(const std::vector<std::string>& a) {
  if (a.size() != 6) {
    std::fprintf(stderr, "__ipc-rank: 6 arguments expected\n");
    return 2;
  }
  const int rank = std::stoi(a[0]), ranks = std::stoi(a[1]), port = std::stoi(a[2]);
  const DeviceElem elem = a[3] == "f32" ? DeviceElem::kF32 : DeviceElem::kBF16;
  auto group = TcpGroup::Create(rank, ranks, -1, Endpoint{"127.0.0.1", port}, DeadlineIn(60));
  if (!group.ok()) {
    std::fprintf(stderr, "__ipc-rank %d: %s\n", rank, group.status().ToString().c_str());
    return 1;
  }
  TcpCommunicator host(std::move(group).value(), 60.0);
  int64_t mismatches = 0, order_sensitive = 0;
  const Status st = RunIpcRank(rank, ranks, host, elem, a[4], std::stoi(a[5]), &mismatches, &order_sensitive);
  std::printf("[ipc] rank %d (process %d): %s, %lld mismatches, %lld order-sensitive elements\n", rank, ::getpid(),
              st.ToString().c_str(), static_cast<long long>(mismatches), static_cast<long long>(order_sensitive));
  if (!st.ok()) host.Abort(st);
  return st.ok() && mismatches == 0 ? 0 : 1;
}

void ExpectOneShotIpc(int ranks, DeviceElem elem, const std::string& mode, int replays) {
  SKIP_WITHOUT_GPU();
  auto listener = Listen("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  const int port = listener->port;
  std::vector<ChildProcess> children;
  for (int r = 1; r < ranks; ++r) {
    SpawnSpec spec;
    spec.exe = "/proc/self/exe";
    spec.argv = {"device_comm_gpu_test", "__ipc-rank", std::to_string(r), std::to_string(ranks), std::to_string(port),
                 DeviceElemName(elem), mode, std::to_string(replays)};
    spec.env = EnvironmentWith({});
    spec.output_fd = 2;
    auto child = ChildProcess::Spawn(spec);
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    children.push_back(std::move(child).value());
  }
  auto group = TcpGroup::Create(0, ranks, listener->fd, Endpoint{"127.0.0.1", port}, DeadlineIn(60));
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  TcpCommunicator host(std::move(group).value(), 60.0);
  int64_t mismatches = 0, order_sensitive = 0;
  const Status st = RunIpcRank(0, ranks, host, elem, mode, replays, &mismatches, &order_sensitive);
  if (!st.ok()) host.Abort(st);
  EXPECT_TRUE(st.ok()) << "rank 0: " << st.ToString();
  EXPECT_EQ(mismatches, 0) << "rank 0";
  if (ranks >= 3 && mode != "abort") {
    EXPECT_GT(order_sensitive, 0);
  }
  for (size_t i = 0; i < children.size(); ++i) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!children[i].Poll() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!children[i].reaped()) children[i].KillAndReap();
    EXPECT_TRUE(children[i].exit_info().exited && children[i].exit_info().code == 0)
        << "rank " << i + 1 << ": " << children[i].exit_info().ToString() << " (its output is above)";
  }
  std::printf("[ipc] %d ranks as processes, %s, %s, %d replays: rank 0 %lld mismatches\n", ranks, DeviceElemName(elem),
              mode.c_str(), replays, static_cast<long long>(mismatches));
}

TEST(DeviceCommGpuTest, OneShotIpcBf16TwoProcessesInAGraphIsTheRankOrderSum) {
  ExpectOneShotIpc(2, DeviceElem::kBF16, "graph", 40);
}
TEST(DeviceCommGpuTest, OneShotIpcF32ThreeProcessesInAGraphIsTheRankOrderSum) {
  ExpectOneShotIpc(3, DeviceElem::kF32, "graph", 20);
}
TEST(DeviceCommGpuTest, OneShotIpcBf16TwoProcessesEagerIsTheRankOrderSum) {
  ExpectOneShotIpc(2, DeviceElem::kBF16, "eager", 10);
}
TEST(DeviceCommGpuTest, OneShotIpcAPeersAbortEndsRankZerosWait) { ExpectOneShotIpc(2, DeviceElem::kBF16, "abort", 1); }

}  // namespace
}  // namespace dl::comm

// Ranks 1.. of the ranks-as-processes tests are this binary: `device_comm_gpu_test __ipc-rank ...`.
int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "__ipc-rank") {
    const int code = dl::comm::IpcRankMain(std::vector<std::string>(argv + 2, argv + argc));
    std::fflush(nullptr);
    ::_exit(code);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
