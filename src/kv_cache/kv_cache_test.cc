#include "kv_cache/kv_cache.h"

#include <cstdio>
#include <random>

#include <gtest/gtest.h>

#include "kv_cache/host_kv_storage.h"
#include "kv_cache/kv_scales.h"

namespace dl {
namespace {

KvCacheSpec TwoGroupSpec(int32_t page_size, int32_t window, int32_t pages) {
  KvCacheSpec s;
  s.num_layers = 3;
  s.num_kv_heads = 2;
  s.head_dim = 4;
  s.page_size = page_size;
  s.dtype = DType::kF32;
  s.layer_groups = {KvGroup::kFull, KvGroup::kSliding, KvGroup::kSliding};
  s.sliding_window = window;
  s.pages_full = pages;
  s.pages_sliding = pages;
  return s;
}

TEST(PageAllocatorTest, ReusesLowestFreePageFirstAndRejectsDoubleFree) {
  PageAllocator a(4);
  EXPECT_EQ(*a.Allocate(), 0);
  EXPECT_EQ(*a.Allocate(), 1);
  EXPECT_EQ(*a.Allocate(), 2);
  ASSERT_TRUE(a.Free(1).ok());
  EXPECT_EQ(a.free_count(), 2);
  EXPECT_EQ(*a.Allocate(), 1);
  EXPECT_EQ(*a.Allocate(), 3);
  EXPECT_FALSE(a.Allocate().ok());
  ASSERT_TRUE(a.Free(3).ok());
  EXPECT_FALSE(a.Free(3).ok());
  EXPECT_FALSE(a.Free(17).ok());
}

TEST(KvCacheTest, RejectsBadPageSize) {
  auto spec = TwoGroupSpec(24, 8, 4);
  EXPECT_FALSE(KvCache::Create(spec).ok());
}

TEST(KvCacheTest, SlidingGroupDropsPagesOutsideTheWindow) {
  // Window 8 keys (7 past + current), pages of 16: after 40 tokens, positions >= 33 are live, so
  // pages 0 (0-15) and 1 (16-31) are dead and page 2 (32-47) is live.
  auto cache = KvCache::Create(TwoGroupSpec(16, 8, 8));
  ASSERT_TRUE(cache.ok());
  SequenceKv seq;
  for (int step = 0; step < 40; ++step) {
    ASSERT_TRUE(cache->Reserve(seq, 1).ok());
    ASSERT_TRUE(cache->Commit(seq, 1).ok());
  }
  EXPECT_EQ(seq.length(), 40);
  const auto& sliding = seq.block_table(KvGroup::kSliding);
  ASSERT_EQ(sliding.size(), 3u);
  EXPECT_EQ(sliding[0], -1);
  EXPECT_EQ(sliding[1], -1);
  EXPECT_GE(sliding[2], 0);
  EXPECT_EQ(seq.block_table(KvGroup::kFull).size(), 3u);
  EXPECT_EQ(cache->used_pages(KvGroup::kFull), 3);
  EXPECT_EQ(cache->used_pages(KvGroup::kSliding), 1);
  ASSERT_TRUE(cache->Release(seq).ok());
  EXPECT_EQ(cache->used_pages(KvGroup::kFull), 0);
  EXPECT_EQ(cache->used_pages(KvGroup::kSliding), 0);
  EXPECT_EQ(seq.length(), 0);
}

TEST(KvCacheTest, FailedReserveChangesNothing) {
  auto cache = KvCache::Create(TwoGroupSpec(16, 1000, 2));
  ASSERT_TRUE(cache.ok());
  SequenceKv seq;
  ASSERT_TRUE(cache->Reserve(seq, 20).ok());
  ASSERT_TRUE(cache->Commit(seq, 20).ok());
  EXPECT_FALSE(cache->Reserve(seq, 20).ok());  // needs 3 pages per group, 2 exist
  EXPECT_EQ(seq.block_table(KvGroup::kFull).size(), 2u);
  EXPECT_EQ(seq.block_table(KvGroup::kSliding).size(), 2u);
  EXPECT_EQ(cache->used_pages(KvGroup::kFull), 2);
  EXPECT_EQ(cache->used_pages(KvGroup::kSliding), 2);
}

TEST(KvCacheTest, SlidingPagesNeededCoversChunkedWrites) {
  // Simulate chunked writes and check the sliding group never holds more than the bound.
  for (int32_t P : {16, 32, 64}) {
    for (int32_t W : {8, 100, 512}) {
      for (int32_t chunk : {1, 7, 64}) {
        const int32_t max_len = 700;
        const int32_t bound = PagesNeededSliding(max_len, W, chunk, P);
        auto cache = KvCache::Create(TwoGroupSpec(P, W, 64));
        ASSERT_TRUE(cache.ok());
        SequenceKv seq;
        int32_t peak = 0;
        while (seq.length() < max_len) {
          const int32_t n = std::min(chunk, max_len - seq.length());
          ASSERT_TRUE(cache->Reserve(seq, n).ok());
          peak = std::max(peak, cache->used_pages(KvGroup::kSliding));
          ASSERT_TRUE(cache->Commit(seq, n).ok());
        }
        EXPECT_LE(peak, bound) << "P=" << P << " W=" << W << " chunk=" << chunk;
      }
    }
  }
}

// Speculative decoding's rollback: a verify reserves 1 + K positions, writes them all and commits
// only the accepted ones. The pages reserved beyond the committed length stay in the block tables
// (the next reserve reuses them, so their ids do not change and nothing leaks); the sliding group
// frees pages only from the committed length, so every key a future query can see keeps its page;
// and the sliding pool bound for chunks of K + 1 still holds.
TEST(KvCacheTest, CommittingFewerRowsThanReservedRollsBackCleanly) {
  std::mt19937 rng(5);
  for (int32_t P : {16, 32, 64}) {
    for (int32_t W : {8, 100}) {
      for (int32_t K : {2, 4, 8, 15}) {
        const int32_t max_len = 600;
        const int32_t bound = PagesNeededSliding(max_len, W, K + 1, P);
        auto cache = KvCache::Create(TwoGroupSpec(P, W, 64));
        ASSERT_TRUE(cache.ok());
        SequenceKv seq;
        ASSERT_TRUE(cache->Reserve(seq, 20).ok());  // a prompt
        ASSERT_TRUE(cache->Commit(seq, 20).ok());
        int32_t peak = 0;
        while (seq.length() + K + 1 <= max_len) {
          ASSERT_TRUE(cache->Reserve(seq, K + 1).ok());
          const auto full_before = seq.block_table(KvGroup::kFull);
          const auto sliding_before = seq.block_table(KvGroup::kSliding);
          peak = std::max(peak, cache->used_pages(KvGroup::kSliding));
          const int32_t kept = 1 + static_cast<int32_t>(rng() % static_cast<uint32_t>(K + 1));
          ASSERT_TRUE(cache->Commit(seq, kept).ok());
          const int32_t len = seq.length();
          // Reserving the next verify again: the rejected rows' pages are the same pages.
          ASSERT_TRUE(cache->Reserve(seq, K + 1).ok());
          const auto& full = seq.block_table(KvGroup::kFull);
          const auto& sliding = seq.block_table(KvGroup::kSliding);
          for (size_t i = 0; i < full_before.size(); ++i) ASSERT_EQ(full[i], full_before[i]);
          for (size_t i = 0; i < sliding_before.size(); ++i) {
            if (sliding[i] >= 0) ASSERT_EQ(sliding[i], sliding_before[i]);
          }
          // Every position the next verify's rows can see (from len - W + 1) or write has its page.
          for (int32_t pos = std::max(0, len - W + 1); pos < len + K + 1; ++pos) {
            ASSERT_GE(LocatePosition(sliding, P, pos).page, 0) << "pos " << pos << " len " << len;
            ASSERT_GE(LocatePosition(full, P, pos).page, 0) << "pos " << pos;
          }
          EXPECT_EQ(cache->used_pages(KvGroup::kFull), static_cast<int32_t>(full.size()));
          EXPECT_EQ(cache->used_pages(KvGroup::kSliding), seq.pages_held() - static_cast<int32_t>(full.size()));
        }
        EXPECT_LE(peak, bound) << "P=" << P << " W=" << W << " K=" << K;
        ASSERT_TRUE(cache->Release(seq).ok());
        EXPECT_EQ(cache->used_pages(KvGroup::kFull), 0);
        EXPECT_EQ(cache->used_pages(KvGroup::kSliding), 0);
      }
    }
  }
}

TEST(HostKvStorageTest, RoundTripsPerDtype) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF8E4M3}) {
    auto spec = TwoGroupSpec(16, 8, 4);
    spec.dtype = dt;
    KvScales scales = KvScales::Unit(3);
    scales.k[1] = 0.02f;
    scales.v[1] = 0.03f;
    HostKvStorage st(spec, scales);
    std::vector<float> k(8), v(8), k2(8), v2(8);
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    st.Write(1, {2, 5}, k.data(), v.data());
    st.Read(1, {2, 5}, k2.data(), v2.data());
    for (int i = 0; i < 8; ++i) {
      if (dt == DType::kF32) {
        EXPECT_EQ(k2[i], k[i]);
      } else if (dt == DType::kBF16) {
        EXPECT_EQ(k2[i], RoundBf16(k[i]));
      } else {
        EXPECT_EQ(k2[i], Fp8E4M3ToFloat(FloatToFp8E4M3(k[i] / 0.02f)) * 0.02f);
        EXPECT_EQ(v2[i], Fp8E4M3ToFloat(FloatToFp8E4M3(v[i] / 0.03f)) * 0.03f);
        EXPECT_NEAR(k2[i], k[i], std::fabs(k[i]) * 0.07f + 0.02f);
      }
    }
  }
}

