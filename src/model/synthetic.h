// Deterministic synthetic weights. Every value is a pure function of (seed, tensor name, element
// index) through the counter-based generator of base/rng.h, so `make-model` (streamed to disk),
// MakeSyntheticCheckpoint (in memory) and the CUDA `bench --shape` (on the device) produce the same
// weights without sharing a file.
//
// Value of element i of tensor `name` (key = StreamKey(seed, name), n = NormalAt(key, i)), in FP32:
//   kLinear          n * (1 / sqrtf(fan_in))       weights [out, in], fan_in = in
//   kEmbedding       n
//   kLmHead          n * (3 / sqrtf(hidden))
//   kNorm            1 + 0.2 * n                   RMSNorm / QK-norm weights (never all ones)
//   kRouter          n * (2 / sqrtf(hidden))
//   kCorrectionBias  0.1 * n                       (never all zeros)
// then rounded to the file dtype (round to nearest even).
//
// FP8 weights (make-model --dtype fp8, --shape-dtype fp8; the fp8 contract, docs/fp8.md): those FP32
// values, per scale block amax = max |v| (FP32), scale = amax / 448.0f (1 when amax == 0), code =
// FloatToFp8E4M3(v / scale) (FP32 division, round to nearest even, saturating). The CUDA generator
// mirrors QuantizeSyntheticFp8Band.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"

namespace dl {

enum class TensorKind : uint8_t { kLinear, kEmbedding, kLmHead, kNorm, kRouter, kCorrectionBias };

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorKind kind = TensorKind::kLinear;
  int64_t fan_in = 1;  // the `in` of a linear weight; the hidden size for router / LM head
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Every tensor of a checkpoint of `c` in the per-expert on-disk layout that transformers 5.17.0's
// save_pretrained writes (spec §4.1), in state-dict order: embedding, layers, final norm, LM head
// (omitted when tie_word_embeddings).
std::vector<TensorSpec> CheckpointTensorSpecs(const ModelConfig& c);

// The multiplier and offset of a kind: value = offset + scale * NormalAt(...).
void TensorValueAffine(TensorKind kind, int64_t fan_in, float* scale, float* offset);

// Writes elements [begin, begin + count) of tensor `name` as FP32 into out[0..count).
void GenerateTensorValues(uint64_t seed, std::string_view name, TensorKind kind, int64_t fan_in, float* out,
                          int64_t begin, int64_t count);

// The synthetic FP8 scale of a block whose largest magnitude is `amax`.
inline float SyntheticFp8Scale(float amax) { return amax == 0.0f ? 1.0f : amax / 448.0f; }

// Quantises block row `band` of the [out, in] synthetic tensor `spec` with blocks of
// block_rows x block_cols: rows [band * block_rows, min(out, (band + 1) * block_rows)).
// codes: [rows in the band, in] row-major; scales: [ceil(in / block_cols)]. scratch holds the FP32
// values of the band (resized as needed).
void QuantizeSyntheticFp8Band(uint64_t seed, const TensorSpec& spec, int64_t block_rows, int64_t block_cols,
                              int64_t band, std::vector<float>* scratch, uint8_t* codes, float* scales);

}  // namespace dl
