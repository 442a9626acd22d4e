#include "model/generation_config.h"

#include <cmath>

#include <fmt/format.h>

#include "base/file_util.h"

namespace dl {
namespace {

using nlohmann::json;

// Keys that only describe the file or a token id the engine does not need.
constexpr const char* kInert[] = {"_from_model_config", "transformers_version", "bos_token_id",
                                  "pad_token_id", "decoder_start_token_id", "use_cache",
                                  "do_sample", "return_dict_in_generate", "output_scores",
                                  "output_logits", "output_attentions", "output_hidden_states"};

// Keys that change generation and are not implemented: named in a warning when set to anything but
// transformers' neutral value.
struct Unused {
  const char* key;
  json neutral;
};

}  // namespace

Result<GenerationConfig> GenerationConfig::FromJson(const json& j) {
  if (!j.is_object()) return InvalidArgument("generation_config.json must be a JSON object");
  GenerationConfig g;
  g.present = true;
  const std::vector<Unused> unused = {
      {"num_beams", 1},          {"num_beam_groups", 1},       {"length_penalty", 1.0},
      {"no_repeat_ngram_size", 0}, {"encoder_no_repeat_ngram_size", 0},
      {"bad_words_ids", nullptr}, {"force_words_ids", nullptr}, {"min_length", 0},
      {"min_new_tokens", nullptr}, {"typical_p", 1.0},         {"epsilon_cutoff", 0.0},
      {"eta_cutoff", 0.0},       {"diversity_penalty", 0.0},   {"suppress_tokens", nullptr},
      {"begin_suppress_tokens", nullptr}, {"forced_bos_token_id", nullptr},
      {"forced_eos_token_id", nullptr}, {"exponential_decay_length_penalty", nullptr},
      {"sequence_bias", nullptr}, {"guidance_scale", nullptr}, {"max_length", nullptr},
      {"num_return_sequences", 1}};
  auto number = [&](const char* key, std::optional<double>* out) -> Status {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return Status::Ok();
    if (!it->is_number() || !std::isfinite(it->get<double>())) {
      return InvalidArgument("generation_config.json: {} must be a number", key);
    }
    *out = it->get<double>();
    return Status::Ok();
  };
  auto integer = [&](const char* key, std::optional<int64_t>* out) -> Status {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return Status::Ok();
    if (!it->is_number_integer()) return InvalidArgument("generation_config.json: {} must be an integer", key);
    *out = it->get<int64_t>();
    return Status::Ok();
  };
  DL_RETURN_IF_ERROR(number("temperature", &g.temperature));
  DL_RETURN_IF_ERROR(number("top_p", &g.top_p));
  DL_RETURN_IF_ERROR(number("min_p", &g.min_p));
  DL_RETURN_IF_ERROR(number("repetition_penalty", &g.repetition_penalty));
  DL_RETURN_IF_ERROR(integer("top_k", &g.top_k));
  DL_RETURN_IF_ERROR(integer("max_new_tokens", &g.max_new_tokens));
  // transformers' top_k default is 50 but vLLM only takes what the file says; so do we.
  if (g.temperature && *g.temperature < 0) return InvalidArgument("generation_config.json: temperature < 0");
  if (g.top_p && !(*g.top_p > 0 && *g.top_p <= 1)) {
    return InvalidArgument("generation_config.json: top_p must be in (0, 1]");
  }
  if (g.min_p && !(*g.min_p >= 0 && *g.min_p <= 1)) {
    return InvalidArgument("generation_config.json: min_p must be in [0, 1]");
  }
  if (g.repetition_penalty && !(*g.repetition_penalty > 0)) {
    return InvalidArgument("generation_config.json: repetition_penalty must be > 0");
  }
  if (g.max_new_tokens && *g.max_new_tokens < 1) {
    return InvalidArgument("generation_config.json: max_new_tokens must be >= 1");
  }
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_number_integer()) {
      g.eos_token_ids.push_back(it->get<int64_t>());
    } else if (it->is_array()) {
      for (const auto& v : *it) {
        if (!v.is_number_integer()) {
          return InvalidArgument("generation_config.json: eos_token_id entries must be integers");
        }
        g.eos_token_ids.push_back(v.get<int64_t>());
      }
    } else {
      return InvalidArgument("generation_config.json: eos_token_id must be an integer or a list");
    }
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    static const char* kUsed[] = {"temperature", "top_p",          "min_p",       "repetition_penalty",
                                  "top_k",       "max_new_tokens", "eos_token_id"};
    bool known = false;
    for (const char* u : kUsed) known = known || k == u;
    for (const char* u : kInert) known = known || k == u;
    if (known) continue;
    bool listed = false;
    for (const Unused& u : unused) {
      if (k != u.key) continue;
      listed = true;
      if (!it->is_null() && *it != u.neutral) {
        g.warnings.push_back(fmt::format("generation_config.json: {} = {} is not used (not implemented)",
                                         k, it->dump()));
      }
    }
    if (!listed) g.warnings.push_back(fmt::format("generation_config.json: unknown key {} ignored", k));
  }
  return g;
}

Result<GenerationConfig> GenerationConfig::FromFile(const std::string& path) {
  // Bounded like every loader's read: a model directory is input too (a FIFO or /dev/zero here must
  // not hang or exhaust memory).
  DL_ASSIGN_OR_RETURN(const json j, ReadJsonFile(path, kMaxJsonSidecarBytes));
  auto r = FromJson(j);
  if (!r.ok()) return r.status().WithContext(path);
  return r;
}

}  // namespace dl
