// Device pieces of the FP8 rule (kernels/ops.h, "THE FP8 RULE"), shared by the FP8 GEMV and MoE
// kernels: where a row's scales are, a chunk's 16 code values, and one token's step over one chunk.
// Every FP8 path computes a chunk with these and nothing else, so batch 1, batched and grouped give
// the same bits.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels::dev {

// Where row `row`'s scales start and how a chunk index maps to its scale column: column = c >> shift
// (block_cols = 16 << shift; shift 30 for a single block column: every chunk index is below 2^30).
struct Fp8ScaleMap {
  const float* scales = nullptr;
  int block_rows = 1;
  int cols = 1;   // scale columns per block row: ceil(in / block_cols)
  int shift = 0;
  __device__ __forceinline__ const float* Row(int row) const {
    return scales + static_cast<size_t>(row / block_rows) * cols;
  }
};
// Host side: the map of an FP8 weight with `in` columns; false when the block shape breaks the rule's
// conditions (block_cols a power of two multiple of 16, or >= in).
inline bool MakeFp8ScaleMap(const Fp8Weight& w, int in, Fp8ScaleMap* m) {
  if (w.block_rows < 1 || w.block_cols < 1 || w.scales == nullptr) return false;
  m->scales = w.scales;
  m->block_rows = w.block_rows;
  m->cols = (in + w.block_cols - 1) / w.block_cols;
  if (w.block_cols >= in) {
    m->shift = 30;
    return true;
  }
  if (w.block_cols % 16 != 0 || (w.block_cols & (w.block_cols - 1)) != 0) return false;
  int shift = 0;
  while ((16 << shift) < w.block_cols) ++shift;
  m->shift = shift;
  return true;
}

// THE FP8 RULE's chunk (kernels/ops.h): the 16 code values v[e] = float(code_e), exact (every E4M3
// value is a half and every half a float: cvt e4m3x2 -> f16x2, then f16 -> f32). No scale here: the
// scale multiplies the chunk's sum once (Fp8ChunkFma), so decoding costs no FP32 multiply per element.
__device__ __forceinline__ void Fp8ChunkValues(const uint4& codes, float (&v)[16]) {
  Fp8x4ToFloat(codes.x, v);
  Fp8x4ToFloat(codes.y, v + 4);
  Fp8x4ToFloat(codes.z, v + 8);
  Fp8x4ToFloat(codes.w, v + 12);
}
// One token's step of the rule over one chunk: p = 0; p = fmaf(v[e], x[16c + e], p) for e = 0 .. 15 in
// order (x: two 16-byte BF16 chunks); then acc = fmaf(p, s, acc) with s the chunk's block scale. The
// chunk's chain starts from zero, so the chunks a lane holds are independent chains and only the last
// FMA of each waits on acc.
__device__ __forceinline__ void Fp8ChunkFma(const float (&v)[16], float s, const uint4& x_lo, const uint4& x_hi,
                                            float& acc) {
  float xf[8];
  float p = 0.0f;
  Bf16x8ToFloat(x_lo, xf);
#pragma unroll
  for (int e = 0; e < 8; ++e) p = fmaf(v[e], xf[e], p);
  Bf16x8ToFloat(x_hi, xf);
#pragma unroll
  for (int e = 0; e < 8; ++e) p = fmaf(v[8 + e], xf[e], p);
  acc = fmaf(p, s, acc);
}
// Host: checks an FP8 operand [rows, in] for the kernels (16-byte aligned codes, in % 16, scales, block
// shape) and makes its scale map.
inline Status CheckFp8Weight(const Fp8Weight& w, int in, const char* op, Fp8ScaleMap* m) {
  if (reinterpret_cast<uintptr_t>(w.codes) % 16 != 0 || in % 16 != 0) {
    return InvalidArgument("{}: FP8 weights need 16-byte aligned codes and a row width that is a multiple of 16 "
                           "(got {})", op, in);
  }
  if (!MakeFp8ScaleMap(w, in, m)) {
    return InvalidArgument("{}: FP8 scales must be set with a block shape of >= 1 rows and block_cols a power of "
                           "two multiple of 16 or >= the row width {} (got {} x {})",
                           op, in, w.block_rows, w.block_cols);
  }
  return Status::Ok();
}

}  // namespace dl::kernels::dev
