#include "tokenizer/utf8.h"

#include "base/utf8.h"

#include <array>
#include <memory>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace dl::utf8 {
namespace {

// Result of looking at the sequence that starts at bytes[pos].
struct Step {
  enum Kind { kValid, kInvalid, kIncomplete } kind;
  size_t len;  // bytes consumed: the character, the maximal invalid subpart, or the incomplete tail
};

bool IsCont(uint8_t b) {
  return (b & 0xC0) == 0x80;
}

// One step of UTF-8 validation with Rust's (and Unicode's "maximal subpart") error lengths.
Step Look(std::string_view s, size_t pos) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0x80) return {Step::kValid, 1};
  size_t width;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    width = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    width = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    width = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {Step::kInvalid, 1};
  }
  const size_t n = s.size();
  if (pos + 1 >= n) return {Step::kIncomplete, 1};
  const auto b1 = static_cast<uint8_t>(s[pos + 1]);
  if (b1 < lo || b1 > hi) return {Step::kInvalid, 1};
  for (size_t k = 2; k < width; ++k) {
    if (pos + k >= n) return {Step::kIncomplete, k};
    if (!IsCont(static_cast<uint8_t>(s[pos + k]))) return {Step::kInvalid, k};
  }
  return {Step::kValid, width};
}

constexpr std::array<int32_t, 256> MakeByteToChar() {
  std::array<int32_t, 256> table{};
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    table[b] = printable ? b : 256 + n++;
  }
  return table;
}
constexpr std::array<int32_t, 256> kByteToChar = MakeByteToChar();

constexpr std::array<int16_t, 324> MakeCharToByte() {
  std::array<int16_t, 324> table{};
  for (auto& v : table) v = -1;
  for (int b = 0; b < 256; ++b) table[kByteToChar[b]] = static_cast<int16_t>(b);
  return table;
}
constexpr std::array<int16_t, 324> kCharToByte = MakeCharToByte();

}  // namespace

std::optional<size_t> FindInvalid(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Step step = Look(text, pos);
    if (step.kind != Step::kValid) return pos;
    pos += step.len;
  }
  return std::nullopt;
}

char32_t DecodeAt(std::string_view s, size_t& pos) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0x80) {
    ++pos;
    return b0;
  }
  auto cont = [&](size_t k) {
    return static_cast<char32_t>(static_cast<uint8_t>(s[pos + k]) & 0x3F);
  };
  char32_t cp;
  if (b0 < 0xE0) {
    cp = ((b0 & 0x1F) << 6) | cont(1);
    pos += 2;
  } else if (b0 < 0xF0) {
    cp = ((b0 & 0x0F) << 12) | (cont(1) << 6) | cont(2);
    pos += 3;
  } else {
    cp = ((b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
    pos += 4;
  }
  return cp;
}

void Append(char32_t cp, std::string& out) { AppendUtf8(out, static_cast<uint32_t>(cp)); }

std::string Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (static_cast<uint8_t>(bytes[pos]) < 0x80) {
      out.push_back(bytes[pos++]);
      continue;
    }
    const Step step = Look(bytes, pos);
    if (step.kind == Step::kValid) {
      out.append(bytes.substr(pos, step.len));
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD; an incomplete tail at the very end is one subpart too
    }
    pos += step.len;
  }
  return out;
}

size_t CompletePrefix(std::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (static_cast<uint8_t>(bytes[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Step step = Look(bytes, pos);
    if (step.kind == Step::kIncomplete) return pos;
    pos += step.len;
  }
  return pos;
}

bool IsWhiteSpace(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool IsWordChar(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') ||
           cp == '_';
  }
  // Rare path (single_word added tokens next to non-ASCII text): ask PCRE2's Unicode tables.
  struct Code {
    pcre2_code* code = nullptr;
    Code() {
      int err;
      PCRE2_SIZE off;
      code = pcre2_compile(
          reinterpret_cast<PCRE2_SPTR>(R"([\p{L}\p{M}\p{Nd}\p{Nl}\p{Pc}\x{200C}\x{200D}])"),
          PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    }
    ~Code() { pcre2_code_free(code); }
  };
  static const Code re;
  if (re.code == nullptr) return false;
  std::string s;
  Append(cp, s);
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  const int rc = pcre2_match(re.code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0,
                             PCRE2_ANCHORED, md, nullptr);
  pcre2_match_data_free(md);
  return rc >= 0;
}

char32_t ByteToChar(uint8_t byte) {
  return static_cast<char32_t>(kByteToChar[byte]);
}

int CharToByte(char32_t cp) {
  return cp < kCharToByte.size() ? kCharToByte[cp] : -1;
}

std::string BytesToByteLevel(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) Append(ByteToChar(static_cast<uint8_t>(c)), out);
  return out;
}

std::optional<std::string> ByteLevelToBytes(std::string_view token) {
  if (FindInvalid(token)) return std::nullopt;
  std::string out;
  out.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    const int b = CharToByte(DecodeAt(token, pos));
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
  }
  return out;
}

}  // namespace dl::utf8
