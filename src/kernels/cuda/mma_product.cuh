// The tensor-core product's arithmetic (ops.h, section 5b), shared by the dense kernels (mma.cu) and
// the MoE experts (moe_mma.cu): one m16n8k16 BF16 MMA with FP32 accumulation, and one 32-element chunk
// of the fixed K permutation. Every kernel that uses MmaChunk in the order of ops.h 5b computes the
// same bits per output element, whatever its tiling, token count or load path.
#pragma once

#include <cstdint>

#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels::dev {

constexpr int kMmaChunk = 32;  // input elements per chunk: two k16 MMAs

// d += A B for one m16n8k16 tile (row.col, BF16 x BF16 -> FP32). Lane (g = lane / 4, c = lane % 4)
// holds A rows g and g + 8 at logical k {2c, 2c+1} (a0 a1 / a2 a3) and {2c+8, 2c+9} (a4 a5 / a6 a7),
// B column g at the same k (b0 b1, b2 b3), and D rows g, g + 8 at columns 2c, 2c + 1.
__device__ __forceinline__ void Mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Chunk q of lane (g, c): wa = W[row g][32q + 8c, + 8), wb = W[row g + 8][same], xv = x[token g][same]
// (8 BF16 each, element e in bits 16(e%2) of word e/2). MMA h takes elements 4h .. 4h + 3 of each:
// words 2h, 2h + 1 as logical k {2c, 2c+1} and {2c+8, 2c+9}. Then MMA 0, MMA 1: the order of 5b.
template <int H>
__device__ __forceinline__ void MmaChunkHalf(float (&d)[4], const uint4& wa, const uint4& wb, const uint4& xv) {
  static_assert(H == 0 || H == 1, "a chunk has two MMAs");
  if constexpr (H == 0) {
    Mma16816(d, wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
  } else {
    Mma16816(d, wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
  }
}
// A kernel may interleave other accumulators' MMAs between the halves (each accumulator must still
// see half 0, then half 1, of each chunk in ascending order).
__device__ __forceinline__ void MmaChunk(float (&d)[4], const uint4& wa, const uint4& wb, const uint4& xv) {
  MmaChunkHalf<0>(d, wa, wb, xv);
  MmaChunkHalf<1>(d, wa, wb, xv);
}

// 16 E4M3 codes -> 16 BF16 values, exact (an E4M3 value is a half, a half from E4M3 is a float, and
// that float has at most 4 significant bits, so BF16 holds it): the FP8 MMA rule's operand (ops.h 5d).
// lo holds codes 0..7, hi codes 8..15, in the BF16 kernels' element order (element e in bits 16(e%2) of
// word e/2).
__device__ __forceinline__ uint32_t Fp8x2ToBf16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&b);
}
__device__ __forceinline__ void Fp8x16ToBf16(const uint4& codes, uint4& lo, uint4& hi) {
  lo = make_uint4(Fp8x2ToBf16x2(codes.x), Fp8x2ToBf16x2(codes.x >> 16), Fp8x2ToBf16x2(codes.y),
                  Fp8x2ToBf16x2(codes.y >> 16));
  hi = make_uint4(Fp8x2ToBf16x2(codes.z), Fp8x2ToBf16x2(codes.z >> 16), Fp8x2ToBf16x2(codes.w),
                  Fp8x2ToBf16x2(codes.w >> 16));
}

// Lane (g, c)'s part of NM matrices' 16-row tiles times NT columns of 8 tokens over chunks [q_lo,
// q_hi) of one slice, in the order of ops.h 5b (acc must start at zero). Matrix m: wa[m], wb[m] point
// at rows g and g + 8 (16-byte pieces, already offset by c; live_* false: zeros), chunk q's piece at
// + 4q; token column j: xr[j] likewise (tok_live false: zeros). n8: pieces per row (in / 8; pieces
// past it are zeros). U chunks of every matrix are loaded before any is used (2 NM U loads of W in
// flight), then their x pieces (NT U). before_x() runs once, after the first W loads are issued and
// before any x is read: where a kernel waits for its predecessor (weights depend on nothing).
template <int NM, int NT, int U, typename BeforeX>
__device__ __forceinline__ void MmaSliceDots(const uint4* const (&wa)[NM], const uint4* const (&wb)[NM],
                                             const bool (&live_a)[NM], const bool (&live_b)[NM],
                                             const uint4* const (&xr)[NT], const bool (&tok_live)[NT], int n8,
                                             int q_lo, int q_hi, int c, float (&acc)[NM][NT][4], BeforeX&& before_x) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 wv[U][NM][2];
  auto load_w = [&](int q0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u;
      const bool in = q < q_hi && 4 * q + c < n8;
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        wv[u][m][0] = live_a[m] && in ? LoadStreaming(wa[m] + 4 * q) : zero;
        wv[u][m][1] = live_b[m] && in ? LoadStreaming(wb[m] + 4 * q) : zero;
      }
    }
  };
  load_w(q_lo);
  before_x();
  for (int q0 = q_lo; q0 < q_hi; q0 += U) {
    if (q0 != q_lo) load_w(q0);
    uint4 xv[U][NT];  // written by an earlier kernel: plain loads, not the .nc path
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + u;
      const bool in = q < q_hi && 4 * q + c < n8;
#pragma unroll
      for (int j = 0; j < NT; ++j) xv[u][j] = in && tok_live[j] ? xr[j][4 * q] : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (q0 + u >= q_hi) break;
#pragma unroll
      for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j) MmaChunk(acc[m][j], wv[u][m][0], wv[u][m][1], xv[u][j]);
    }
  }
}

// 16-byte asynchronous copy global -> shared; valid false: 16 zero bytes (src must still be a
// mapped address).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(SmemAddr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
#endif
}
__device__ __forceinline__ void CpAsyncCommit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// The launcher Gemv calls for GemvParams::mma (strides already resolved).
Status MmaGemv(const GemvParams& p, cudaStream_t stream);

}  // namespace dl::kernels::dev
