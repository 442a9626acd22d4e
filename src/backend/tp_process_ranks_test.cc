// What rank 0 sends a child rank, without a GPU or a child: the setup message round-trips every field
// a CUDA rank is built from (its options, tuning included, the ranks' devices, the one-shot IPC
// sizes), and a truncated or corrupt setup is refused naming the field. The runs themselves are
// tests/reference/tp_processes_cpu_test.cc (CPU) and tests/gpu/cuda_tp_gpu_test.cc (CUDA).
#include "backend/tp_process_ranks.h"

#include <gtest/gtest.h>

#include "model/checkpoint.h"
#include "model/shapes.h"

namespace dl {
namespace {

TpRankSetup CudaSetup() {
  TpRankSetup s;
  s.backend = TpRankBackend::kCuda;
  s.tp_size = 3;
  s.rank = 2;
  s.embedding = EmbeddingMode::kVocabParallel;
  s.kv.num_layers = 2;
  s.kv.num_kv_heads = 4;
  s.kv.head_dim = 32;
  s.kv.page_size = 16;
  s.kv.dtype = DType::kBF16;
  s.kv.layer_groups = {KvGroup::kFull, KvGroup::kSliding};
  s.kv.sliding_window = 64;
  s.kv.pages_full = 40;
  s.kv.pages_sliding = 12;
  s.scales.k = {1.0f, 0.5f};
  s.scales.v = {2.0f, 0.25f};
  s.scales.source = "unit";
  s.num_layers = 2;
  s.hidden_size = 128;
  s.vocab_size = 512;
  s.weights_digest = 0x0123456789abcdefull;
  CudaRunnerOptions& o = s.cuda.options;
  o.allow_fallback = true;
  o.use_graph = false;
  o.max_seq_len = 300;
  o.max_rows = 96;
  o.max_outputs = 7;
  o.max_taps = 0;
  o.synthetic_seed = 99;
  o.skip_ops = {"rope", "moe"};
  EXPECT_TRUE(kernels::SetTuning(&o.tuning, "stream_ring_kb=64").ok());
  EXPECT_TRUE(kernels::SetTuning(&o.tuning, "mma_products=1").ok());
  s.cuda.devices = {0, 1, 0};
  s.cuda.oneshot_capacity = 123456;
  s.cuda.oneshot_blocks = 8;
  return s;
}

TEST(TpProcessRanksTest, ACudaRanksSetupRoundTrips) {
  const TpRankSetup s = CudaSetup();
  auto back = DecodeTpRankSetup(EncodeTpRankSetup(s));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->backend, TpRankBackend::kCuda);
  EXPECT_EQ(back->tp_size, 3);
  EXPECT_EQ(back->rank, 2);
  EXPECT_EQ(back->embedding, EmbeddingMode::kVocabParallel);
  EXPECT_EQ(back->kv.layer_groups, s.kv.layer_groups);
  EXPECT_EQ(back->scales.k, s.scales.k);
  const CudaRunnerOptions& o = back->cuda.options;
  EXPECT_TRUE(o.allow_fallback);
  EXPECT_FALSE(o.use_graph);
  EXPECT_EQ(o.max_seq_len, 300);
  EXPECT_EQ(o.max_rows, 96);
  EXPECT_EQ(o.max_outputs, 7);
  EXPECT_EQ(o.synthetic_seed, 99u);
  EXPECT_EQ(o.skip_ops, s.cuda.options.skip_ops);
  // Every knob, not just the two set: the child's kernels are rank 0's.
  EXPECT_EQ(kernels::TuningString(o.tuning), kernels::TuningString(s.cuda.options.tuning));
  EXPECT_EQ(o.tuning.stream_ring_kb, 64);
  EXPECT_TRUE(o.tuning.mma_products);
  EXPECT_EQ(back->cuda.devices, s.cuda.devices);
  EXPECT_EQ(back->cuda.oneshot_capacity, 123456u);
  EXPECT_EQ(back->weights_digest, 0x0123456789abcdefull);
  EXPECT_EQ(back->cuda.oneshot_blocks, 8);
}

TEST(TpProcessRanksTest, ACpuRanksSetupCarriesNoCudaOptions) {
  TpRankSetup s = CudaSetup();
  s.backend = TpRankBackend::kCpu;
  const std::vector<std::byte> cpu = EncodeTpRankSetup(s);
  EXPECT_LT(cpu.size(), EncodeTpRankSetup(CudaSetup()).size());
  auto back = DecodeTpRankSetup(cpu);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->backend, TpRankBackend::kCpu);
  EXPECT_TRUE(back->cuda.devices.empty());
}

TEST(TpProcessRanksTest, ATruncatedOrCorruptCudaSetupIsRefused) {
  const std::vector<std::byte> bytes = EncodeTpRankSetup(CudaSetup());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto back = DecodeTpRankSetup(std::span<const std::byte>(bytes.data(), n));
    ASSERT_FALSE(back.ok()) << "a setup cut at " << n << " of " << bytes.size() << " bytes was accepted";
    EXPECT_EQ(back.status().code(), StatusCode::kDataLoss) << back.status().ToString();
  }
  // Trailing bytes.
  std::vector<std::byte> longer = bytes;
  longer.push_back(std::byte{0});
  EXPECT_FALSE(DecodeTpRankSetup(longer).ok());
  // A device list that does not match the rank count.
  TpRankSetup s = CudaSetup();
  s.cuda.devices = {0, 0};
  auto back = DecodeTpRankSetup(EncodeTpRankSetup(s));
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("2 devices for 3 ranks"), std::string::npos) << back.status().ToString();
  // An unknown backend.
  std::vector<std::byte> cpu = EncodeTpRankSetup([] {
    TpRankSetup c = CudaSetup();
    c.backend = TpRankBackend::kCpu;
    return c;
  }());
  cpu.back() = std::byte{7};
  back = DecodeTpRankSetup(cpu);
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("unknown backend 7"), std::string::npos) << back.status().ToString();
}

// The digest a child compares with rank 0's: equal for the same weights built twice, different for
// another dtype, FP8 layout or seed.
TEST(TpProcessRanksTest, TheWeightsDigestTellsOtherWeightsApart) {
  auto config = ShapeConfig("tiny");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  Fp8Options fp8;
  fp8.layout = Fp8Layout::kAllLinear;
  Fp8Options fp8_blocks = fp8;
  fp8_blocks.block_rows = fp8_blocks.block_cols = 16;
  auto digest = [&](uint64_t seed, const Fp8Options* f) {
    auto ck = MakeSyntheticCheckpoint(*config, seed, DType::kBF16, f);
    EXPECT_TRUE(ck.ok()) << ck.status().ToString();
    return ck.ok() ? WeightsDigest(*ck) : 0;
  };
  const uint64_t bf16 = digest(7, nullptr);
  EXPECT_EQ(digest(7, nullptr), bf16);
  EXPECT_NE(digest(8, nullptr), bf16);
  const uint64_t f8 = digest(7, &fp8);
  EXPECT_NE(f8, bf16);
  EXPECT_EQ(digest(7, &fp8), f8);
  EXPECT_NE(digest(7, &fp8_blocks), f8);
}

}  // namespace
}  // namespace dl
