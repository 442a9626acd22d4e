#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <queue>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "base/file_util.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace dl {
namespace {

using json = nlohmann::json;

// HF's BPE cache rules: words shorter than 256 bytes, at most 10,000 of them.
constexpr size_t kCacheMaxWordBytes = 256;
constexpr size_t kCacheCapacity = 10000;
// Ids above this are refused as implausible (they would size the id tables).
constexpr int64_t kMaxTokenId = 1 << 24;

// GPT-2's pattern, which HF's ByteLevel pre-tokenizer applies when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct SplitStep {
  Regex regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

// Leftmost-longest matcher over a set of added tokens (HF builds an Aho-Corasick automaton; the
// sets are small, so candidates by first byte, longest first, give the same matches).
struct AddedMatcher {
  std::array<std::vector<int32_t>, 256> by_first_byte;  // indices into Impl::added
  bool empty = true;
};

struct Segment {
  size_t begin;
  size_t end;
  int32_t id;  // -1: text still to be pre-tokenized
};

std::string JoinPath(const std::string& a, const std::string& b) {
  return a + "." + b;
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;

  // Model.
  std::unordered_map<std::string, int32_t> vocab;        // byte-level token string -> id
  std::unordered_map<std::string, int32_t> bytes_vocab;  // raw bytes -> id (reachable tokens)
  std::vector<std::string> vocab_r;                      // id -> token string
  std::vector<uint8_t> vocab_r_present;
  std::array<int32_t, 256> byte_ids{};  // initial BPE symbol of each byte, -1 none
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges;  // (a, b) -> (rank, new id)
  size_t num_merges = 0;
  bool ignore_merges = false;
  int32_t unk_id = -1;
  bool fuse_unk = false;

  // Added tokens, with the ids HF assigns them.
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_map;  // content -> id
  std::unordered_map<int32_t, size_t> added_by_id;     // id -> index into `added`
  std::unordered_set<std::string> special_set;
  AddedMatcher match_raw;         // normalized == false
  AddedMatcher match_normalized;  // normalized == true

  // Pre-tokenizer: Split steps, then ByteLevel.
  std::vector<SplitStep> splits;
  bool add_prefix_space = false;
  std::optional<Regex> gpt2;  // set when ByteLevel.use_regex

  // Post-processor (only for add_special_tokens).
  bool post_supported = true;
  std::string post_unsupported_reason;
  bool has_template = false;
  std::vector<std::vector<int32_t>> template_pieces;  // empty vector = the sequence itself
  std::vector<bool> template_is_sequence;

  // Decoding tables, by id.
  std::vector<std::string> id_bytes;
  std::vector<uint8_t> id_flags;  // bit 0: known, bit 1: special
  int32_t vocab_size = 0;

  // BPE cache: raw word bytes -> ids.
  mutable std::shared_mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  // --- encoding ---
  void FindAdded(std::string_view text, size_t base, const AddedMatcher& m,
                 std::vector<Segment>& out) const;
  Status SplitPieces(std::string_view piece, std::vector<std::string_view>& out) const;
  Status ByteLevelPieces(std::string_view piece, std::vector<std::string>& out) const;
  void Bpe(std::string_view word, std::vector<int32_t>& out) const;
  void BpeUncached(std::string_view word, std::vector<int32_t>& out) const;
  Status SegmentText(std::string_view text, std::vector<Segment>& out) const;
  Status EncodeRaw(std::string_view text, std::vector<int32_t>& ids) const;
};

namespace {

// ---------------------------------------------------------------------------------------------
// JSON helpers: every error names the file and the field.

class Parser {
 public:
  explicit Parser(std::string origin) : origin_(std::move(origin)) {}

  Status Error(const std::string& field, const std::string& what) const {
    return InvalidArgument("{}: field '{}': {}", origin_, field, what);
  }
  Status Unsupported(const std::string& field, const std::string& what) const {
    return Unimplemented("{}: field '{}': {}", origin_, field, what);
  }

  Result<std::string> String(const json& j, const std::string& field) const {
    if (!j.is_string())
      return Error(field, fmt::format("expected a string, got {}", j.type_name()));
    return j.get<std::string>();
  }
  Result<bool> Bool(const json& obj, const std::string& key, const std::string& field,
                    bool fallback) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) {
      return Error(JoinPath(field, key),
                   fmt::format("expected true/false, got {}", it->type_name()));
    }
    return it->get<bool>();
  }
  Result<int64_t> Int(const json& j, const std::string& field) const {
    if (!j.is_number_integer()) {
      return Error(field, fmt::format("expected an integer, got {}", j.type_name()));
    }
    return j.get<int64_t>();
  }
  Result<std::string> Type(const json& obj, const std::string& field) const {
    if (!obj.is_object())
      return Error(field, fmt::format("expected an object, got {}", obj.type_name()));
    auto it = obj.find("type");
    if (it == obj.end()) return Error(field, "missing 'type'");
    return String(*it, JoinPath(field, "type"));
  }
  const std::string& origin() const { return origin_; }

