#include "tokenizer/utf8.h"

#include <gtest/gtest.h>

namespace dl::utf8 {
namespace {

constexpr const char* kFffd = "\xEF\xBF\xBD";

TEST(Utf8, FindInvalid) {
  EXPECT_FALSE(FindInvalid("plain ascii").has_value());
  EXPECT_FALSE(FindInvalid("你好 😀 é").has_value());
  EXPECT_EQ(FindInvalid("ab\xC0\x80"), 2u);         // overlong
  EXPECT_EQ(FindInvalid("\xED\xA0\x80"), 0u);       // surrogate
  EXPECT_EQ(FindInvalid("x\xF4\x90\x80\x80"), 1u);  // above U+10FFFF
  EXPECT_EQ(FindInvalid("xy\xE4\xB8"), 2u);         // truncated
}

TEST(Utf8, LossyReplacesMaximalSubparts) {
  // Rust's documented example: one U+FFFD for the truncated 4-byte sequence.
  EXPECT_EQ(Lossy("Hello \xF0\x90\x80World"), std::string("Hello ") + kFffd + "World");
  // Unicode Table 3-8 style cases: each byte that cannot start or continue gets its own U+FFFD.
  EXPECT_EQ(Lossy("\xC0\x80"), std::string(kFffd) + kFffd);
  EXPECT_EQ(Lossy("\xED\xA0\x80"), std::string(kFffd) + kFffd + kFffd);
  EXPECT_EQ(Lossy("a\xE4\xB8z"), std::string("a") + kFffd + "z");
  EXPECT_EQ(Lossy("\xE4\xB8"), kFffd);
  EXPECT_EQ(Lossy("\xFF"), kFffd);
  EXPECT_EQ(Lossy("你😀"), "你😀");
}

TEST(Utf8, CompletePrefixHoldsBackOnlyAnUnfinishedCharacter) {
  EXPECT_EQ(CompletePrefix("abc"), 3u);
  EXPECT_EQ(CompletePrefix("ab\xE4\xBD"), 2u);      // first two bytes of 你
  EXPECT_EQ(CompletePrefix("ab\xF0\x9F\x98"), 2u);  // three bytes of 😀
  EXPECT_EQ(CompletePrefix("ab\xE4\x41"), 4u);      // invalid, nothing to wait for
  EXPECT_EQ(CompletePrefix("\x80"), 1u);
  EXPECT_EQ(CompletePrefix("\xF0"), 0u);
}

TEST(Utf8, ByteLevelAlphabet) {
  // GPT-2's table: printable Latin-1 bytes map to themselves, the rest to U+0100 + n.
  EXPECT_EQ(ByteToChar('A'), U'A');
  EXPECT_EQ(ByteToChar(0x00), U'\u0100');
  EXPECT_EQ(ByteToChar(' '), U'\u0120');   // Ġ
  EXPECT_EQ(ByteToChar('\n'), U'\u010A');  // Ċ
  EXPECT_EQ(ByteToChar(0xAD), U'\u0143');  // the last one: n = 67
  for (int b = 0; b < 256; ++b) EXPECT_EQ(CharToByte(ByteToChar(static_cast<uint8_t>(b))), b);
  EXPECT_EQ(CharToByte(U'\u3008'), -1);
  EXPECT_EQ(BytesToByteLevel("a b\n"), "aĠbĊ");
  EXPECT_EQ(ByteLevelToBytes("ä½ł"), "你");
  EXPECT_FALSE(ByteLevelToBytes("〈|EOS|〉").has_value());
}

TEST(Utf8, WhiteSpaceAndWordCharacters) {
  EXPECT_TRUE(IsWhiteSpace(U' '));
  EXPECT_TRUE(IsWhiteSpace(U'\u3000'));
  EXPECT_TRUE(IsWhiteSpace(U'\u0085'));
  EXPECT_FALSE(IsWhiteSpace(U'\u200B'));  // zero-width space is not White_Space
  EXPECT_TRUE(IsWordChar(U'_'));
  EXPECT_TRUE(IsWordChar(U'é'));
  EXPECT_TRUE(IsWordChar(U'你'));
  EXPECT_TRUE(IsWordChar(U'\u0663'));  // Arabic-Indic digit three
  EXPECT_FALSE(IsWordChar(U'-'));
  EXPECT_FALSE(IsWordChar(U'😀'));
}

}  // namespace
}  // namespace dl::utf8
