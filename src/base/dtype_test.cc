#include "base/dtype.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace dl {
namespace {

// Naive reference: the representable value nearest to f among all codes, ties to the even code.
uint8_t NearestFp8ByScan(float f) {
  float best_err = std::numeric_limits<float>::infinity();
  int best = 0;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN codes
    const float v = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    if (std::signbit(v) != std::signbit(f)) continue;
    const float err = std::fabs(v - f);
    if (err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) {
      best_err = err;
      best = c;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(DtypeTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even).
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(Bf16ToFloat(0xc040), -3.0f);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
}

TEST(DtypeTest, F16MatchesIeeeHalf) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(1e6f), 0x7c00);
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));
  for (uint32_t h = 0; h < 0x7c00; h += 7) {
    EXPECT_EQ(FloatToF16(F16ToFloat(static_cast<uint16_t>(h))), h);
  }
}

TEST(DtypeTest, Fp8E4M3DecodesKnownCodes) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xff)));
}

TEST(DtypeTest, Fp8E4M3EncodeIsNearestEvenAndSaturates) {
  for (int i = -4000; i <= 4000; ++i) {
    const float f = std::ldexp(static_cast<float>(i), -9) * 1.37f;
    if (std::fabs(f) >= 448.0f) continue;
    EXPECT_EQ(FloatToFp8E4M3(f), NearestFp8ByScan(f)) << f;
  }
  EXPECT_EQ(FloatToFp8E4M3(1000.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-1000.0f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(NAN), 0x7f);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const float v = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    if (v == 0.0f) continue;
    EXPECT_EQ(FloatToFp8E4M3(v), c);
  }
}

TEST(DtypeTest, NamesRoundTrip) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3}) {
    EXPECT_EQ(DTypeFromSafetensorsName(DTypeSafetensorsName(t)), t);
    EXPECT_EQ(DTypeFromName(DTypeName(t)), t);
  }
  EXPECT_FALSE(DTypeFromSafetensorsName("I64").has_value());
}

}  // namespace
}  // namespace dl
