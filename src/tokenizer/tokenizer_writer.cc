#include "tokenizer/tokenizer_writer.h"

#include <array>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "tokenizer/bpe_trainer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace dl {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::array<AddedTokenSpec, 31> kAddedTokens = {{
    {0, "〈|UNK|〉", true},
    {1, "〈|CODE_START|〉", true},
    {2, "〈|EOS|〉", true},
    {3, "〈|CODE_END|〉", true},
    {4, "〈|FIM_START|〉", true},
    {5, "〈|FIM_MIDDLE|〉", true},
    {6, "〈|FIM_SUFFIX|〉", true},
    {7, "〈|META_START|〉", true},
    {8, "〈|META_END|〉", true},
    {9, "〈|PAD|〉", true},
    {10, "〈|RESERVED_10|〉", true},
    {11, "〈|RESERVED_11|〉", true},
    {12, "〈|MASK|〉", true},
    {13, "<system>", false},
    {14, "</system>", false},
    {15, "<user>", false},
    {16, "</user>", false},
    {17, "<think>", false},
    {18, "</think>", false},
    {19, "<tool_call>", false},
    {20, "</tool_call>", false},
    {21, "<arg_key>", false},
    {22, "</arg_key>", false},
    {23, "<assistant>", false},
    {24, "</assistant>", false},
    {25, "<arg_value>", false},
    {26, "</arg_value>", false},
    {27, "<tool_response>", false},
    {28, "</tool_response>", false},
    {29, "<available_tools>", false},
    {30, "</available_tools>", false},
}};

// Built-in training text: chat-style prose, code with indentation in several languages, numbers,
// mixed case, contractions, CJK and emoji, so that the few hundred merges are the common ones.
constexpr std::string_view kCorpus =
    R"corpus(The quick brown fox jumps over the lazy dog. The dog doesn't mind; it's asleep.
You are a helpful assistant. The user asks a question and the assistant answers it.
I'm sure we'll see that they've done what you'd expect, and I'll tell them what it's for.
Hello, world! How are you today? I am fine, thank you. What is the weather like in Paris?
The function returns the number of tokens in the input string, or an error when the input is not valid.
This model was trained on code and text. It can write programs, explain them and fix their bugs.
Please summarize the following document in three sentences, and then list the key points.
eBay, iPhone, NaOH, pH, McDonald's, YouTube, JavaScript, TypeScript, GitHub, macOS, OpenAI, PyTorch.
The meeting is at 10:30 on 2024-03-15; the budget is $1,234,567.89 and the growth was 12.5% in Q3.
Call 555-0123 or visit https://example.com/docs/getting-started?lang=en&page=2#install for help.
E-mail: first.last@example.org; path: /usr/local/lib/python3.12/site-packages/; version v0.23.2
def main(argv):
    parser = argparse.ArgumentParser(description="Count the words in a file.")
    parser.add_argument("path", help="the file to read")
    args = parser.parse_args(argv)
    counts = {}
    with open(args.path, encoding="utf-8") as f:
        for line in f:
            for word in line.split():
                counts[word] = counts.get(word, 0) + 1
    for word, n in sorted(counts.items(), key=lambda kv: -kv[1])[:10]:
        print(f"{word}\t{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help") {
      std::printf("usage: %s [--help] FILE...\n", argv[0]);
      return 0;
    }
  }
  return args.empty() ? 1 : 0;
}

function fetchUser(id) {
  return fetch(`/api/users/${id}`)
    .then((response) => response.json())
    .catch((error) => console.error("request failed:", error));
}

fn parse_line(line: &str) -> Result<(String, u32), ParseError> {
    let mut parts = line.splitn(2, '=');
    let key = parts.next().ok_or(ParseError::Missing)?.trim().to_string();
    let value = parts.next().ok_or(ParseError::Missing)?.trim().parse::<u32>()?;
    Ok((key, value))
}

for f in *.txt; do
	echo "processing $f"
	wc -l "$f" >> counts.log
done

