// Batch invariance on the CPU reference: a sequence's tokens and logits (greedy and seeded sampling)
// are bit-identical alone and among others, whatever the arrival order, the other sequences' prefill
// chunking and its own (tests/common/batch_schedule.h; the GPU counterpart is in
// tests/gpu/cuda_runner_test.cc).
#include <gtest/gtest.h>

#include "tests/common/batch_schedule.h"

namespace dl {
namespace {

using namespace testing_batch;

TEST(BatchInvarianceCpu, RandomSchedulesGiveEverySequenceItsAloneResult) {
  EngineOptions o;
  o.shape = "tiny";
  o.seed = 3;
  o.backend = BackendKind::kCpu;
  o.max_seq_len = 128;
  o.max_sequences = 6;
  o.page_size = 16;
  auto e = LoadEngine(o);
  ASSERT_TRUE(e.ok()) << e.status().message();
  // Lengths around and beyond tiny's sliding window (8): the window wraps inside prompts and chunks.
  std::vector<std::vector<int32_t>> prompts;
  for (int n : {3, 17, 40, 9, 64, 25}) {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = 30 + (i * 53 + n * 7) % 450;
    prompts.push_back(p);
  }
  const int32_t steps = 10;
  std::vector<SeqTrace> alone;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto a = RunAlone(**e, prompts[i], i, steps, 16);
    ASSERT_TRUE(a.ok()) << a.status().message();
    auto b = RunAlone(**e, prompts[i], i, steps, 5);  // chunking of its own prompt
    ASSERT_TRUE(b.ok()) << b.status().message();
    EXPECT_EQ(Compare(*a, *b), "") << "sequence " << i << ": prefill chunk 16 vs 5";
    alone.push_back(std::move(*a));
  }
  EXPECT_NE(alone[1].tokens, alone[3].tokens);
  for (uint64_t seed : {1u, 2u, 3u}) {
    for (int32_t max_rows : {8, 64}) {
      auto together = RunRandomSchedule(**e, prompts, steps, seed, max_rows);
      ASSERT_TRUE(together.ok()) << together.status().message();
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(Compare(alone[i], (*together)[i]), "")
            << "sequence " << i << ", schedule seed " << seed << ", max rows " << max_rows;
      }
    }
  }
  EXPECT_EQ((*e)->kv->used_pages(KvGroup::kFull) + (*e)->kv->used_pages(KvGroup::kSliding), 0);
}

}  // namespace
}  // namespace dl
