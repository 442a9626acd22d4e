// Weight quantisation as config.json's `quantization_config` declares it (docs/fp8.md). Two FP8
// containers exist for Laguna (laguna-checkpoints.md §2): the native `fp8` method (DeepSeek-style,
// `<weight>_scale_inv`) and compressed-tensors `float-quantized` (`<weight>_scale`). Both mean the
// same thing: W[o, i] = Fp8E4M3ToFloat(code[o, i]) * scale[o / block_rows, i / block_cols].
// Which tensors are FP8 is read from each tensor's safetensors header; this struct only says how
// their scales are named and shaped.
#pragma once

#include <cstdint>
#include <regex>
#include <string>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl {

enum class WeightQuantFormat : uint8_t {
  kNone,                  // no weight quantisation (possibly a KV-only compressed-tensors config)
  kFp8Native,             // quant_method "fp8": F32 `<weight>_scale_inv`
  kFp8CompressedTensors,  // quant_method "compressed-tensors", float-quantized: F32
                          // `<weight>_scale`
};

// How one FP8 weight's scales are laid out over its [out, in] elements.
enum class Fp8Granularity : uint8_t {
  kBlock,    // [ceil(out / block_rows), ceil(in / block_cols)]
  kChannel,  // one per output row: [out, 1]
  kTensor,   // one: [1] (or [] / [1, 1])
};

struct WeightQuantization {
  WeightQuantFormat format = WeightQuantFormat::kNone;
  Fp8Granularity granularity = Fp8Granularity::kBlock;
  int64_t block_rows = 0, block_cols = 0;  // kBlock only
  // Modules the config says stay unquantised (native: modules_to_not_convert / ignored_layers;
  // compressed-tensors: ignore). Exact module names, or compressed-tensors "re:" patterns. A tensor
  // stored as FP8 in one of them is an error; BF16 tensors elsewhere are fine (the header decides).
  std::vector<std::string> ignore;

  bool fp8() const { return format != WeightQuantFormat::kNone; }
  // "_scale_inv" (native) or "_scale" (compressed-tensors), appended to the weight's name.
  const char* scale_suffix() const {
    return format == WeightQuantFormat::kFp8Native ? "_scale_inv" : "_scale";
  }
  // The block shape of an [out, in] weight, as WeightRef carries it (per-channel (1, in),
  // per-tensor (out, in)).
  void BlockShape(int64_t out, int64_t in, int64_t* rows, int64_t* cols) const {
    switch (granularity) {
      case Fp8Granularity::kBlock:
        *rows = block_rows, *cols = block_cols;
        return;
      case Fp8Granularity::kChannel:
        *rows = 1, *cols = in;
        return;
      case Fp8Granularity::kTensor:
        *rows = out, *cols = in;
        return;
    }
  }
  // The shape the scale tensor of an [out, in] weight is stored with: [ceil(out / block_rows),
  // ceil(in / block_cols)], [out, 1] per channel, [1] per tensor (as compressed-tensors writes
  // them).
  std::vector<int64_t> ScaleShape(int64_t out, int64_t in) const {
    switch (granularity) {
      case Fp8Granularity::kBlock:
        return {(out + block_rows - 1) / block_rows, (in + block_cols - 1) / block_cols};
      case Fp8Granularity::kChannel:
        return {out, 1};
      case Fp8Granularity::kTensor:
        return {1};
    }
    return {};
  }
};

// The ignore list as a matcher: a module (a weight's name without ".weight") matches an exact entry
// naming it or one of its parents, or a compressed-tensors "re:" pattern (Python re.match: anchored
// at the start).
class IgnoreMatcher {
 public:
  explicit IgnoreMatcher(const std::vector<std::string>& entries);
  bool Matches(const std::string& module) const;

 private:
  std::unordered_set<std::string> exact_;
  std::vector<std::regex> patterns_;
};

// Parses a `quantization_config` object (already known not to be null). Every key and value is
// checked: an unknown key, or a value this engine cannot honour (static activation scales, another
// bit width, a transform, scale_fmt ue8m0, ...) is an InvalidArgument/Unimplemented naming it.
// `*quantizes_weights` is false for a compressed-tensors config that only describes the KV cache.
Status ParseQuantizationConfig(const nlohmann::json& q, WeightQuantization* out,
                               std::string* quant_method, bool* quantizes_weights);

}  // namespace dl