SELECT name, COUNT(*) AS total FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY total DESC;
{"model": "laguna", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 128, "stream": true}
<system>You are a helpful assistant.</system>
<user>What is 2 + 2?</user>
<assistant><think>The user wants a simple sum.</think>2 + 2 = 4.</assistant>
<user>Read the file config.yaml.</user>
<assistant></think><tool_call>read_file<arg_key>path</arg_key><arg_value>config.yaml</arg_value></tool_call></assistant>
<tool_response>port: 8080
workers: 4</tool_response>
人工智能正在改变世界。我们今天去公园散步吧。这个函数返回一个列表。
日本語のテキストも少し入れておきます。東京は大きな都市です。
한국어 문장도 조금 있습니다. 감사합니다.
Emoji: 😀 🎉 👍🏽 🚀 ❤️ 👨‍👩‍👧 — and symbols: © ® ™ € £ ¥ ° ± × ÷ → ← ≤ ≥ ≠ ∞ … « » “quotes” ‘single’.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 65536 3.14159 2.71828 1e-6 0x1F -17
!!! ??? ... --- *** ### === ;;; ::: ((( ))) [[[ ]]] {{{ }}} <<< >>> /// \\\ ||| &&& %%% $$$
Tabs	and	spaces    mixed   together,  with	trailing whitespace   
Several blank lines follow.



The end.
)corpus";
// Carriage returns cannot be written inside the raw string above.
constexpr std::string_view kCorpusCrLf = "Windows line endings\r\nare here too.\r\n\r\nDone.\r\n";

ojson AddedTokenJson(const AddedTokenSpec& t, bool with_id) {
  ojson j;
  if (with_id) j["id"] = t.id;
  j["content"] = std::string(t.content);
  j["single_word"] = false;
  j["lstrip"] = false;
  j["rstrip"] = false;
  j["normalized"] = false;
  j["special"] = t.special;
  return j;
}

ojson ByteLevelJson(bool add_prefix_space, bool trim_offsets, bool use_regex) {
  ojson j;
  j["type"] = "ByteLevel";
  j["add_prefix_space"] = add_prefix_space;
  j["trim_offsets"] = trim_offsets;
  j["use_regex"] = use_regex;
  return j;
}

ojson SplitJson(std::string_view pattern, const char* behavior) {
  ojson j;
  j["type"] = "Split";
  j["pattern"]["Regex"] = std::string(pattern);
  j["behavior"] = behavior;
  j["invert"] = false;
  return j;
}

// tokenizer.json with the given merges (raw-byte pairs); vocab = added tokens, bytes, merge
// results.
ojson TokenizerJson(const std::vector<BpeMerge>& merges) {
  ojson root;
  root["version"] = "1.0";
  root["truncation"] = nullptr;
  root["padding"] = nullptr;
  root["added_tokens"] = ojson::array();
  for (const auto& t : kAddedTokens) root["added_tokens"].push_back(AddedTokenJson(t, true));
  root["normalizer"] = nullptr;
  ojson pre;
  pre["type"] = "Sequence";
  pre["pretokenizers"] = ojson::array({SplitJson(kLagunaNewlineRunPattern, "MergedWithNext"),
                                       SplitJson(kLagunaSplitPattern, "Isolated"),
                                       ByteLevelJson(false, false, false)});
  root["pre_tokenizer"] = pre;
  root["post_processor"] = ByteLevelJson(false, false, false);
  root["decoder"] = ByteLevelJson(true, true, true);

  ojson model;
  model["type"] = "BPE";
  model["dropout"] = nullptr;
  model["unk_token"] = nullptr;
  model["continuing_subword_prefix"] = nullptr;
  model["end_of_word_suffix"] = nullptr;
  model["fuse_unk"] = false;
  model["byte_fallback"] = false;
  model["ignore_merges"] = false;
  ojson vocab = ojson::object();
  int32_t next_id = 0;
  for (const auto& t : kAddedTokens) vocab[std::string(t.content)] = next_id++;
  for (int b = 0; b < 256; ++b) {
    vocab[utf8::BytesToByteLevel(std::string(1, static_cast<char>(b)))] = next_id++;
  }
  ojson merge_list = ojson::array();
  for (const BpeMerge& m : merges) {
    const std::string left = utf8::BytesToByteLevel(m.left);
    const std::string right = utf8::BytesToByteLevel(m.right);
    if (m.new_token) vocab[left + right] = next_id++;
    merge_list.push_back(ojson::array({left, right}));
  }
  model["vocab"] = std::move(vocab);
  model["merges"] = std::move(merge_list);
  root["model"] = std::move(model);
  return root;
}

