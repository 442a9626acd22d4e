// Loading a model into a backend, choosing KV scales, and greedy generation for one sequence.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/drafter.h"
#include "model/checkpoint.h"
#include "kernels/tuning.h"
#include "model/runner.h"
#include "model/shard_plan.h"

namespace dl {

enum class BackendKind { kAuto, kCpu, kCuda };
Result<BackendKind> ParseBackend(const std::string& name);

struct EngineOptions {
  // Exactly one of model_dir or shape.
  std::string model_dir;
  std::string shape;
  uint64_t seed = 0;
  std::optional<int> num_layers;
  BackendKind backend = BackendKind::kAuto;
  DType kv_dtype = DType::kF32;
  std::string kv_scales_file;  // FP8 only
  int32_t page_size = 16;
  int32_t max_seq_len = 4096;  // per sequence, bounds the KV pools
  int32_t max_sequences = 1;    // sequences the KV pools hold at full length
  int32_t prefill_chunk = 512;  // prompt tokens of one sequence per forward
  // The largest forward (CUDA: sizes the workspace arena and the graph buckets): token rows, and
  // sequences (output rows). The scheduler's max batch and per-step token budget stay within them.
  int32_t max_rows_per_step = 512;
  int32_t max_batch = 1;
  // Speculative decoding: draft tokens a verify step may add per sequence (0 = none). A verify step
  // has 1 + this many rows and outputs per sequence, so the CUDA workspace and graph buckets are
  // sized for max_batch * (1 + max_draft_tokens) of each.
  int32_t max_draft_tokens = 0;
  bool allow_fallback = false;  // CUDA: run a generic kernel where a preset is missing (reported)
  bool use_graph = true;        // CUDA: one captured graph per decode step
  bool force_calibration = false;  // FP8: calibrate even when the checkpoint ships scales
  std::vector<std::string> skip_ops;  // CUDA timing experiments only (CudaRunnerOptions::skip_ops)
  kernels::Tuning tuning;             // CUDA kernel tuning (--tune name=value), printed with results
  // Tensor parallelism (docs/tensor-parallel.md): ranks, and how the embedding is held. The CPU
  // reference runs tp ranks as threads of this process; the CUDA backend refuses tp > 1 (not built).
  int32_t tp = 1;
  EmbeddingMode embedding = EmbeddingMode::kReplicated;
};

// A loaded model: checkpoint, KV bookkeeping and a backend runner.
struct Engine {
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<KvCache> kv;
  std::unique_ptr<ModelRunner> runner;
  std::string backend_choice_reason;  // printed: why this backend was chosen
  EngineOptions options;
  const ModelConfig& config() const { return checkpoint->config(); }
};

// Resolves the backend (auto = CUDA where a GPU is usable, else CPU), chooses KV scales (--kv-scales
// file, else the checkpoint's k_scale/v_scale, else the built-in calibration) and builds the runner.
Result<std::unique_ptr<Engine>> LoadEngine(const EngineOptions& options);

// The checkpoint's self_attn.k_scale / v_scale, when every layer has both.
std::optional<KvScales> CheckpointKvScales(const Checkpoint& checkpoint);

// The fixed built-in calibration prompt set: deterministic token ids for a vocabulary size.
std::vector<std::vector<int32_t>> BuiltinCalibrationPrompts(int64_t vocab_size);
extern const char* const kCalibrationMethod;
// Runs the built-in prompts through `checkpoint` on the CPU reference with an F32 cache and returns
// per-layer scales amax/448.
Result<KvScales> CalibrateKvScales(const Checkpoint& checkpoint);

struct GenerateOptions {
  int32_t max_tokens = 16;
  bool ignore_eos = false;
  int32_t prefill_chunk = 512;
  // Teacher forcing: when set, these tokens are fed instead of the argmax (the argmax is still
  // reported), for checking logits along a fixed sequence.
  std::vector<int32_t> forced_tokens;
  bool keep_step_logits = false;
  // Speculative decoding (not with forced_tokens): each decode step proposes up to num_draft_tokens
  // tokens from `drafter` and verifies them in one forward; the output is the same token for token
  // and logit for logit (docs/speculative.md). nullptr or 0: plain decoding.
  const Drafter* drafter = nullptr;
  int32_t num_draft_tokens = 0;
};

struct GenerateResult {
  std::vector<int32_t> tokens;         // argmax at each step
  std::vector<float> margins;          // top-1 minus top-2 logit at each step
  std::vector<float> last_prompt_logits;
  std::vector<std::vector<float>> step_logits;  // when keep_step_logits
  std::string finish_reason;           // "length" or "stop"
  double prefill_seconds = 0;
  std::vector<double> decode_step_seconds;  // forwards after the first token
  std::vector<int32_t> decode_step_tokens;  // tokens each of those forwards produced (1 without speculation)
  SpecStats spec;                           // with a drafter
};

// Greedy decoding of one prompt through the batch interface (one sequence, logits of every step
// back on the host); releases the sequence's pages before returning (also on error).
Result<GenerateResult> GenerateGreedy(Engine& engine, std::span<const int32_t> prompt,
                                      const GenerateOptions& options);

// Index of the largest logit (lowest index on ties) and the top-1 minus top-2 margin.
std::pair<int32_t, float> ArgmaxWithMargin(std::span<const float> logits);

// DataLoss naming `context` and the first offending index when a logit is NaN or infinite: a
// broken model or kernel must not turn into a plausible token (argmax over NaN picks index 0).
Status CheckFiniteLogits(std::span<const float> logits, std::string_view context);

}  // namespace dl