 private:
  std::string origin_;
};

Status ParseModel(const Parser& p, const json& model, Tokenizer::Impl& t) {
  DL_ASSIGN_OR_RETURN(std::string type, p.Type(model, "model"));
  if (type != "BPE")
    return p.Unsupported("model.type", fmt::format("model '{}' is not supported (only BPE)", type));

  if (auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 0.0) {
      return p.Unsupported("model.dropout", "BPE dropout is not supported (expected null)");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (auto it = model.find(key); it != model.end() && !it->is_null()) {
      if (!it->is_string() || !it->get<std::string>().empty()) {
        return p.Unsupported(JoinPath("model", key), "must be null for a byte-level BPE");
      }
    }
  }
  DL_ASSIGN_OR_RETURN(bool byte_fallback, p.Bool(model, "byte_fallback", "model", false));
  if (byte_fallback) {
    return p.Unsupported("model.byte_fallback",
                         "byte_fallback is not supported (byte-level BPE expected)");
  }
  DL_ASSIGN_OR_RETURN(t.ignore_merges, p.Bool(model, "ignore_merges", "model", false));
  DL_ASSIGN_OR_RETURN(t.fuse_unk, p.Bool(model, "fuse_unk", "model", false));

  auto vit = model.find("vocab");
  if (vit == model.end() || !vit->is_object())
    return p.Error("model.vocab", "missing or not an object");
  int64_t max_id = -1;
  t.vocab.reserve(vit->size());
  for (auto it = vit->begin(); it != vit->end(); ++it) {
    const std::string field = fmt::format("model.vocab[\"{}\"]", it.key());
    DL_ASSIGN_OR_RETURN(int64_t id, p.Int(it.value(), field));
    if (id < 0 || id > kMaxTokenId) return p.Error(field, fmt::format("id {} out of range", id));
    t.vocab[it.key()] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  t.vocab_r.assign(static_cast<size_t>(max_id + 1), std::string());
  t.vocab_r_present.assign(static_cast<size_t>(max_id + 1), 0);
  for (const auto& [token, id] : t.vocab) {
    t.vocab_r[id] = token;
    t.vocab_r_present[id] = 1;
    if (auto bytes = utf8::ByteLevelToBytes(token); bytes && !bytes->empty()) {
      t.bytes_vocab.emplace(std::move(*bytes), id);
    }
  }
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    utf8::Append(utf8::ByteToChar(static_cast<uint8_t>(b)), ch);
    auto it = t.vocab.find(ch);
    t.byte_ids[b] = it == t.vocab.end() ? -1 : it->second;
  }

  if (auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
    DL_ASSIGN_OR_RETURN(std::string unk, p.String(*it, "model.unk_token"));
    auto v = t.vocab.find(unk);
    if (v == t.vocab.end())
      return p.Error("model.unk_token", fmt::format("'{}' is not in model.vocab", unk));
    t.unk_id = v->second;
  }

  auto mit = model.find("merges");
  if (mit == model.end() || !mit->is_array())
    return p.Error("model.merges", "missing or not an array");
  t.merges.reserve(mit->size());
  uint32_t rank = 0;
  size_t index = 0;
  for (const json& m : *mit) {
    const std::string field = fmt::format("model.merges[{}]", index++);
    std::string a, b;
    if (m.is_string()) {
      const std::string line = m.get<std::string>();
      if (line.rfind("#version", 0) == 0) continue;  // HF skips a merges.txt header
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos) {
        return p.Error(field,
                       fmt::format("expected \"a b\" (two tokens, one space), got \"{}\"", line));
      }
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return p.Error(field, "expected \"a b\" or [\"a\", \"b\"]");
    }
    auto ia = t.vocab.find(a), ib = t.vocab.find(b), inew = t.vocab.find(a + b);
    if (ia == t.vocab.end())
      return p.Error(field, fmt::format("token '{}' is not in model.vocab", a));
    if (ib == t.vocab.end())
      return p.Error(field, fmt::format("token '{}' is not in model.vocab", b));
    if (inew == t.vocab.end())
      return p.Error(field, fmt::format("merged token '{}' is not in model.vocab", a + b));
    const uint64_t key =
        (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second);
    t.merges[key] = {rank++, inew->second};  // a repeated pair keeps its last rank, as in HF
  }
  t.num_merges = rank;
  return Status::Ok();
}

