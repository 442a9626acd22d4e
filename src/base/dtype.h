// Element types of checkpoints and caches, and exact scalar conversions between them. The conversions
// are the reference for the CUDA kernels: round-to-nearest-even everywhere, FP8 E4M3 ("fn": no
// infinities, one NaN pattern, max 448) saturating like PyTorch's float8_e4m3fn cast does not -- see
// FloatToFp8E4M3 for the rule we use.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace dl {

enum class DType : uint8_t { kF32, kBF16, kF16, kF8E4M3 };

// Safetensors spelling: "F32", "BF16", "F16", "F8_E4M3".
std::string_view DTypeSafetensorsName(DType t);
std::optional<DType> DTypeFromSafetensorsName(std::string_view name);
// Lower-case user spelling: "f32", "bf16", "f16", "fp8".
std::string_view DTypeName(DType t);
std::optional<DType> DTypeFromName(std::string_view name);
size_t DTypeSize(DType t);

inline float Bf16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// The value of `f` after rounding to BF16 (the reference's "cast to bfloat16 and back").
inline float RoundBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

float F16ToFloat(uint16_t h);
uint16_t FloatToF16(float f);

float Fp8E4M3ToFloat(uint8_t v);
// Round to nearest even; values beyond +-448 saturate to +-448 (the cache never stores NaN for a
// finite input); NaN maps to the NaN code 0x7f.
uint8_t FloatToFp8E4M3(float f);

// Reads element `i` of a buffer of type `t` as float.
float LoadAsFloat(const void* data, DType t, size_t i);
void StoreFromFloat(void* data, DType t, size_t i, float v);

}  // namespace dl
