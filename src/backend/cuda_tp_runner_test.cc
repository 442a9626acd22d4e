// What CUDA tensor parallelism decides without a GPU: where each rank runs, and which shards it
// refuses before touching a device. The runs themselves are tests/gpu/cuda_tp_gpu_test.cc.
#include "backend/cuda_tp_runner.h"

#include <gtest/gtest.h>

#include "cuda/device.h"
#include "model/checkpoint.h"
#include "model/fp8_layout.h"
#include "model/shapes.h"

namespace dl {
namespace {

ModelConfig Tiny() {
  auto c = ShapeConfig("tiny");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

TensorParallelPlan Plan(const ModelConfig& c, int tp, EmbeddingMode e = EmbeddingMode::kReplicated) {
  auto p = MakeTensorParallelPlan(c, tp, e);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return *p;
}

TEST(CudaTpRunnerTest, RanksShareGpusRoundRobin) {
  EXPECT_EQ(TpRankDevices(2, 1), (std::vector<int>{0, 0}));
  EXPECT_EQ(TpRankDevices(4, 2), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(TpRankDevices(3, 8), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(TpRankDevices(1, 4), (std::vector<int>{0}));
}

// --tp-transport's names round-trip, and an unknown one is refused naming the choices.
TEST(CudaTpRunnerTest, TransportNamesRoundTrip) {
  for (CudaTpTransport t : {CudaTpTransport::kAuto, CudaTpTransport::kDeviceInProcess, CudaTpTransport::kDeviceOneShot,
                            CudaTpTransport::kNccl, CudaTpTransport::kProcesses}) {
    auto back = ParseCudaTpTransport(CudaTpTransportName(t));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, t);
  }
  EXPECT_STREQ(CudaTpTransportName(CudaTpTransport::kDeviceOneShot), "device-oneshot");
  auto bad = ParseCudaTpTransport("oneshot");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("device-oneshot"), std::string::npos) << bad.status().ToString();
}

TEST(CudaTpRunnerTest, ShardsTheKernelsCanRunAreAccepted) {
  const ModelConfig c = Tiny();
  auto ck = MakeSyntheticCheckpoint(c, 1, DType::kBF16, nullptr);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_TRUE(CheckCudaTensorParallel(*ck, Plan(c, 2)).ok()) << CheckCudaTensorParallel(*ck, Plan(c, 2)).ToString();
  EXPECT_TRUE(CheckCudaTensorParallel(*ck, Plan(c, 1)).ok());
  // A vocab-parallel embedding: each rank looks up its rows, one all-reduce completes the rows.
  const Status vp = CheckCudaTensorParallel(*ck, Plan(c, 2, EmbeddingMode::kVocabParallel));
  EXPECT_TRUE(vp.ok()) << vp.ToString();
  // FP8 weights: the shards carry their scales (tests/gpu/cuda_tp_gpu_test.cc runs them).
  Fp8Options fp8;
  fp8.layout = Fp8Layout::kAllLinear;
  auto f8 = MakeSyntheticCheckpoint(c, 1, DType::kBF16, &fp8);
  ASSERT_TRUE(f8.ok()) << f8.status().ToString();
  const Status f8st = CheckCudaTensorParallel(*f8, Plan(c, 2));
  EXPECT_TRUE(f8st.ok()) << f8st.ToString();
}

TEST(CudaTpRunnerTest, ShardsTheKernelsCannotRunAreRefusedNamingTheRank) {
  ModelConfig c = Tiny();
  {
    auto ck = MakeSyntheticCheckpoint(c, 1, DType::kBF16, nullptr);
    ASSERT_TRUE(ck.ok());
    // tiny's shared expert (16) over 4 ranks: slices of 4, not a multiple of 8.
    const Status four = CheckCudaTensorParallel(*ck, Plan(c, 4));
    EXPECT_NE(four.ToString().find("shared_expert_intermediate_size is 4"), std::string::npos) << four.ToString();
    EXPECT_NE(four.ToString().find("rank 0's slices"), std::string::npos) << four.ToString();
  }
  {
    auto shape_only = MakeShapeOnlyCheckpoint(c);
    ASSERT_TRUE(shape_only.ok());
    const Status st = CheckCudaTensorParallel(*shape_only, Plan(c, 2));
    EXPECT_NE(st.ToString().find("shape-only"), std::string::npos) << st.ToString();
  }
  {
    c.shared_expert_intermediate_size = 2;  // over 4 ranks: ranks 2 and 3 hold none of it
    auto ck = MakeSyntheticCheckpoint(c, 1, DType::kBF16, nullptr);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    const Status st = CheckCudaTensorParallel(*ck, Plan(c, 4));
    EXPECT_NE(st.ToString().find("leaves rank 2 an empty slice"), std::string::npos) << st.ToString();
  }
}

TEST(CudaTpRunnerTest, WithoutAGpuCreateSaysSo) {
  std::string why;
  if (cuda::DeviceCount(&why) > 0) GTEST_SKIP() << "a GPU is usable: tests/gpu/cuda_tp_gpu_test.cc runs the ranks";
  const ModelConfig c = Tiny();
  auto ck = MakeSyntheticCheckpoint(c, 1, DType::kBF16, nullptr);
  ASSERT_TRUE(ck.ok());
  KvCacheSpec kv;
  auto r = CudaTpRunner::Create(*ck, kv, {}, CudaRunnerOptions{}, 2, EmbeddingMode::kReplicated);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().ToString().find("no usable GPU"), std::string::npos) << r.status().ToString();
}

}  // namespace
}  // namespace dl
