#include "tokenizer/incremental_decoder.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/rng.h"
#include "tokenizer/utf8.h"

namespace dl {
namespace {

// The mini fixture (see tokenizer_test.cc): byte b has id 10 + b, 285 = 你 (3 bytes in one token),
// 284 = first two bytes of 你, 0 = 〈|EOS|〉 (special), 1 = <user>.
const Tokenizer& Mini() {
  static const Tokenizer* tok = [] {
    auto r = Tokenizer::FromFile(std::string(DECODELAB_SOURCE_DIR) +
                                 "/tests/data/tokenizer/mini/tokenizer.json");
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return new Tokenizer(std::move(r).value());
  }();
  return *tok;
}

std::vector<std::string> Stream(const Tokenizer& t, const std::vector<int32_t>& ids,
                                bool skip = false) {
  IncrementalDecoder dec(t, skip);
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(dec.Add(id));
  out.push_back(dec.Flush());
  return out;
}

std::string Join(const std::vector<std::string>& parts) {
  std::string s;
  for (const auto& p : parts) s += p;
  return s;
}

TEST(IncrementalDecoder, EmojiSplitAcrossByteTokens) {
  // 😀 = F0 9F 98 80, one byte token each: nothing until the last byte arrives.
  const std::vector<int32_t> ids = {10 + 'a', 10 + 0xF0, 10 + 0x9F, 10 + 0x98, 10 + 0x80, 10 + 'b'};
  EXPECT_EQ(Stream(Mini(), ids), (std::vector<std::string>{"a", "", "", "", "😀", "b", ""}));
}

TEST(IncrementalDecoder, CjkSplitAcrossMergedTokens) {
  // 284 = E4 BD (ä½), then the byte A0 completes 你; 285 is a whole 你.
  const std::vector<int32_t> ids = {284, 10 + 0xA0, 285, 284};
  IncrementalDecoder dec(Mini());
  EXPECT_EQ(dec.Add(284), "");
  EXPECT_EQ(dec.pending_bytes(), 2u);
  EXPECT_EQ(dec.Add(10 + 0xA0), "你");
  EXPECT_EQ(dec.Add(285), "你");
  EXPECT_EQ(dec.Add(284), "");
  // The stream ends inside a character: U+FFFD, exactly what Decode gives for the same ids.
  EXPECT_EQ(dec.Flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(Join(Stream(Mini(), ids)), Mini().Decode(ids));
  EXPECT_EQ(dec.num_tokens(), 4u);
}

TEST(IncrementalDecoder, InvalidBytesAreReleasedNotHeld) {
  // E4 then 'A': E4 can never complete, so it becomes U+FFFD as soon as 'A' arrives.
  IncrementalDecoder dec(Mini());
  EXPECT_EQ(dec.Add(10 + 0xE4), "");
  EXPECT_EQ(dec.Add(10 + 'A'),
            "\xEF\xBF\xBD"
            "A");
  EXPECT_EQ(dec.pending_bytes(), 0u);
}

TEST(IncrementalDecoder, SkipsSpecialTokensWhenAsked) {
  const std::vector<int32_t> ids = {0, 267, 270, 10 + 'o', 1, 0};
  EXPECT_EQ(Join(Stream(Mini(), ids, /*skip=*/true)), "hello<user>");
  EXPECT_EQ(Join(Stream(Mini(), ids, /*skip=*/false)), "〈|EOS|〉hello<user>〈|EOS|〉");
}

TEST(IncrementalDecoder, StreamingEqualsWholeDecodeOnRandomIds) {
  // Random ids over the whole id space (bytes, merges, added tokens, holes, out of range): the
  // streamed pieces are valid UTF-8 and join to exactly Decode(ids).
  const uint64_t key = StreamKey(7, "incremental_decoder_test");
  uint64_t counter = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> ids;
    const int n = 1 + static_cast<int>(UniformAt(key, counter++) * 40);
    for (int i = 0; i < n; ++i) {
      const float u = UniformAt(key, counter++);
      // Bias towards high bytes (0x80-0xFF) so that partial characters are common.
      ids.push_back(u < 0.6f ? 10 + 0x80 + static_cast<int32_t>(UniformAt(key, counter++) * 128)
                             : static_cast<int32_t>(UniformAt(key, counter++) * 300));
    }
    for (bool skip : {false, true}) {
      const auto parts = Stream(Mini(), ids, skip);
      for (const auto& p : parts) EXPECT_EQ(p, utf8::Lossy(p));  // each piece is valid UTF-8
      ASSERT_EQ(Join(parts), Mini().Decode(ids, skip)) << "trial " << trial;
    }
  }
}

TEST(IncrementalDecoder, EncodedTextStreamsBackUnchanged) {
  const std::string text = "Grüße aus 東京 👨‍👩‍👧 and 你你 é\n\tdone";
  auto ids = Mini().Encode(text);
  ASSERT_TRUE(ids.ok());
  IncrementalDecoder dec(Mini());
  std::string out;
  for (int32_t id : *ids) {
    std::string piece = dec.Add(id);
    EXPECT_EQ(piece, utf8::Lossy(piece));
    out += piece;
  }
  EXPECT_EQ(dec.pending_bytes(), 0u);
  out += dec.Flush();
  EXPECT_EQ(out, text);
}

}  // namespace
}  // namespace dl
