// `make-model`: writes a synthetic Laguna checkpoint (config.json, generation_config.json and
// safetensors in the layout transformers' save_pretrained writes) by streaming deterministic values
// to disk in chunks, never holding the model in memory. Everything is written into
// DIR.partial-XXXXXX next to DIR and renamed at the end; any error (or cancellation) removes the
// partial directory.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "model/config.h"
#include "model/fp8_layout.h"

namespace dl {

struct MakeModelProgress {
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  std::string file;  // shard being written
};

struct MakeModelOptions {
  ModelConfig config;
  uint64_t seed = 0;
  DType dtype = DType::kBF16;  // BF16, F16 or F32 (with fp8: the tensors its layout leaves unquantised)
  // FP8 weights: the layout's tensors as E4M3 codes + F32 scales (synthetic rule, model/synthetic.h),
  // config.json with the format's quantization_config (model/fp8_layout.h).
  std::optional<Fp8Options> fp8;
  std::string out_dir;
  uint64_t max_shard_size = 5'000'000'000;  // transformers' default "5GB" (decimal)
  int threads = 2;                          // value generation threads
  std::function<void(const MakeModelProgress&)> progress;  // called after every chunk
  const std::atomic<bool>* cancel = nullptr;              // set to stop (Ctrl-C)
  std::optional<uint64_t> free_bytes_override;            // tests: pretend this much disk is free
};

struct MakeModelResult {
  std::vector<std::string> files;  // shard file names
  uint64_t weight_bytes = 0;       // sum of tensor bytes (index total_size)
  uint64_t file_bytes = 0;         // bytes on disk of all shards
  double seconds = 0.0;
};

// One safetensors shard of the plan: its file name and the tensor indices (into
// CheckpointTensorSpecs) it holds.
struct ShardPlan {
  std::string file;
  std::vector<size_t> tensors;
  uint64_t bytes = 0;
};
// transformers' rule: tensors in state-dict order, a new shard when the next tensor would push the
// current one past max_shard_size; one shard -> "model.safetensors", else
// "model-00001-of-0000N.safetensors".
std::vector<ShardPlan> PlanShards(const std::vector<uint64_t>& tensor_bytes, uint64_t max_shard_size);

Result<MakeModelResult> WriteSyntheticModel(const MakeModelOptions& options);

// "5GB" (10^9), "500MB", "2GiB" (2^30), "123" (bytes), ... as transformers' max_shard_size.
Result<uint64_t> ParseByteSize(std::string_view s);

// generation_config.json as save_pretrained writes it from the model config.
Status WriteGenerationConfig(const std::string& dir, const ModelConfig& config);

// Hook for files beside the weights: a small tokenizer when src/tokenizer provides
// WriteSmallTokenizer, and (to be wired up by the lead) the Laguna chat template.
Status WriteModelExtras(const std::string& dir, const ModelConfig& config);

}  // namespace dl
