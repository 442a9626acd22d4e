// Flags shared by every subcommand that loads a model (generate, calibrate, bench, serve, lab).
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/drafter.h"
#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

namespace dl::app {

struct EngineFlags {
  std::string model_dir;
  std::string shape;
  uint64_t seed = 0;
  int num_layers = 0;  // 0 = the shape's own count
  std::string shape_dtype = "bf16";  // --shape weights: bf16 or fp8
  std::string fp8_layout;            // --shape-dtype fp8: export (default) or all-linear
  std::string backend = "auto";
  std::string kv_dtype = "f32";
  std::string kv_scales;
  int page_size = 16;
  int max_seq_len = 4096;
  int prefill_chunk = 2048;
  std::vector<std::string> tune;  // --tune name=value (kernels/tuning.h)
  int tp = 1;                          // --tp (docs/tensor-parallel.md)
  std::string embedding = "replicated";  // --embedding vocab-parallel|replicated
  std::string tp_transport = "auto";     // --tp-transport (CUDA)

  // Adds the flags; `with_kv` adds the cache options too.
  void Add(CLI::App* cmd, bool with_kv = true);
  // Validates and converts to EngineOptions.
  Result<EngineOptions> ToOptions() const;
  // The same settings as command-line flags (for a `decodelab serve` child).
  std::vector<std::string> ToArgs() const;
};

// Speculative decoding flags (generate, bench, bench serve, serve): --spec, --spec-k,
// --spec-ngram-min, --spec-ngram-max, and --spec-model (the DFlash drafter's checkpoint).
struct SpecFlags {
  std::string method = "none";
  int k = 4;
  int ngram_min = 2;
  int ngram_max = 5;
  std::string model;  // --spec-model DIR (DFlash drafter)

  void Add(CLI::App* cmd);
  // Validates (--spec dflash needs --spec-model, which needs --spec dflash). The drafter itself is
  // built once the model is loaded (MakeDrafterFor in engine/dflash_drafter.h).
  Result<SpecOptions> ToOptions() const;
  // The same settings as command-line flags (for a `decodelab serve` child).
  std::vector<std::string> ToArgs() const;
  // Applies the options: the engine's workspace is sized for verify steps of 1 + k rows and, for
  // DFlash, for the drafter's hidden-state taps (read from its config.json).
  static Status Size(const SpecOptions& spec, EngineOptions* engine);
  static nlohmann::json ToJson(const SpecOptions& spec);
};

// The Hugging Face hub cache directory from the environment, as huggingface_hub finds it.
std::string HubCacheDir();

// "5,17,42" -> {5, 17, 42}.
Result<std::vector<int32_t>> ParseIdList(const std::string& text);

// The model's tokenizer: <model_dir>/tokenizer.json, or for --shape the small tokenizer make-model
// writes for that vocabulary. nullopt with `why` when the model has none.
Result<std::optional<Tokenizer>> LoadModelTokenizer(const EngineOptions& options, std::string* why);

}  // namespace dl::app
