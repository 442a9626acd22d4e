// UTF-8 and byte-level helpers shared by the tokenizer, its streaming decoder and its trainer.
//
// The byte-level alphabet is GPT-2's: each of the 256 byte values is written as one printable
// Unicode character (bytes 0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF map to themselves, the others to
// U+0100 + n in byte order), so that a BPE vocabulary over raw bytes can live in a JSON file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dl::utf8 {

// Offset of the first byte that is not part of valid UTF-8, or nullopt when all of `text` is valid.
// Valid means what Rust's str accepts: no overlongs, no surrogates, nothing above U+10FFFF.
std::optional<size_t> FindInvalid(std::string_view text);

// Decodes the code point at `text[pos]` of VALID UTF-8 and advances `pos`.
char32_t DecodeAt(std::string_view text, size_t& pos);

// Appends the UTF-8 encoding of `cp` to `out`.
void Append(char32_t cp, std::string& out);

// Converts bytes to text the way Rust's String::from_utf8_lossy does (which is what Hugging Face's
// ByteLevel decoder calls): every maximal invalid subpart becomes one U+FFFD.
std::string Lossy(std::string_view bytes);

// Length of the longest prefix of `bytes` that Lossy() can convert without seeing more input: all
// of `bytes` except a trailing incomplete-but-so-far-valid multi-byte sequence (at most 3 bytes).
// Lossy(a + b) == Lossy(a[:n]) + Lossy(a[n:] + b) for n = CompletePrefix(a) and any b.
size_t CompletePrefix(std::string_view bytes);

// Unicode White_Space (what Rust's regex `\s` matches; used for added-token lstrip/rstrip).
bool IsWhiteSpace(char32_t cp);

// Rust regex `\w` (Unicode word character), approximated by letters, marks, decimal digits,
// connector punctuation and the join controls; used only by added tokens with single_word set.
bool IsWordChar(char32_t cp);

// The byte-level alphabet.
char32_t ByteToChar(uint8_t byte);
// The byte a byte-level character stands for, or -1 when `cp` is not in the alphabet.
int CharToByte(char32_t cp);
// UTF-8 string of byte-level characters for raw bytes ("hi there" -> "hiĠthere").
std::string BytesToByteLevel(std::string_view bytes);
// Raw bytes of a byte-level string, or nullopt when a character is outside the alphabet (or the
// string is not valid UTF-8).
std::optional<std::string> ByteLevelToBytes(std::string_view token);

}  // namespace dl::utf8