TEST(KvScalesTest, FileRoundTripIsBitExactAndBadFilesAreRejected) {
  KvScales s;
  s.k = {0.1f, 1.0f / 3.0f, 7.5e-5f};
  s.v = {0.25f, 2.0f / 7.0f, 3.0e-3f};
  const std::string path = ::testing::TempDir() + "/scales.json";
  ASSERT_TRUE(WriteKvScalesFile(path, s, "test", {{"name", "unit"}}).ok());
  auto back = ReadKvScalesFile(path, 3);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->BitwiseEqual(s));
  EXPECT_FALSE(ReadKvScalesFile(path, 4).ok());
  EXPECT_FALSE(ReadKvScalesFile(::testing::TempDir() + "/missing.json", 3).ok());
  // A scales "file" that is a device is refused by its type, not read without end.
  auto dev = ReadKvScalesFile("/dev/zero", 3);
  ASSERT_FALSE(dev.ok());
  EXPECT_NE(dev.status().message().find("not a regular file"), std::string::npos)
      << dev.status().message();
  {
    FILE* f = std::fopen(path.c_str(), "w");
    std::fputs("{\"format\": \"decodelab-kv-scales\", \"layers\": [{\"layer\": 0, \"k_scale\": -1, "
               "\"v_scale\": 1}]}", f);
    std::fclose(f);
  }
  auto bad = ReadKvScalesFile(path, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("positive"), std::string::npos);
  EXPECT_EQ(Fp8ScaleFromAmax(0.0f), 1.0f);
  EXPECT_EQ(Fp8ScaleFromAmax(448.0f), 1.0f);
}