Status ParseAddedTokens(const Parser& p, const json& root, Tokenizer::Impl& t) {
  auto it = root.find("added_tokens");
  if (it == root.end() || it->is_null()) return Status::Ok();
  if (!it->is_array()) return p.Error("added_tokens", "expected an array");
  // HF (AddedVocabulary::add_tokens): a token already in the vocabulary keeps that id; a new one
  // gets the next id after the model's vocabulary. The file's own "id" is only checked.
  int64_t next_id = static_cast<int64_t>(t.vocab.size());
  size_t index = 0;
  for (const json& tok : *it) {
    const std::string field = fmt::format("added_tokens[{}]", index++);
    if (!tok.is_object()) return p.Error(field, "expected an object");
    AddedToken a;
    auto cit = tok.find("content");
    if (cit == tok.end()) return p.Error(field, "missing 'content'");
    DL_ASSIGN_OR_RETURN(a.content, p.String(*cit, JoinPath(field, "content")));
    if (auto bad = utf8::FindInvalid(a.content))
      return p.Error(JoinPath(field, "content"), "not valid UTF-8");
    DL_ASSIGN_OR_RETURN(a.single_word, p.Bool(tok, "single_word", field, false));
    DL_ASSIGN_OR_RETURN(a.lstrip, p.Bool(tok, "lstrip", field, false));
    DL_ASSIGN_OR_RETURN(a.rstrip, p.Bool(tok, "rstrip", field, false));
    DL_ASSIGN_OR_RETURN(a.normalized, p.Bool(tok, "normalized", field, true));
    DL_ASSIGN_OR_RETURN(a.special, p.Bool(tok, "special", field, false));
    int64_t file_id = -1;
    if (auto iit = tok.find("id"); iit != tok.end()) {
      DL_ASSIGN_OR_RETURN(file_id, p.Int(*iit, JoinPath(field, "id")));
    }
    if (a.content.empty()) continue;
    int64_t id;
    if (auto e = t.added_map.find(a.content); e != t.added_map.end()) {
      id = e->second;
    } else if (auto v = t.vocab.find(a.content); v != t.vocab.end()) {
      id = v->second;
    } else {
      id = next_id++;
    }
    if (id > kMaxTokenId) return p.Error(field, "too many added tokens");
    if (file_id >= 0 && file_id != id) {
      spdlog::warn(
          "{}: added token '{}' is declared with id {} but gets id {} (as in HF tokenizers)",
          p.origin(), a.content, file_id, id);
    }
    a.id = static_cast<int32_t>(id);
    t.added_map[a.content] = a.id;
    if (a.special) t.special_set.insert(a.content);
    if (auto e = t.added_by_id.find(a.id); e != t.added_by_id.end()) {
      t.added[e->second] = a;
    } else {
      t.added_by_id[a.id] = t.added.size();
      t.added.push_back(a);
    }
  }
  // Matchers, longest content first within a first byte (leftmost-longest).
  for (size_t i = 0; i < t.added.size(); ++i) {
    const AddedToken& a = t.added[i];
    if (t.added_map[a.content] != a.id) continue;  // content re-declared under another id
    AddedMatcher& m = a.normalized ? t.match_normalized : t.match_raw;
    m.by_first_byte[static_cast<uint8_t>(a.content[0])].push_back(static_cast<int32_t>(i));
    m.empty = false;
  }
  for (AddedMatcher* m : {&t.match_raw, &t.match_normalized}) {
    for (auto& list : m->by_first_byte) {
      std::stable_sort(list.begin(), list.end(), [&](int32_t x, int32_t y) {
        return t.added[x].content.size() > t.added[y].content.size();
      });
    }
  }
  return Status::Ok();
}

Status ParseNormalizer(const Parser& p, const json& root) {
  auto it = root.find("normalizer");
  if (it == root.end() || it->is_null()) return Status::Ok();
  DL_ASSIGN_OR_RETURN(std::string type, p.Type(*it, "normalizer"));
  if (type == "Sequence") {
    auto n = it->find("normalizers");
    if (n != it->end() && n->is_array() && n->empty()) return Status::Ok();
  }
  return p.Unsupported("normalizer", fmt::format("normalizer '{}' is not supported (only null): it "
                                                 "would change the text before BPE",
                                                 type));
}

