#include "base/dtype.h"

#include <cmath>

namespace dl {

std::string_view DTypeSafetensorsName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8_E4M3";
  }
  return "?";
}

std::optional<DType> DTypeFromSafetensorsName(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  return std::nullopt;
}

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF8E4M3: return "fp8";
  }
  return "?";
}

std::optional<DType> DTypeFromName(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::kF16;
  if (name == "fp8" || name == "f8" || name == "fp8_e4m3") return DType::kF8E4M3;
  return std::nullopt;
}

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 1;
  }
  return 0;
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

uint16_t FloatToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return sign | 0x7e00u;
  float a = std::fabs(f);
  if (a >= 65520.0f) return sign | 0x7c00u;  // overflow to inf (round-to-nearest boundary)
  if (a < std::ldexp(1.0f, -25)) return sign;  // rounds to zero (exact half rounds to even 0)
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5,1)
  int exp16 = e - 1 + 15;
  if (exp16 <= 0) {
    // subnormal: value = q * 2^-24
    float q = std::nearbyint(std::ldexp(a, 24));
    return sign | static_cast<uint16_t>(q);
  }
  float q = std::nearbyint(std::ldexp(a, 11 - e));  // 11 significant bits in [1024, 2048]
  uint32_t qi = static_cast<uint32_t>(q);
  if (qi == 2048) {
    qi = 1024;
    ++exp16;
  }
  if (exp16 >= 31) return sign | 0x7c00u;
  return sign | static_cast<uint16_t>((exp16 << 10) | (qi & 0x3ffu));
}

float Fp8E4M3ToFloat(uint8_t v) {
  const uint32_t sign = v >> 7;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t mant = v & 0x7u;
  float r;
  if (exp == 0xf && mant == 0x7) return NAN;
  if (exp == 0) {
    r = std::ldexp(static_cast<float>(mant), -9);
  } else {
    r = std::ldexp(static_cast<float>(mant | 0x8u), static_cast<int>(exp) - 10);
  }
  return sign ? -r : r;
}

uint8_t FloatToFp8E4M3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;  // saturate to 448
  if (a < std::ldexp(1.0f, -10)) {
    // below half the smallest subnormal (2^-9): round to zero, with exact half to even (0)
    return sign;
  }
  int e;
  std::frexp(a, &e);
  int exp8 = e - 1 + 7;
  if (exp8 <= 0) {
    float q = std::nearbyint(std::ldexp(a, 9));  // subnormal units of 2^-9
    return sign | static_cast<uint8_t>(q);       // q == 8 gives the smallest normal's code
  }
  float q = std::nearbyint(std::ldexp(a, 4 - e));  // 4 significant bits in [8, 16]
  uint32_t qi = static_cast<uint32_t>(q);
  if (qi == 16) {
    qi = 8;
    ++exp8;
  }
  if (exp8 > 15 || (exp8 == 15 && (qi & 7u) == 7u)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((exp8 << 3) | (qi & 7u));
}

float LoadAsFloat(const void* data, DType t, size_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(data)[i];
    case DType::kBF16: return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kF16: return F16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kF8E4M3: return Fp8E4M3ToFloat(static_cast<const uint8_t*>(data)[i]);
  }
  return 0.0f;
}

void StoreFromFloat(void* data, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(data)[i] = v; return;
    case DType::kBF16: static_cast<uint16_t*>(data)[i] = FloatToBf16(v); return;
    case DType::kF16: static_cast<uint16_t*>(data)[i] = FloatToF16(v); return;
    case DType::kF8E4M3: static_cast<uint8_t*>(data)[i] = FloatToFp8E4M3(v); return;
  }
}

}  // namespace dl