TEST(KvCacheRefcountTest, SharedPrefixPagesReturnOnlyWithTheirLastReference) {
  auto cache = KvCache::Create(TwoGroupSpec(16, 8, 8));
  ASSERT_TRUE(cache.ok());
  SequenceKv a;
  ASSERT_TRUE(cache->Reserve(a, 32).ok());
  ASSERT_TRUE(cache->Commit(a, 32).ok());
  // Window 8: after 32 tokens the sliding group keeps only page 1 (positions 25..31 are live).
  const auto full = a.block_table(KvGroup::kFull);
  const auto sliding = a.block_table(KvGroup::kSliding);
  ASSERT_EQ(full.size(), 2u);
  ASSERT_EQ(sliding.size(), 2u);
  EXPECT_EQ(sliding[0], -1);
  ASSERT_GE(sliding[1], 0);
  // A cache entry keeps its own references.
  for (int32_t p : full) ASSERT_TRUE(cache->RetainPage(KvGroup::kFull, p).ok());
  ASSERT_TRUE(cache->RetainPage(KvGroup::kSliding, sliding[1]).ok());
  EXPECT_EQ(cache->page_refs(KvGroup::kFull, full[0]), 2);

  SequenceKv b;
  ASSERT_TRUE(cache->AttachPrefix(b, 32, full, sliding).ok());
  EXPECT_EQ(b.length(), 32);
  EXPECT_EQ(cache->page_refs(KvGroup::kFull, full[1]), 3);
  EXPECT_EQ(cache->used_pages(KvGroup::kFull), 2);
  // b grows into a page of its own; the shared ones are not written.
  ASSERT_TRUE(cache->Reserve(b, 1).ok());
  ASSERT_EQ(b.block_table(KvGroup::kFull).size(), 3u);
  EXPECT_NE(b.block_table(KvGroup::kFull)[2], full[0]);
  EXPECT_NE(b.block_table(KvGroup::kFull)[2], full[1]);
  ASSERT_TRUE(cache->Commit(b, 1).ok());

  ASSERT_TRUE(cache->Release(a).ok());
  EXPECT_EQ(cache->used_pages(KvGroup::kFull), 3);  // still referenced by b and the cache entry
  ASSERT_TRUE(cache->Release(b).ok());
  EXPECT_EQ(cache->used_pages(KvGroup::kFull), 2);  // the cache entry's
  for (int32_t p : full) ASSERT_TRUE(cache->ReleasePage(KvGroup::kFull, p).ok());
  ASSERT_TRUE(cache->ReleasePage(KvGroup::kSliding, sliding[1]).ok());
  EXPECT_EQ(cache->used_pages(KvGroup::kFull), 0);
  EXPECT_EQ(cache->used_pages(KvGroup::kSliding), 0);
  // One release too many is a caller bug, reported, not a crash.
  EXPECT_EQ(cache->ReleasePage(KvGroup::kFull, full[0]).code(), StatusCode::kInternal);
  EXPECT_FALSE(cache->RetainPage(KvGroup::kFull, full[0]).ok());
}

