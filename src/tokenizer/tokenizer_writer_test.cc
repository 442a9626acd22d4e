#include "tokenizer/tokenizer_writer.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tokenizer/bpe_trainer.h"
#include "tokenizer/tokenizer.h"

namespace dl {
namespace {

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::filesystem::path TempDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("dl_tokenizer_writer_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(BpeTrainer, LearnsTheMostFrequentPairsFirst) {
  // "aaab" x3, "ab" x2. Counts: (a,a) 6, (a,b) 5 -> merge aa; "aaab" = aa a b. Then (a,b) 3+2 = 5,
  // (aa,a) 3 -> merge ab; "aaab" = aa ab. Then (aa,ab) 3 -> merge aaab. Then no pairs are left.
  const std::vector<std::pair<std::string, int64_t>> words = {{"aaab", 3}, {"ab", 2}};
  auto merges = TrainBytePairMerges(words, 10);
  ASSERT_EQ(merges.size(), 3u);
  EXPECT_EQ(merges[0].left + "|" + merges[0].right, "a|a");
  EXPECT_EQ(merges[1].left + "|" + merges[1].right, "a|b");
  EXPECT_EQ(merges[2].left + "|" + merges[2].right, "aa|ab");
  // min_frequency 4 stops before the third merge (count 3); max_new_tokens 1 after the first.
  EXPECT_EQ(TrainBytePairMerges(words, 10, 4).size(), 2u);
  EXPECT_EQ(TrainBytePairMerges(words, 1).size(), 1u);
}

TEST(SmallTokenizer, WritesALoadableLagunaShapedTokenizer) {
  const auto dir = TempDir("512");
  ASSERT_TRUE(WriteSmallTokenizer(dir.string(), 512).ok());
  auto loaded = Tokenizer::FromFile(dir.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const Tokenizer& t = *loaded;
  EXPECT_LE(t.vocab_size(), 512);
  EXPECT_GT(t.num_merges(), 150u);  // the corpus is rich enough to fill most of the 225 slots

  // Laguna's ids.
  EXPECT_EQ(t.TokenToId("〈|CODE_START|〉"), 1);
  EXPECT_EQ(t.TokenToId("〈|EOS|〉"), kLagunaEosId);
  EXPECT_EQ(t.TokenToId("〈|CODE_END|〉"), 3);
  EXPECT_EQ(t.TokenToId("〈|PAD|〉"), kLagunaPadId);
  EXPECT_EQ(t.TokenToId("</assistant>"), kLagunaEndOfTurnId);
  for (const AddedTokenSpec& a : LagunaStyleAddedTokens()) {
    EXPECT_EQ(t.TokenToId(a.content), a.id) << a.content;
    EXPECT_EQ(t.IsSpecial(a.id), a.special) << a.content;
  }
  for (std::string_view marker :
       {"<system>", "</system>", "<user>", "</user>", "<assistant>", "<think>", "</think>",
        "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
        "<tool_response>", "</tool_response>", "<available_tools>", "</available_tools>"}) {
    EXPECT_TRUE(t.TokenToId(marker).has_value()) << marker;
  }

  // Round trips, every id in range.
  for (std::string_view text :
       {"〈|EOS|〉<system>You are helpful.</system>\n<user>Hi! What's 1234567 + "
        "89?</user>\n<assistant><think>",
        "def f(x):\n    return x * 2\n\n\n# done\r\n",
        "人工智能 😀👍🏽 naïve café eBay NaOH pH iPhone", "\t\t  mixed   spaces\t\n  ",
        "https://example.com/a?b=c&d=e#f", "", "\n\n\n", "\u00a0\u3000\u0085",
        "<tool_call>read_file<arg_key>path</arg_key><arg_value>a.txt</arg_value></tool_call></"
        "assistant>"}) {
    auto ids = t.Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    for (int32_t id : *ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, 512);
    }
    EXPECT_EQ(t.Decode(*ids), text);
  }
  // Chat markers are single tokens; common words got merges.
  EXPECT_EQ(*t.Encode("<assistant></think>"), (std::vector<int32_t>{23, 18}));
  EXPECT_LT(t.Encode(" the")->size(), 4u);

  // tokenizer_config.json for transformers.
  auto cfg = nlohmann::json::parse(ReadAll(dir / "tokenizer_config.json"));
  EXPECT_EQ(cfg["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(cfg["bos_token"], "〈|EOS|〉");
  EXPECT_EQ(cfg["eos_token"], "〈|EOS|〉");
  EXPECT_EQ(cfg["pad_token"], "〈|PAD|〉");
  EXPECT_FALSE(cfg.contains("chat_template"));
  EXPECT_EQ(cfg["added_tokens_decoder"]["24"]["content"], "</assistant>");
  std::filesystem::remove_all(dir);
}

TEST(SmallTokenizer, IsDeterministicAndFitsTheRequestedSize) {
  auto a = BuildSmallTokenizerJson(400);
  auto b = BuildSmallTokenizerJson(400);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  auto t = Tokenizer::FromJson(*a, "small400");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->vocab_size(), 400);  // the corpus has far more than 113 frequent pairs
  // The smallest size: added tokens and bytes only, no merges.
  auto min = BuildSmallTokenizerJson(MinSmallTokenizerVocabSize());
  ASSERT_TRUE(min.ok());
  auto tmin = Tokenizer::FromJson(*min, "small_min");
  ASSERT_TRUE(tmin.ok());
  EXPECT_EQ(tmin->num_merges(), 0u);
  EXPECT_EQ(tmin->Decode(*tmin->Encode("still round-trips: 你好")), "still round-trips: 你好");
}

TEST(SmallTokenizer, RejectsATooSmallVocabulary) {
  auto r = BuildSmallTokenizerJson(MinSmallTokenizerVocabSize() - 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("vocab_size"), std::string::npos);
}

}  // namespace
}  // namespace dl
