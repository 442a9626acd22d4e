// Tests of dl::Tokenizer against the hand-made fixture tests/data/tokenizer/mini/tokenizer.json.
//
// The fixture (Laguna's structure) has: added tokens 0 "〈|EOS|〉" (special), 1 "<user>",
// 2 "<mask>" (special, lstrip+rstrip), 3 "[W]" (single_word, normalized), 4 "<user>!"; ids 5-9
// unused; byte b at id 10 + b (byte-level characters: space = Ġ, \n = Ċ); and 25 merges, rank r
// making id 266 + r:
//   0 Ġt  1 he  2 Ġthe  3 in  4 ll  5 ell  6 hell  7 or  8 Ġw  9 Ġwor  10 ld  11 Ġworld  12 ĊĊ
//   13 ĠĠ  14 ĠĠĠĠ  15 Ã© (é)  16 aa  17 ing  18 ä½  19 ä½ł (你)  20 12  21 's  22 Ba  23 Bay
//   24 eBay
// Expected ids below are derived by hand from the BPE rule: repeatedly apply the lowest-rank merge
// present (leftmost first on ties), within each pre-tokenized piece.
#include "tokenizer/tokenizer.h"

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace dl {
namespace {

using Ids = std::vector<int32_t>;
using Pieces = std::vector<std::string>;

constexpr int32_t B(char c) {
  return 10 + static_cast<uint8_t>(c);
}  // id of a single byte

std::string MiniPath() {
  return std::string(DECODELAB_SOURCE_DIR) + "/tests/data/tokenizer/mini/tokenizer.json";
}

const Tokenizer& Mini() {
  static const Tokenizer* tok = [] {
    auto r = Tokenizer::FromFile(MiniPath());
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return new Tokenizer(std::move(r).value());
  }();
  return *tok;
}

nlohmann::json MiniJson() {
  auto r = Tokenizer::FromFile(MiniPath());  // proves the file exists before we parse it raw
  EXPECT_TRUE(r.ok());
  std::ifstream in(MiniPath());
  return nlohmann::json::parse(in);
}

Ids Enc(const Tokenizer& t, std::string_view text, bool add_special = false) {
  auto r = t.Encode(text, add_special);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? r.value() : Ids{};
}

Pieces Pre(const Tokenizer& t, std::string_view text) {
  auto r = t.PreTokenize(text);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? r.value() : Pieces{};
}

TEST(TokenizerMini, LoadsVocabularyAndAddedTokens) {
  const Tokenizer& t = Mini();
  EXPECT_EQ(t.vocab_size(), 291);
  EXPECT_EQ(t.num_merges(), 25u);
  EXPECT_EQ(t.TokenToId("〈|EOS|〉"), 0);
  EXPECT_EQ(t.TokenToId("Ġworld"), 277);
  EXPECT_EQ(t.TokenToId("Ġ"), B(' '));
  EXPECT_EQ(t.IdToToken(268), "Ġthe");
  EXPECT_EQ(t.IdToToken(4), "<user>!");
  EXPECT_FALSE(t.IdToToken(7).has_value());  // hole in the id space
  EXPECT_FALSE(t.IsKnown(7));
  EXPECT_FALSE(t.IsKnown(291));
  EXPECT_TRUE(t.IsSpecial(0));
  EXPECT_TRUE(t.IsSpecial(2));
  EXPECT_FALSE(t.IsSpecial(1));
  EXPECT_EQ(t.TokenBytes(B('\n')), "\n");
  EXPECT_EQ(t.TokenBytes(285), "你");
  EXPECT_EQ(t.added_tokens().size(), 5u);
}

TEST(TokenizerMini, MergePriorityDecidesTheSegmentation) {
  const Tokenizer& t = Mini();
  // "hello": (h,e) rank 1 beats (l,l) rank 4 -> he l l o -> he ll o; "ell"/"hell" never form.
  // " world": (o,r) 7 -> (Ġ,w) 8 -> (Ġw,or) 9 -> (l,d) 10 -> (Ġwor,ld) 11.
  EXPECT_EQ(Enc(t, "hello world"), (Ids{267, 270, B('o'), 277}));
  // "bell": (l,l) 4 -> (e,ll) 5 -> b ell.  "shell": (h,e) 1 first -> s he ll.
  EXPECT_EQ(Enc(t, "bell"), (Ids{B('b'), 271}));
  EXPECT_EQ(Enc(t, "shell"), (Ids{B('s'), 267, 270}));
  // "the" has no leading space: t he (no "t he" merge). " the": Ġt (0), he (1), Ġthe (2).
  EXPECT_EQ(Enc(t, "the"), (Ids{B('t'), 267}));
  EXPECT_EQ(Enc(t, " the"), (Ids{268}));
  // Equal ranks merge leftmost first: aaa -> aa a; aaaa -> aa aa.
  EXPECT_EQ(Enc(t, "aaa"), (Ids{282, B('a')}));
  EXPECT_EQ(Enc(t, "aaaa"), (Ids{282, 282}));
  // "singing" is one piece: in(3) twice, then ing(17) twice -> s ing ing.
  EXPECT_EQ(Enc(t, "singing"), (Ids{B('s'), 283, 283}));
}

TEST(TokenizerMini, MultiByteCharacters) {
  const Tokenizer& t = Mini();
  // 你 = E4 BD A0 = ä ½ ł: (ä,½) 18 then (ä½,ł) 19. Both 你 of "你你" get rank 18 before 19.
  EXPECT_EQ(Enc(t, "你"), (Ids{285}));
  EXPECT_EQ(Enc(t, "你你"), (Ids{285, 285}));
  // é = C3 A9 = Ã ©.
  EXPECT_EQ(Enc(t, "é"), (Ids{281}));
  // 😀 = F0 9F 98 80: no merges, four byte tokens.
  EXPECT_EQ(Enc(t, "😀"), (Ids{10 + 0xF0, 10 + 0x9F, 10 + 0x98, 10 + 0x80}));
}

TEST(TokenizerMini, DigitsAreSplitOneByOne) {
  // \p{N} takes one digit, so the "1 2" merge (rank 20) can never apply.
  EXPECT_EQ(Enc(Mini(), "1234"), (Ids{B('1'), B('2'), B('3'), B('4')}));
  EXPECT_EQ(Pre(Mini(), "x=12"), (Pieces{"x", "=", "1", "2"}));
}

TEST(TokenizerMini, MixedCaseWordsAreOnePieceAsShipped) {
  // The shipped (un-"fixed") pattern keeps eBay whole: B a -> Ba (22), Ba y (23), e Bay (24).
  EXPECT_EQ(Pre(Mini(), "eBay NaOH pH iPhone"), (Pieces{"eBay", " NaOH", " pH", " iPhone"}));
  EXPECT_EQ(Enc(Mini(), "eBay"), (Ids{290}));
}

TEST(TokenizerMini, Contractions) {
  const Tokenizer& t = Mini();
  EXPECT_EQ(Pre(t, "it's"), (Pieces{"it", "'s"}));
  EXPECT_EQ(Enc(t, "it's"), (Ids{B('i'), B('t'), 287}));
  // Case-insensitive contraction, but "'S" has no merge (only lower-case "' s").
  EXPECT_EQ(Pre(t, "IT'S I'M we'll"), (Pieces{"IT", "'S", " I", "'M", " we", "'ll"}));
  EXPECT_EQ(Enc(t, "IT'S"), (Ids{B('I'), B('T'), B('\''), B('S')}));
}

TEST(TokenizerMini, NewlineRunsAreMergedWithTheNextPieceFirst) {
  const Tokenizer& t = Mini();
  // Step 1 cuts "a." | "\nb"; so "." does not absorb the newline as the Qwen2 pattern alone would.
  EXPECT_EQ(Pre(t, "a.\nb"), (Pieces{"a", ".", "\n", "b"}));
  // Step 1 cuts "a  " | "\nb"; the Qwen2 pattern alone would give "a", "  \n", "b".
  EXPECT_EQ(Pre(t, "a  \nb"), (Pieces{"a", "  ", "\n", "b"}));
  EXPECT_EQ(Enc(t, "a  \nb"), (Ids{B('a'), 279, B('\n'), B('b')}));
  // "\n\n" is one piece -> ĊĊ (12); "\n\n\n" -> ĊĊ Ċ.
  EXPECT_EQ(Enc(t, "a\n\nb"), (Ids{B('a'), 278, B('b')}));
  EXPECT_EQ(Enc(t, "x\n\n\ny"), (Ids{B('x'), 278, B('\n'), B('y')}));
  // Indented code: "\n", then \s+(?!\S) leaves one space for " return".
  EXPECT_EQ(Pre(t, "\n    return"), (Pieces{"\n", "   ", " return"}));
  // Three spaces: (Ġ,Ġ) at 0 first -> ĠĠ Ġ.  Eight spaces at the end: ĠĠ x4 -> ĠĠĠĠ x2.
  EXPECT_EQ(Enc(t, "\n    return").size(), 1u + 2u + 7u);
  EXPECT_EQ(Enc(t, "x        "), (Ids{B('x'), 280, 280}));
  EXPECT_EQ(Pre(t, "\r\n"), (Pieces{"\r\n"}));
  EXPECT_EQ(Pre(t, "a\r\n\r\nb"), (Pieces{"a", "\r\n\r\n", "b"}));
}

TEST(TokenizerMini, AddedTokensAreMatchedBeforePreTokenization) {
  const Tokenizer& t = Mini();
  EXPECT_EQ(Enc(t, "<user>hi"), (Ids{1, B('h'), B('i')}));
  // Leftmost-longest: "<user>!" wins over "<user>".
  EXPECT_EQ(Enc(t, "<user>!x"), (Ids{4, B('x')}));
  // Special token glued to text on both sides.
  EXPECT_EQ(Enc(t, "〈|EOS|〉hello〈|EOS|〉"), (Ids{0, 267, 270, B('o'), 0}));
  // lstrip/rstrip: "<mask>" swallows the spaces around it.
  EXPECT_EQ(Enc(t, "a <mask> b"), (Ids{B('a'), 2, B('b')}));
  EXPECT_EQ(Pre(t, "a <mask> b"), (Pieces{"a", " <mask> ", "b"}));
  // The stripped spaces belong to the token, so they do not come back (as in HF).
  EXPECT_EQ(t.Decode(Enc(t, "a <mask> b")), "a<mask>b");
  // Without strip flags the space stays with the next word: "<user> the" -> 1, Ġthe.
  EXPECT_EQ(Enc(t, "<user> the"), (Ids{1, 268}));
  // single_word "[W]": the first occurrence touches "x" and is ignored; the second stands alone.
  EXPECT_EQ(Pre(t, "x[W] [W]"), (Pieces{"x", "[W", "]", " ", "[W]"}));
  EXPECT_EQ(Enc(t, "x[W] [W]"), (Ids{B('x'), B('['), B('W'), B(']'), B(' '), 3}));
  EXPECT_EQ(Enc(t, "[W]x"), (Ids{B('['), B('W'), B(']'), B('x')}));
}

TEST(TokenizerMini, EdgeCases) {
  const Tokenizer& t = Mini();
  EXPECT_EQ(Enc(t, ""), Ids{});
  EXPECT_EQ(Enc(t, " "), (Ids{B(' ')}));
  EXPECT_EQ(Enc(t, "\n\n\n"), (Ids{278, B('\n')}));
  EXPECT_EQ(Enc(t, "〈|EOS|〉"), (Ids{0}));
  // A long whitespace run: look-ahead over 100k spaces must not fail (JIT stack fallback).
  std::string spaces(100000, ' ');
  spaces += "x";
  auto ids = Enc(t, spaces);
  EXPECT_EQ(t.Decode(ids), spaces);
}

TEST(TokenizerMini, RejectsInvalidUtf8Input) {
  auto r = Mini().Encode("ok\xC3(");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("UTF-8"), std::string::npos);
}

TEST(TokenizerMini, PostProcessorOnlyWhenAsked) {
  EXPECT_EQ(Enc(Mini(), "hi", /*add_special=*/true), (Ids{0, B('h'), B('i')}));
  EXPECT_EQ(Enc(Mini(), "hi", /*add_special=*/false), (Ids{B('h'), B('i')}));
}

TEST(TokenizerMini, Decode) {
  const Tokenizer& t = Mini();
  const Ids ids = {0, 267, 270, B('o'), 2, 277, 7, 9999, 1, 285};
  EXPECT_EQ(t.Decode(ids), "〈|EOS|〉hello<mask> world<user>你");  // unknown 7, 9999 dropped
  EXPECT_EQ(t.Decode(ids, /*skip_special_tokens=*/true), "hello world<user>你");
  // Bytes that do not form UTF-8 become U+FFFD (E4 BD then end; lone 0x80).
  EXPECT_EQ(t.Decode(Ids{284}), "\xEF\xBF\xBD");
  EXPECT_EQ(t.Decode(Ids{B('a'), 10 + 0x80, B('b')}),
            "a\xEF\xBF\xBD"
            "b");
}

TEST(TokenizerMini, RoundTripsVariedText) {
  const Tokenizer& t = Mini();
  for (std::string_view text :
       {"Hello, World!  It's 2024-03-15.\n\n\tdef f(x):\n        return x**2  \r\n",
        "人工智能 😀👍🏽 naïve café",
        "eBay NaOH pH iPhone 1234567 https://x.y/z?a=1&b=2", "<user>hi〈|EOS|〉 [W] <user>!",
        "   leading and trailing   ", "\u00a0\u3000\u2028x\u0085y"}) {
    EXPECT_EQ(t.Decode(Enc(t, text)), text);
  }
}

TEST(TokenizerMini, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  nlohmann::json j = MiniJson();
  // BPE gives "hell" -> he ll (rank 1 before the "hell" merge path); the vocabulary has "hell".
  EXPECT_EQ(Enc(Mini(), "hell"), (Ids{267, 270}));
  j["model"]["ignore_merges"] = true;
  auto t = Tokenizer::FromJson(j.dump(), "ignore_merges.json");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(Enc(*t, "hell"), (Ids{272}));
  EXPECT_EQ(Enc(*t, "hello"), (Ids{267, 270, B('o')}));  // not in the vocabulary: BPE as usual
}

TEST(TokenizerMini, BytesMissingFromTheVocabularyAreDropped) {
  nlohmann::json j = MiniJson();
  j["model"]["vocab"].erase("z");
  auto t = Tokenizer::FromJson(j.dump(), "no_z.json");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(Enc(*t, "zaz"), (Ids{B('a')}));  // HF drops them when there is no unk_token
}

TEST(TokenizerMini, ArrayFormMergesGiveTheSameResult) {
  nlohmann::json j = MiniJson();
  nlohmann::json pairs = nlohmann::json::array();
  for (const auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    pairs.push_back({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  j["model"]["merges"] = pairs;
  auto t = Tokenizer::FromJson(j.dump(), "array_merges.json");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(Enc(*t, "hello world, 你 eBay"), Enc(Mini(), "hello world, 你 eBay"));
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer behaviours on small synthetic files.

std::string SplitOnlyJson(const std::string& pattern_kind, const std::string& pattern,
                          const std::string& behavior, bool invert) {
  nlohmann::json j = {
      {"version", "1.0"},
      {"added_tokens", nlohmann::json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{pattern_kind, pattern}}},
           {"behavior", behavior},
           {"invert", invert}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", nlohmann::json::object()},
        {"merges", nlohmann::json::array()}}}};
  return j.dump();
}

Pieces SplitWith(const std::string& behavior, bool invert = false,
                 const std::string& kind = "String", const std::string& pattern = "-") {
  auto t = Tokenizer::FromJson(SplitOnlyJson(kind, pattern, behavior, invert), "split.json");
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? Pre(*t, "the-final--countdown") : Pieces{};
}

TEST(TokenizerSplit, BehavioursMatchTheTokenizersDocumentation) {
  // Examples from the docstring of tokenizers' NormalizedString::split (empty pieces dropped).
  EXPECT_EQ(SplitWith("Removed"), (Pieces{"the", "final", "countdown"}));
  EXPECT_EQ(SplitWith("Isolated"), (Pieces{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(SplitWith("MergedWithPrevious"), (Pieces{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(SplitWith("MergedWithNext"), (Pieces{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(SplitWith("Contiguous"), (Pieces{"the", "-", "final", "--", "countdown"}));
  // Inverted: the words are the matches, so Removed keeps only the dashes.
  EXPECT_EQ(SplitWith("Removed", /*invert=*/true), (Pieces{"-", "-", "-"}));
  // A String pattern is literal; the same text as a Regex is a pattern.
  EXPECT_EQ(SplitWith("Isolated", false, "String", "."), (Pieces{"the-final--countdown"}));
  EXPECT_EQ(SplitWith("Removed", false, "Regex", "-+"), (Pieces{"the", "final", "countdown"}));
}

TEST(TokenizerSplit, Gpt2ByteLevelWithPrefixSpace) {
  nlohmann::json j = nlohmann::json::parse(SplitOnlyJson("String", "-", "Isolated", false));
  j["pre_tokenizer"] = {{"type", "ByteLevel"},
                        {"add_prefix_space", true},
                        {"trim_offsets", true},
                        {"use_regex", true}};
  auto t = Tokenizer::FromJson(j.dump(), "gpt2.json");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // GPT-2: a space is prepended, then ' ?\p{L}+' words, '\s+(?!\S)' leaves one space to the word.
  EXPECT_EQ(Pre(*t, "Hello  world 42!"), (Pieces{" Hello", " ", " world", " 42", "!"}));
  EXPECT_EQ(Pre(*t, " x"), (Pieces{" x"}));  // already starts with a space: nothing prepended
}

// ---------------------------------------------------------------------------------------------
// Errors name the file and the field.

Status LoadError(const nlohmann::json& j) {
  auto t = Tokenizer::FromJson(j.dump(), "broken.json");
  return t.ok() ? Status::Ok() : t.status();
}

void ExpectError(const Status& s, StatusCode code, std::initializer_list<std::string_view> parts) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), code) << s.ToString();
  for (std::string_view p : parts)
    EXPECT_NE(s.message().find(p), std::string::npos) << s.ToString();
}

TEST(TokenizerErrors, NamesFileAndField) {
  {
    nlohmann::json j = MiniJson();
    j["normalizer"] = {{"type", "NFC"}};
    ExpectError(LoadError(j), StatusCode::kUnimplemented, {"broken.json", "normalizer", "NFC"});
  }
  {
    nlohmann::json j = MiniJson();
    j["model"]["merges"][3] = "i nope";
    ExpectError(LoadError(j), StatusCode::kInvalidArgument,
                {"broken.json", "model.merges[3]", "nope"});
  }
  {
    nlohmann::json j = MiniJson();
    j["model"]["merges"][0] = "a b c";
    ExpectError(LoadError(j), StatusCode::kInvalidArgument, {"model.merges[0]"});
  }
  {
    nlohmann::json j = MiniJson();
    j["model"]["byte_fallback"] = true;
    ExpectError(LoadError(j), StatusCode::kUnimplemented, {"model.byte_fallback"});
  }
  {
    nlohmann::json j = MiniJson();
    j["pre_tokenizer"]["pretokenizers"][1]["pattern"]["Regex"] = "(unclosed";
    ExpectError(LoadError(j), StatusCode::kInvalidArgument,
                {"pre_tokenizer.pretokenizers[1]", "(unclosed"});
  }
  {
    nlohmann::json j = MiniJson();
    j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
    ExpectError(LoadError(j), StatusCode::kInvalidArgument, {"behavior", "Sideways"});
  }
  {
    nlohmann::json j = MiniJson();
    j["pre_tokenizer"] = {{"type", "Whitespace"}};
    ExpectError(LoadError(j), StatusCode::kUnimplemented, {"pre_tokenizer", "Whitespace"});
  }
  {
    nlohmann::json j = MiniJson();
    j["decoder"] = {{"type", "Metaspace"}};
    ExpectError(LoadError(j), StatusCode::kUnimplemented, {"decoder", "Metaspace"});
  }
  {
    nlohmann::json j = MiniJson();
    j["model"]["vocab"]["Ġt"] = "x";
    ExpectError(LoadError(j), StatusCode::kInvalidArgument, {"model.vocab[\"Ġt\"]"});
  }
  {
    nlohmann::json j = MiniJson();
    j["added_tokens"][1]["special"] = "yes";
    ExpectError(LoadError(j), StatusCode::kInvalidArgument, {"added_tokens[1].special"});
  }
  auto bad = Tokenizer::FromJson("{\"model\": ", "truncated.json");
  ExpectError(bad.status(), StatusCode::kDataLoss, {"truncated.json"});
  auto missing = Tokenizer::FromFile("/nonexistent/dir/tokenizer.json");
  ExpectError(missing.status(), StatusCode::kNotFound, {"/nonexistent/dir/tokenizer.json"});
}

TEST(TokenizerErrors, UnsupportedPostProcessorOnlyFailsWhenUsed) {
  nlohmann::json j = MiniJson();
  j["post_processor"] = {{"type", "RobertaProcessing"}};
  auto t = Tokenizer::FromJson(j.dump(), "roberta.json");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->Encode("hi", false).ok());
  ExpectError(t->Encode("hi", true).status(), StatusCode::kUnimplemented, {"RobertaProcessing"});
}

TEST(TokenizerMini, LoadsFromADirectory) {
  auto t = Tokenizer::FromFile(std::string(DECODELAB_SOURCE_DIR) + "/tests/data/tokenizer/mini");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->vocab_size(), 291);
}

}  // namespace
}  // namespace dl
