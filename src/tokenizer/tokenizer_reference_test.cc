// Checks dl::Tokenizer against encodings produced by Hugging Face `tokenizers` itself
// (tools/reference/train_tokenizer.py writes tests/data/tokenizer/trained/). Skips, visibly, until
// those files are committed.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tokenizer/incremental_decoder.h"
#include "tokenizer/tokenizer.h"

namespace dl {
namespace {

std::string DataDir() {
  return std::string(DECODELAB_SOURCE_DIR) + "/tests/data/tokenizer";
}

std::string Escaped(const std::string& s) {
  return nlohmann::json(s).dump();
}

// Every directory under tests/data/tokenizer/ that holds both tokenizer.json and
// reference_encodings.json (trained/, and the --check-tokenizer outputs such as trained/mini/).
std::vector<std::filesystem::path> ReferenceDirs() {
  std::vector<std::filesystem::path> dirs;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(DataDir(), ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_directory() && std::filesystem::exists(it->path() / "tokenizer.json") &&
        std::filesystem::exists(it->path() / "reference_encodings.json")) {
      dirs.push_back(it->path());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

void CheckDir(const std::filesystem::path& dir) {
  SCOPED_TRACE(dir.string());
  auto tok = Tokenizer::FromFile((dir / "tokenizer.json").string());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  std::ifstream in(dir / "reference_encodings.json");
  nlohmann::json refs = nlohmann::json::parse(in);
  ASSERT_TRUE(refs.is_array());
  ASSERT_FALSE(refs.empty());
  for (const auto& r : refs) {
    const std::string text = r.at("text").get<std::string>();
    const auto want = r.at("ids").get<std::vector<int32_t>>();
    auto got = tok->Encode(text);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, want) << "text " << Escaped(text);
    const std::string decoded = r.at("decoded").get<std::string>();
    EXPECT_EQ(tok->Decode(want), decoded) << "text " << Escaped(text);
    if (r.contains("decoded_skip_special")) {
      EXPECT_EQ(tok->Decode(want, true), r.at("decoded_skip_special").get<std::string>())
          << "text " << Escaped(text);
    }
    // Streaming gives the same text.
    IncrementalDecoder dec(*tok);
    std::string streamed;
    for (int32_t id : want) streamed += dec.Add(id);
    streamed += dec.Flush();
    EXPECT_EQ(streamed, decoded) << "text " << Escaped(text);
  }
}

TEST(TokenizerReference, MatchesHuggingFaceTokenizers) {
  const auto dirs = ReferenceDirs();
  if (dirs.empty()) {
    GTEST_SKIP() << "no reference_encodings.json under " << DataDir()
                 << ": run tools/reference/train_tokenizer.py --out " << DataDir()
                 << "/trained on a machine with tokenizers 0.23 and commit the output";
  }
  for (const auto& dir : dirs) CheckDir(dir);
}

}  // namespace
}  // namespace dl