Result<SplitBehavior> ParseBehavior(const Parser& p, const json& j, const std::string& field) {
  DL_ASSIGN_OR_RETURN(std::string s, p.String(j, field));
  if (s == "Removed") return SplitBehavior::kRemoved;
  if (s == "Isolated") return SplitBehavior::kIsolated;
  if (s == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (s == "Contiguous") return SplitBehavior::kContiguous;
  return p.Error(field, fmt::format("unknown split behaviour '{}' (Removed, Isolated, "
                                    "MergedWithPrevious, MergedWithNext, Contiguous)",
                                    s));
}

Status ParsePreTokenizer(const Parser& p, const json& root, Tokenizer::Impl& t) {
  auto it = root.find("pre_tokenizer");
  if (it == root.end() || it->is_null()) {
    return p.Unsupported("pre_tokenizer",
                         "null; a ByteLevel pre-tokenizer is required for byte-level BPE");
  }
  DL_ASSIGN_OR_RETURN(std::string type, p.Type(*it, "pre_tokenizer"));
  std::vector<std::pair<const json*, std::string>> steps;
  if (type == "Sequence") {
    auto list = it->find("pretokenizers");
    if (list == it->end() || !list->is_array())
      return p.Error("pre_tokenizer.pretokenizers", "missing or not an array");
    for (size_t i = 0; i < list->size(); ++i) {
      steps.emplace_back(&(*list)[i], fmt::format("pre_tokenizer.pretokenizers[{}]", i));
    }
  } else {
    steps.emplace_back(&*it, "pre_tokenizer");
  }
  bool saw_byte_level = false;
  for (size_t i = 0; i < steps.size(); ++i) {
    const json& step = *steps[i].first;
    const std::string& field = steps[i].second;
    DL_ASSIGN_OR_RETURN(std::string stype, p.Type(step, field));
    if (saw_byte_level) {
      return p.Unsupported(field,
                           "a step after ByteLevel is not supported (ByteLevel must be last)");
    }
    if (stype == "Split") {
      SplitStep s;
      auto pat = step.find("pattern");
      if (pat == step.end() || !pat->is_object() || pat->size() != 1) {
        return p.Error(JoinPath(field, "pattern"),
                       "expected {\"Regex\": ...} or {\"String\": ...}");
      }
      const std::string kind = pat->begin().key();
      if (kind != "Regex" && kind != "String") {
        return p.Error(JoinPath(field, "pattern"), fmt::format("unknown pattern kind '{}'", kind));
      }
      DL_ASSIGN_OR_RETURN(std::string pattern,
                          p.String(pat->begin().value(), JoinPath(field, "pattern." + kind)));
      auto re = Regex::Compile(pattern, kind == "String");
      if (!re.ok())
        return re.status().WithContext(fmt::format("{}: field '{}.pattern'", p.origin(), field));
      s.regex = std::move(re).value();
      auto beh = step.find("behavior");
      if (beh == step.end()) return p.Error(field, "missing 'behavior'");
      DL_ASSIGN_OR_RETURN(s.behavior, ParseBehavior(p, *beh, JoinPath(field, "behavior")));
      DL_ASSIGN_OR_RETURN(s.invert, p.Bool(step, "invert", field, false));
      t.splits.push_back(std::move(s));
    } else if (stype == "ByteLevel") {
      saw_byte_level = true;
      DL_ASSIGN_OR_RETURN(t.add_prefix_space, p.Bool(step, "add_prefix_space", field, true));
      DL_ASSIGN_OR_RETURN(bool use_regex, p.Bool(step, "use_regex", field, true));
      if (use_regex) {
        auto re = Regex::Compile(kGpt2Pattern);
        if (!re.ok()) return re.status();
        t.gpt2 = std::move(re).value();
      }
    } else {
      return p.Unsupported(JoinPath(field, "type"),
                           fmt::format("pre-tokenizer '{}' is not supported "
                                       "(Split, ByteLevel, Sequence)",
                                       stype));
    }
  }
  if (!saw_byte_level) {
    return p.Unsupported("pre_tokenizer", "no ByteLevel step; only byte-level BPE is supported");
  }
  return Status::Ok();
}

Status ParseDecoder(const Parser& p, const json& root) {
  auto it = root.find("decoder");
  if (it == root.end() || it->is_null())
    return p.Unsupported("decoder", "null; ByteLevel is required");
  DL_ASSIGN_OR_RETURN(std::string type, p.Type(*it, "decoder"));
  if (type != "ByteLevel") {
    return p.Unsupported("decoder.type",
                         fmt::format("decoder '{}' is not supported (only ByteLevel)", type));
  }
  return Status::Ok();
}

Status ParseTemplate(const Parser& p, const json& proc, const std::string& field,
                     Tokenizer::Impl& t) {
  auto single = proc.find("single");
  if (single == proc.end() || !single->is_array())
    return p.Error(JoinPath(field, "single"), "missing or not an array");
  auto specials = proc.find("special_tokens");
  for (size_t i = 0; i < single->size(); ++i) {
    const json& piece = (*single)[i];
    const std::string pf = fmt::format("{}.single[{}]", field, i);
    if (piece.contains("Sequence")) {
      t.template_pieces.emplace_back();
      t.template_is_sequence.push_back(true);
    } else if (piece.contains("SpecialToken")) {
      const json& st = piece["SpecialToken"];
      DL_ASSIGN_OR_RETURN(std::string name,
                          p.String(st.value("id", json()), pf + ".SpecialToken.id"));
      if (specials == proc.end() || !specials->is_object() || !specials->contains(name)) {
        return p.Error(JoinPath(field, "special_tokens"), fmt::format("no entry for '{}'", name));
      }
      const json& entry = (*specials)[name];
      auto ids = entry.find("ids");
      if (ids == entry.end() || !ids->is_array()) {
        return p.Error(fmt::format("{}.special_tokens[\"{}\"].ids", field, name),
                       "missing or not an array");
      }
      std::vector<int32_t> v;
      for (const json& id : *ids) {
        DL_ASSIGN_OR_RETURN(int64_t x,
                            p.Int(id, fmt::format("{}.special_tokens[\"{}\"].ids", field, name)));
        v.push_back(static_cast<int32_t>(x));
      }
      t.template_pieces.push_back(std::move(v));
      t.template_is_sequence.push_back(false);
    } else {
      return p.Error(pf, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
  }
  t.has_template = true;
  return Status::Ok();
}

Status ParsePostProcessor(const Parser& p, const json& root, Tokenizer::Impl& t) {
  auto it = root.find("post_processor");
  if (it == root.end() || it->is_null()) return Status::Ok();
  DL_ASSIGN_OR_RETURN(std::string type, p.Type(*it, "post_processor"));
  std::vector<std::pair<const json*, std::string>> procs;
  if (type == "Sequence") {
    auto list = it->find("processors");
    if (list == it->end() || !list->is_array())
      return p.Error("post_processor.processors", "missing or not an array");
    for (size_t i = 0; i < list->size(); ++i) {
      procs.emplace_back(&(*list)[i], fmt::format("post_processor.processors[{}]", i));
    }
  } else {
    procs.emplace_back(&*it, "post_processor");
  }
  for (const auto& [proc, field] : procs) {
    DL_ASSIGN_OR_RETURN(std::string ptype, p.Type(*proc, field));
    if (ptype == "ByteLevel") continue;  // only adjusts offsets
    if (ptype == "TemplateProcessing" && !t.has_template) {
      DL_RETURN_IF_ERROR(ParseTemplate(p, *proc, field, t));
      continue;
    }
    // Encode(add_special_tokens=false), what the engine uses, does not need it.
    t.post_supported = false;
    t.post_unsupported_reason = fmt::format("{}: field '{}': post-processor '{}' is not supported",
                                            p.origin(), field, ptype);
  }
  return Status::Ok();
}

void BuildDecodeTables(Tokenizer::Impl& t) {
  int64_t size = static_cast<int64_t>(t.vocab_r.size());
  for (const AddedToken& a : t.added) size = std::max<int64_t>(size, a.id + 1);
  t.vocab_size = static_cast<int32_t>(size);
  t.id_bytes.assign(size, std::string());
  t.id_flags.assign(size, 0);
  for (int64_t id = 0; id < size; ++id) {
    // HF decode: the added token's content first, else the model's token string.
    const std::string* token = nullptr;
    if (auto a = t.added_by_id.find(static_cast<int32_t>(id)); a != t.added_by_id.end()) {
      token = &t.added[a->second].content;
    } else if (id < static_cast<int64_t>(t.vocab_r.size()) && t.vocab_r_present[id]) {
      token = &t.vocab_r[id];
    }
    if (token == nullptr) continue;
    uint8_t flags = 1;
    if (t.special_set.count(*token)) flags |= 2;
    t.id_flags[id] = flags;
    // ByteLevel decoder: a token made only of alphabet characters stands for those bytes; any
    // other token (e.g. "〈|EOS|〉") contributes its own UTF-8.
    auto bytes = utf8::ByteLevelToBytes(*token);
    t.id_bytes[id] = bytes ? std::move(*bytes) : *token;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Encoding.

void Tokenizer::Impl::FindAdded(std::string_view text, size_t base, const AddedMatcher& m,
                                std::vector<Segment>& out) const {
  if (m.empty) {
    out.push_back({base, base + text.size(), -1});
    return;
  }
  auto prev_char = [&](size_t pos) {  // code point ending at pos (pos > 0)
    size_t q = pos - 1;
    while (q > 0 && (static_cast<uint8_t>(text[q]) & 0xC0) == 0x80) --q;
    return utf8::DecodeAt(text, q);
  };
  auto next_char = [&](size_t pos) { return utf8::DecodeAt(text, pos); };

  size_t start_offset = 0;  // end of the previous accepted match
  size_t pos = 0;
  while (pos < text.size()) {
    const auto& cands = m.by_first_byte[static_cast<uint8_t>(text[pos])];
    const AddedToken* hit = nullptr;
    for (int32_t idx : cands) {
      const AddedToken& a = added[idx];
      if (text.compare(pos, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + hit->content.size();
    pos = stop;  // the automaton resumes after this match even if it is discarded below
    if (hit->single_word) {
      const bool start_space = start == 0 || !utf8::IsWordChar(prev_char(start));
      const bool stop_space = stop == text.size() || !utf8::IsWordChar(next_char(stop));
      if (!start_space || !stop_space) continue;
    }
    if (hit->lstrip) {
      size_t s = start;
      while (s > 0) {
        size_t q = s - 1;
        while (q > 0 && (static_cast<uint8_t>(text[q]) & 0xC0) == 0x80) --q;
        size_t tmp = q;
        if (!utf8::IsWhiteSpace(utf8::DecodeAt(text, tmp))) break;
        s = q;
      }
      start = std::max(s, start_offset);
    }
    if (hit->rstrip) {
      while (stop < text.size()) {
        size_t tmp = stop;
        if (!utf8::IsWhiteSpace(utf8::DecodeAt(text, tmp))) break;
        stop = tmp;
      }
    }
    if (start_offset < start) out.push_back({base + start_offset, base + start, -1});
    out.push_back({base + start, base + stop, hit->id});
    start_offset = stop;
  }
  if (start_offset != text.size()) out.push_back({base + start_offset, base + text.size(), -1});
}

Status Tokenizer::Impl::SegmentText(std::string_view text, std::vector<Segment>& out) const {
  if (auto bad = utf8::FindInvalid(text)) {
    return InvalidArgument("text to encode is not valid UTF-8 (byte {} of {})", *bad, text.size());
  }
  std::vector<Segment> first;
  FindAdded(text, 0, match_raw, first);
  for (const Segment& s : first) {
    if (s.id >= 0) {
      out.push_back(s);
    } else if (s.end > s.begin) {
      FindAdded(text.substr(s.begin, s.end - s.begin), s.begin, match_normalized, out);
    }
  }
  return Status::Ok();
}

Status Tokenizer::Impl::SplitPieces(std::string_view piece,
                                    std::vector<std::string_view>& out) const {
  std::vector<std::string_view> cur{piece}, next;
  std::vector<std::pair<size_t, size_t>> found;
  struct Part {
    size_t begin, end;
    bool flag;
  };
  std::vector<Part> parts, merged;
  for (const SplitStep& step : splits) {
    next.clear();
    for (std::string_view p : cur) {
      found.clear();
      DL_RETURN_IF_ERROR(step.regex.FindAll(p, found));
      // HF Pattern::find_matches: matches and the gaps between them, in order.
      parts.clear();
      size_t prev = 0;
      for (auto [b, e] : found) {
        if (prev != b) parts.push_back({prev, b, false});
        parts.push_back({b, e, true});
        prev = e;
      }
      if (prev != p.size()) parts.push_back({prev, p.size(), false});
      if (step.invert) {
        for (Part& x : parts) x.flag = !x.flag;
      }
      // HF NormalizedString::split; `flag` in `merged` means "remove".
      merged.clear();
      switch (step.behavior) {
        case SplitBehavior::kIsolated:
          for (Part x : parts) merged.push_back({x.begin, x.end, false});
          break;
        case SplitBehavior::kRemoved:
          merged = parts;
          break;
        case SplitBehavior::kContiguous: {
          bool prev_match = false;
          for (Part x : parts) {
            if (x.flag == prev_match && !merged.empty()) {
              merged.back().end = x.end;
            } else {
              merged.push_back({x.begin, x.end, false});
            }
            prev_match = x.flag;
          }
          break;
        }
        case SplitBehavior::kMergedWithPrevious: {
          bool prev_match = false;
          for (Part x : parts) {
            if (x.flag && !prev_match && !merged.empty()) {
              merged.back().end = x.end;
            } else {
              merged.push_back({x.begin, x.end, false});
            }
            prev_match = x.flag;
          }
          break;
        }
        case SplitBehavior::kMergedWithNext: {
          bool prev_match = false;
          for (auto x = parts.rbegin(); x != parts.rend(); ++x) {
            if (x->flag && !prev_match && !merged.empty()) {
              merged.back().begin = x->begin;
            } else {
              merged.push_back({x->begin, x->end, false});
            }
            prev_match = x->flag;
          }
          std::reverse(merged.begin(), merged.end());
          break;
        }
      }
      for (const Part& x : merged) {
        if (!x.flag && x.end > x.begin) next.push_back(p.substr(x.begin, x.end - x.begin));
      }
    }
    std::swap(cur, next);
  }
  out.insert(out.end(), cur.begin(), cur.end());
  return Status::Ok();
}

Status Tokenizer::Impl::ByteLevelPieces(std::string_view piece,
                                        std::vector<std::string>& out) const {
  std::string s;
  if (add_prefix_space && piece.front() != ' ') {
    s.reserve(piece.size() + 1);
    s.push_back(' ');
  }
  s.append(piece);
  if (!gpt2) {
    out.push_back(std::move(s));
    return Status::Ok();
  }
  std::vector<std::pair<size_t, size_t>> found;
  DL_RETURN_IF_ERROR(gpt2->FindAll(s, found));
  size_t prev = 0;  // Isolated: matches and gaps are all kept
  for (auto [b, e] : found) {
    if (prev != b) out.push_back(s.substr(prev, b - prev));
    if (e > b) out.push_back(s.substr(b, e - b));
    prev = e;
  }
  if (prev != s.size()) out.push_back(s.substr(prev));
  return Status::Ok();
}

void Tokenizer::Impl::BpeUncached(std::string_view word, std::vector<int32_t>& out) const {
  // HF BPE::merge_word over the byte-level characters (one per byte), then Word::merge_all.
  struct Symbol {
    int32_t c;
    int32_t prev, next;
    uint32_t len;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  auto add = [&](int32_t c, uint32_t len) {
    const int32_t n = static_cast<int32_t>(sym.size());
    if (!sym.empty()) sym.back().next = n;
    sym.push_back({c, n - 1, -1, len});
  };
  int32_t pending_unk_len = 0;  // bytes of a pending (possibly fused) unknown run
  for (char ch : word) {
    const int32_t id = byte_ids[static_cast<uint8_t>(ch)];
    if (id >= 0) {
      if (pending_unk_len > 0) {
        add(unk_id, pending_unk_len);
        pending_unk_len = 0;
      }
      add(id, 1);
    } else if (unk_id >= 0) {
      if (pending_unk_len > 0 && !fuse_unk) add(unk_id, pending_unk_len), pending_unk_len = 0;
      pending_unk_len += 1;
    }
    // Without an unk token, a byte missing from the vocabulary is dropped (HF does the same).
  }
  if (pending_unk_len > 0) add(unk_id, pending_unk_len);

  struct Merge {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  auto later = [](const Merge& x, const Merge& y) {  // min-heap on (rank, pos)
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  std::priority_queue<Merge, std::vector<Merge>, decltype(later)> queue(later);
  auto lookup = [&](int32_t a, int32_t b) -> const std::pair<uint32_t, int32_t>* {
    auto it = merges.find((static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b));
    return it == merges.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i) {
    if (auto m = lookup(sym[i].c, sym[i + 1].c))
      queue.push({m->first, static_cast<int32_t>(i), m->second});
  }
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = sym[next_pos];
    auto m = lookup(cur.c, right.c);
    if (m == nullptr || m->second != top.new_id) continue;  // expired entry
    cur.c = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    sym[next_pos].len = 0;
    if (right.next >= 0 && right.next < static_cast<int32_t>(sym.size()))
      sym[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (auto pm = lookup(sym[cur.prev].c, cur.c)) queue.push({pm->first, cur.prev, pm->second});
    }
    if (cur.next >= 0 && cur.next < static_cast<int32_t>(sym.size())) {
      if (auto nm = lookup(cur.c, sym[cur.next].c)) queue.push({nm->first, top.pos, nm->second});
    }
  }
  for (const Symbol& s : sym) {
    if (s.len != 0) out.push_back(s.c);
  }
}

void Tokenizer::Impl::Bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    if (auto it = bytes_vocab.find(std::string(word)); it != bytes_vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::shared_lock lock(cache_mu);
    if (auto it = cache.find(key); it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  BpeUncached(word, out);
  if (cacheable) {
    std::unique_lock lock(cache_mu);
    if (cache.size() < kCacheCapacity) {
      cache.emplace(std::move(key), std::vector<int32_t>(out.begin() + first, out.end()));
    }
  }
}

Status Tokenizer::Impl::EncodeRaw(std::string_view text, std::vector<int32_t>& ids) const {
  std::vector<Segment> segments;
  DL_RETURN_IF_ERROR(SegmentText(text, segments));
  std::vector<std::string_view> pieces;
  std::vector<std::string> words;
  for (const Segment& seg : segments) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    if (seg.end == seg.begin) continue;
    pieces.clear();
    DL_RETURN_IF_ERROR(SplitPieces(text.substr(seg.begin, seg.end - seg.begin), pieces));
    for (std::string_view piece : pieces) {
      words.clear();
      DL_RETURN_IF_ERROR(ByteLevelPieces(piece, words));
      for (const std::string& w : words) Bpe(w, ids);
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Public API.

Result<Tokenizer> Tokenizer::FromFile(const std::string& path) {
  std::error_code ec;
  std::string file = path;
  if (std::filesystem::is_directory(path, ec))
    file = (std::filesystem::path(path) / "tokenizer.json").string();
  auto text = ReadRegularFile(file, kMaxTokenizerFileBytes);
  if (!text.ok()) return text.status().WithContext("tokenizer file");
  return FromJson(*text, file);
}

Result<Tokenizer> Tokenizer::FromJson(std::string_view json_text, const std::string& origin) {
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const std::exception& e) {
    return DataLoss("{}: not valid JSON: {}", origin, e.what());
  }
  if (!root.is_object()) return DataLoss("{}: expected a JSON object at the top level", origin);
  Parser p(origin);
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  try {
    if (auto v = root.find("version");
        v != root.end() && v->is_string() && v->get<std::string>() != "1.0") {
      return p.Unsupported(
          "version", fmt::format("unknown tokenizer.json version '{}'", v->get<std::string>()));
    }
    auto model = root.find("model");
    if (model == root.end()) return p.Error("model", "missing");
    DL_RETURN_IF_ERROR(ParseModel(p, *model, *impl));
    DL_RETURN_IF_ERROR(ParseAddedTokens(p, root, *impl));
    DL_RETURN_IF_ERROR(ParseNormalizer(p, root));
    DL_RETURN_IF_ERROR(ParsePreTokenizer(p, root, *impl));
    DL_RETURN_IF_ERROR(ParseDecoder(p, root));
    DL_RETURN_IF_ERROR(ParsePostProcessor(p, root, *impl));
  } catch (const std::exception& e) {
    return DataLoss("{}: malformed tokenizer.json: {}", origin, e.what());
  }
  BuildDecodeTables(*impl);
  return Tokenizer(std::move(impl));
}

Result<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                               bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  DL_RETURN_IF_ERROR(impl_->EncodeRaw(text, ids));
  if (!add_special_tokens) return ids;
  if (!impl_->post_supported) return Unimplemented("{}", impl_->post_unsupported_reason);
  if (!impl_->has_template) return ids;
  std::vector<int32_t> out;
  out.reserve(ids.size() + 4);
  for (size_t i = 0; i < impl_->template_pieces.size(); ++i) {
    const auto& piece = impl_->template_is_sequence[i] ? ids : impl_->template_pieces[i];
    out.insert(out.end(), piece.begin(), piece.end());
  }
  return out;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (!IsKnown(id)) continue;
    if (skip_special_tokens && IsSpecial(id)) continue;
    bytes += impl_->id_bytes[id];
  }
  return utf8::Lossy(bytes);
}

Result<std::vector<std::string>> Tokenizer::PreTokenize(std::string_view text) const {
  std::vector<Segment> segments;
  DL_RETURN_IF_ERROR(impl_->SegmentText(text, segments));
  std::vector<std::string> out;
  std::vector<std::string_view> pieces;
  for (const Segment& seg : segments) {
    std::string_view s = text.substr(seg.begin, seg.end - seg.begin);
    if (seg.id >= 0) {
      out.emplace_back(s);
      continue;
    }
    if (s.empty()) continue;
    pieces.clear();
    DL_RETURN_IF_ERROR(impl_->SplitPieces(s, pieces));
    for (std::string_view piece : pieces) DL_RETURN_IF_ERROR(impl_->ByteLevelPieces(piece, out));
  }
  return out;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  std::string key(token);
  if (auto it = impl_->added_map.find(key); it != impl_->added_map.end()) return it->second;
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (auto a = impl_->added_by_id.find(id); a != impl_->added_by_id.end())
    return impl_->added[a->second].content;
  if (id >= 0 && id < static_cast<int32_t>(impl_->vocab_r.size()) && impl_->vocab_r_present[id]) {
    return impl_->vocab_r[id];
  }
  return std::nullopt;
}

std::string_view Tokenizer::TokenBytes(int32_t id) const {
  return IsKnown(id) ? std::string_view(impl_->id_bytes[id]) : std::string_view();
}

bool Tokenizer::IsKnown(int32_t id) const {
  return id >= 0 && id < impl_->vocab_size && (impl_->id_flags[id] & 1) != 0;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return IsKnown(id) && (impl_->id_flags[id] & 2) != 0;
}

int32_t Tokenizer::vocab_size() const {
  return impl_->vocab_size;
}
const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return impl_->added;
}
size_t Tokenizer::num_merges() const {
  return impl_->num_merges;
}
const std::string& Tokenizer::origin() const {
  return impl_->origin;
}

}  // namespace dl
