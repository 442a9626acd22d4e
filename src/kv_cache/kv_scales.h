// Per-layer FP8 KV scales. Stored code = round_fp8(x / scale); read value = code * scale.
//
// Where scales come from, in this order (never from whichever request happens to come first, so outputs
// do not depend on request order): a --kv-scales file, the checkpoint's self_attn.k_scale / v_scale
// tensors, or `decodelab calibrate` run over the fixed built-in prompt set at load time.
//
// File format (JSON, written by `decodelab calibrate`, documented in docs/kv-scales.md):
//   {"format": "decodelab-kv-scales", "version": 1, "num_layers": L, "method": "...",
//    "model": {...identity...},
//    "layers": [{"layer": 0, "k_scale": 0.0123, "v_scale": 0.0456,
//                "k_scale_bits": "0x3c4985f0", "v_scale_bits": "0x3d3ac711"}, ...]}
// The *_bits fields are the float32 bit patterns; when present they are authoritative, so a scale read
// back is bit-identical to the one written (the lab's scale audit compares bits).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl {

struct KvScales {
  std::vector<float> k;  // [num_layers]
  std::vector<float> v;  // [num_layers]
  std::string source;    // "file:<path>", "checkpoint", "calibration:<prompt set>", "unit"

  bool empty() const { return k.empty(); }
  static KvScales Unit(int num_layers) {
    return {std::vector<float>(num_layers, 1.0f), std::vector<float>(num_layers, 1.0f), "unit"};
  }
  // The scales as JSON rows (with bit patterns), for /v1/decodelab/state and the lab's audit.
  nlohmann::json ToJson() const;
  // True when every scale equals `other`'s bit for bit.
  bool BitwiseEqual(const KvScales& other) const;
};

std::string FloatBitsHex(float f);

Result<KvScales> ReadKvScalesFile(const std::string& path, int num_layers);
Status WriteKvScalesFile(const std::string& path, const KvScales& scales, const std::string& method,
                         const nlohmann::json& model_identity);

// Scale from an observed absolute maximum: amax / 448 (the largest E4M3 value), 1.0 when amax is 0.
float Fp8ScaleFromAmax(float amax);

}  // namespace dl
