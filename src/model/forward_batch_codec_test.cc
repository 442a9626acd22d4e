#include "model/forward_batch_codec.h"

#include <bit>
#include <cstring>

#include <gtest/gtest.h>

namespace dl {
namespace {

// A batch with every field set to something other than its default.
struct Fixture {
  SequenceKv a = SequenceKv::Mirror(37, {4, 9, 11}, {-1, 2, 7});
  SequenceKv b = SequenceKv::Mirror(0, {5}, {});
  ForwardBatch batch;
  Fixture() {
    batch.mode = ForwardMode::kVerify;
    const std::vector<int32_t> ra = {10, 11, 12}, rb = {500, 1, 2, 3};
    batch.AddSequence(a, ra, 30);
    batch.AddSequence(b, rb, 4);
    OutputRequest& o1 = batch.AddOutput(1);
    o1.sample = false;
    o1.want_logits = true;
    OutputRequest& o2 = batch.AddOutput(6);
    o2.sampling.temperature = 0.7f;
    o2.sampling.top_k = 40;
    o2.sampling.top_p = 0.9f;
    o2.sampling.min_p = 0.05f;
    o2.sampling.key = 0xfeedfacecafebeefull;
    o2.sampling.step = 123456789012ull;
    o2.sampling.adjustments.push_back({.token = 7, .bias = -1.5f, .repetition = 1.3f, .penalty = 0.25f});
    o2.sampling.adjustments.push_back({.token = 99, .bias = -0.0f, .repetition = 0.8f, .penalty = -2.0f});
    batch.hidden_taps = {0, 2, 3};
  }
};

void ExpectSameBatch(const ForwardBatch& x, const ForwardBatch& y) {
  EXPECT_EQ(x.mode, y.mode);
  EXPECT_EQ(x.tokens, y.tokens);
  ASSERT_EQ(x.seqs.size(), y.seqs.size());
  for (size_t i = 0; i < x.seqs.size(); ++i) {
    EXPECT_EQ(x.seqs[i].first_row, y.seqs[i].first_row);
    EXPECT_EQ(x.seqs[i].num_rows, y.seqs[i].num_rows);
    EXPECT_EQ(x.seqs[i].prompt_length, y.seqs[i].prompt_length);
    ASSERT_NE(y.seqs[i].kv, nullptr);
    EXPECT_EQ(x.seqs[i].kv->length(), y.seqs[i].kv->length());
    EXPECT_EQ(x.seqs[i].kv->block_table(KvGroup::kFull), y.seqs[i].kv->block_table(KvGroup::kFull));
    EXPECT_EQ(x.seqs[i].kv->block_table(KvGroup::kSliding), y.seqs[i].kv->block_table(KvGroup::kSliding));
  }
  ASSERT_EQ(x.outputs.size(), y.outputs.size());
  for (size_t i = 0; i < x.outputs.size(); ++i) {
    const OutputRequest &p = x.outputs[i], &q = y.outputs[i];
    EXPECT_EQ(p.row, q.row);
    EXPECT_EQ(p.sample, q.sample);
    EXPECT_EQ(p.want_logits, q.want_logits);
    EXPECT_EQ(std::bit_cast<uint32_t>(p.sampling.temperature), std::bit_cast<uint32_t>(q.sampling.temperature));
    EXPECT_EQ(p.sampling.top_k, q.sampling.top_k);
    EXPECT_EQ(std::bit_cast<uint32_t>(p.sampling.top_p), std::bit_cast<uint32_t>(q.sampling.top_p));
    EXPECT_EQ(std::bit_cast<uint32_t>(p.sampling.min_p), std::bit_cast<uint32_t>(q.sampling.min_p));
    EXPECT_EQ(p.sampling.key, q.sampling.key);
    EXPECT_EQ(p.sampling.step, q.sampling.step);
    ASSERT_EQ(p.sampling.adjustments.size(), q.sampling.adjustments.size());
    for (size_t j = 0; j < p.sampling.adjustments.size(); ++j) {
      const LogitAdjustment &u = p.sampling.adjustments[j], &v = q.sampling.adjustments[j];
      EXPECT_EQ(u.token, v.token);
      EXPECT_EQ(std::bit_cast<uint32_t>(u.bias), std::bit_cast<uint32_t>(v.bias));  // -0 stays -0
      EXPECT_EQ(std::bit_cast<uint32_t>(u.repetition), std::bit_cast<uint32_t>(v.repetition));
      EXPECT_EQ(std::bit_cast<uint32_t>(u.penalty), std::bit_cast<uint32_t>(v.penalty));
    }
  }
  EXPECT_EQ(x.hidden_taps, y.hidden_taps);
  EXPECT_EQ(x.Positions(), y.Positions());
}

TEST(ForwardBatchCodecTest, EveryFieldRoundTrips) {
  Fixture f;
  const std::vector<std::byte> bytes = EncodeForwardBatch(f.batch);
  auto d = DecodeForwardBatch(bytes);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ExpectSameBatch(f.batch, d->batch);
  // The decoded sequences are the decoded batch's own: moving it keeps them valid.
  DecodedForwardBatch moved = std::move(d).value();
  ExpectSameBatch(f.batch, moved.batch);
  EXPECT_EQ(moved.batch.seqs[0].kv, &moved.kvs[0]);
  // Encoding the decoded batch gives the same bytes.
  EXPECT_EQ(EncodeForwardBatch(moved.batch), bytes);
}

TEST(ForwardBatchCodecTest, EmptyListsRoundTrip) {
  SequenceKv s = SequenceKv::Mirror(3, {1}, {});
  ForwardBatch b;
  const std::vector<int32_t> rows = {42};
  b.AddSequence(s, rows);
  auto d = DecodeForwardBatch(EncodeForwardBatch(b));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ExpectSameBatch(b, d->batch);
}

TEST(ForwardBatchCodecTest, EveryTruncationIsRefused) {
  Fixture f;
  const std::vector<std::byte> bytes = EncodeForwardBatch(f.batch);
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto d = DecodeForwardBatch(std::span(bytes.data(), n));
    ASSERT_FALSE(d.ok()) << "truncated to " << n << " of " << bytes.size() << " bytes";
    EXPECT_EQ(d.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(d.status().message().find("step plan"), std::string::npos) << d.status().message();
  }
}

TEST(ForwardBatchCodecTest, CorruptPlansAreRefusedNamingWhatIsWrong) {
  Fixture f;
  const std::vector<std::byte> good = EncodeForwardBatch(f.batch);
  auto refused = [](std::vector<std::byte> bytes, const std::string& needle) {
    auto d = DecodeForwardBatch(bytes);
    ASSERT_FALSE(d.ok()) << needle;
    EXPECT_EQ(d.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(d.status().message().find(needle), std::string::npos) << d.status().message();
  };
  auto bad = good;
  bad[0] = std::byte{0};
  refused(bad, "bad magic");
  bad = good;
  bad[4] = std::byte{2};  // version 2
  refused(bad, "version 2");
  bad = good;
  bad[8] = std::byte{9};  // mode
  refused(bad, "unknown mode 9");
  // A token count far larger than the message: refused before any allocation.
  bad = good;
  const uint64_t huge = uint64_t{1} << 60;
  std::memcpy(bad.data() + 9, &huge, sizeof(huge));
  refused(bad, "tokens says");
  bad = good;
  bad.push_back(std::byte{0});
  refused(bad, "unexpected bytes after the end");
  // The first output's `sample` flag (after the header, tokens and both sequences) is a byte that
  // must be 0 or 1.
  const size_t seqs_at = 9 + 8 + 7 * 4;
  const size_t seq_a = 4 * 4 + 8 + 3 * 4 + 8 + 3 * 4, seq_b = 4 * 4 + 8 + 4 + 8;
  const size_t sample_at = seqs_at + 8 + seq_a + seq_b + 8 + 4;
  ASSERT_EQ(good[sample_at], std::byte{0});  // output 0 does not sample
  bad = good;
  bad[sample_at] = std::byte{7};
  refused(bad, "output 0 sample is 7");
}

}  // namespace
}  // namespace dl