ojson TokenizerConfigJson() {
  ojson cfg;
  cfg["add_bos_token"] = false;
  cfg["add_eos_token"] = false;
  ojson decoder = ojson::object();
  for (const auto& t : kAddedTokens) decoder[std::to_string(t.id)] = AddedTokenJson(t, false);
  cfg["added_tokens_decoder"] = std::move(decoder);
  const std::string eos(kAddedTokens[kLagunaEosId].content);
  cfg["bos_token"] = eos;
  cfg["eos_token"] = eos;
  cfg["pad_token"] = std::string(kAddedTokens[kLagunaPadId].content);
  cfg["clean_up_tokenization_spaces"] = false;
  cfg["model_max_length"] = 131072;
  cfg["tokenizer_class"] = "PreTrainedTokenizerFast";
  return cfg;
}

Status WriteText(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return NotFound("cannot create '{}'", path.string());
  out << text;
  out.close();
  if (!out) return DataLoss("error writing '{}'", path.string());
  return Status::Ok();
}

}  // namespace

std::span<const AddedTokenSpec> LagunaStyleAddedTokens() {
  return kAddedTokens;
}

int32_t MinSmallTokenizerVocabSize() {
  return static_cast<int32_t>(kAddedTokens.size()) + 256;
}

Result<std::string> BuildSmallTokenizerJson(int32_t vocab_size) {
  const int32_t min_size = MinSmallTokenizerVocabSize();
  if (vocab_size < min_size) {
    return InvalidArgument(
        "tokenizer vocab_size {} is too small: the {} added tokens and 256 byte "
        "tokens need at least {}",
        vocab_size, kAddedTokens.size(), min_size);
  }
  // Pre-tokenize the corpus with the very pipeline the result will use (a merge-free tokenizer of
  // the same structure), so that merges never cross a piece boundary the encoder will cut.
  const std::string bootstrap = TokenizerJson({}).dump();
  DL_ASSIGN_OR_RETURN(Tokenizer base,
                      Tokenizer::FromJson(bootstrap, "<small tokenizer bootstrap>"));
  DL_ASSIGN_OR_RETURN(std::vector<std::string> pieces, base.PreTokenize(kCorpus));
  DL_ASSIGN_OR_RETURN(std::vector<std::string> crlf_pieces, base.PreTokenize(kCorpusCrLf));
  pieces.insert(pieces.end(), crlf_pieces.begin(), crlf_pieces.end());
  std::map<std::string, int64_t> counts;
  for (std::string& piece : pieces) {
    if (base.TokenToId(piece) &&
        base.TokenToId(piece).value() < static_cast<int32_t>(kAddedTokens.size())) {
      continue;  // an added token, never split by BPE
    }
    counts[std::move(piece)] += 1;
  }
  std::vector<std::pair<std::string, int64_t>> words(counts.begin(), counts.end());
  const std::vector<BpeMerge> merges =
      TrainBytePairMerges(words, static_cast<size_t>(vocab_size - min_size), /*min_frequency=*/2);
  return TokenizerJson(merges).dump(2);
}

Status WriteSmallTokenizer(const std::string& dir, int32_t vocab_size) {
  DL_ASSIGN_OR_RETURN(std::string tokenizer_json, BuildSmallTokenizerJson(vocab_size));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return NotFound("cannot create directory '{}': {}", dir, ec.message());
  const std::filesystem::path base(dir);
  DL_RETURN_IF_ERROR(WriteText(base / "tokenizer.json", tokenizer_json + "\n"));
  DL_RETURN_IF_ERROR(
      WriteText(base / "tokenizer_config.json", TokenizerConfigJson().dump(2) + "\n"));
  // Check what was written, as a reader will see it.
  DL_ASSIGN_OR_RETURN(Tokenizer check, Tokenizer::FromFile((base / "tokenizer.json").string()));
  if (check.vocab_size() > vocab_size) {
    return Internal("written tokenizer has {} ids, more than vocab_size {}", check.vocab_size(),
                    vocab_size);
  }
  return Status::Ok();
}

}  // namespace dl