TEST(KvCacheRefcountTest, AttachPrefixRejectsBadInputWithoutChangingAnything) {
  auto cache = KvCache::Create(TwoGroupSpec(16, 8, 8));
  ASSERT_TRUE(cache.ok());
  SequenceKv a;
  ASSERT_TRUE(cache->Reserve(a, 16).ok());
  ASSERT_TRUE(cache->Commit(a, 16).ok());
  const auto full = a.block_table(KvGroup::kFull);
  const auto sliding = a.block_table(KvGroup::kSliding);
  SequenceKv b;
  EXPECT_FALSE(cache->AttachPrefix(b, 8, full, sliding).ok());        // not page aligned
  EXPECT_FALSE(cache->AttachPrefix(b, 32, full, sliding).ok());       // too few pages
  EXPECT_FALSE(cache->AttachPrefix(b, 16, {5}, sliding).ok());        // page 5 not in use
  EXPECT_FALSE(cache->AttachPrefix(a, 16, full, sliding).ok());       // a already holds pages
  EXPECT_EQ(b.length(), 0);
  EXPECT_EQ(cache->page_refs(KvGroup::kFull, full[0]), 1);
  ASSERT_TRUE(cache->Release(a).ok());
  EXPECT_EQ(cache->used_pages(KvGroup::kFull), 0);
}

}  // namespace
}  // namespace dl
