// Small element-wise kernels of the decode step that belong to no bigger fusion yet.
#pragma once

#include <cstdint>

#include "base/status.h"
#include "kernels/common.h"

namespace dl::kernels {

// out[t, :] = table[ids[t] - slice_begin, :] for t < T. Ids come from device memory so a captured
// decode graph can feed the previous step's argmax straight back in. table: [slice_rows, d] BF16 (the
// rows [slice_begin, slice_begin + slice_rows) of the [V, d] embedding; the whole table by default),
// out: [T, d].
// A vocab-parallel rank (model/shard_plan.h) holds a slice: a token outside it gets a row of BF16 -0,
// and the forward's all-reduce adds the one rank's row that holds it. The sum starts from rank 0's
// value and adds in FP32, rounded once to BF16: x + (-0) = x for every x, +0 and -0 included (a +0
// filler would turn a table's -0 into +0), and the BF16 rounding of a BF16 value is itself, so the
// sum is the replicated lookup bit for bit, in any order of addition.
struct EmbedParams {
  const bf16* table = nullptr;
  const int32_t* ids = nullptr;  // [T] device
  bf16* out = nullptr;
  int num_tokens = 1;
  int d = 0;      // % 8 == 0
  int vocab = 0;  // ids outside [0, vocab) produce +0 rows (validated on the host before the copy)
  int slice_begin = 0;  // first vocabulary id the table holds
  int slice_rows = -1;  // rows held; -1: the whole table, [0, vocab) (the replicated lookup)
};
Status EmbedLookup(const EmbedParams& p, Stream stream);

// SwiGLU activation of a fused gate/up projection: h[t, j] = bf16(bf16(silu(g)) * u) with
// g = gate_up[t, j], u = gate_up[t, F + j] (gate rows first, as the fused projection is laid out),
// the reference's rounding points (silu in FP32 on the BF16 input, rounded, then a BF16 product).
struct SiluMulParams {
  const bf16* gate_up = nullptr;  // [T, 2F]
  bf16* out = nullptr;            // [T, F]
  int num_tokens = 1;
  int ffn = 0;  // F
};
Status SiluMul(const SiluMulParams& p, Stream stream);

// dst[i] = bf16(offset + scale * NormalAt(key, i)): synthetic weights generated on the device with the
// counter-based generator of base/rng.h (the host's make-model uses the same formula; device and host
// libm may differ in the last float bit, so a rare element can differ by one BF16 ulp).
Status FillAffineBf16(bf16* dst, int64_t n, uint64_t key, float scale, float offset, Stream stream);
// The same values as FP8 weights [rows, cols] with block_rows x block_cols scales (the FP8 weight
// contract's rule on the FP32 value v of element i: per block amax, scale = amax / 448 (1 when amax is
// 0), code = FloatToFp8E4M3(v / scale)): codes [rows, cols], scales [ceil(rows / br), ceil(cols / bc)].
Status FillAffineFp8(uint8_t* codes, float* scales, int64_t rows, int64_t cols, int block_rows, int block_cols,
                     uint64_t key, float scale, float offset, Stream stream);

// *out = max_i |src[i]| over n BF16 values (out: one device float, overwritten). Max is independent of
// the reduction order, so the result is deterministic. Used to calibrate FP8 KV scales from a BF16 cache.
Status AbsMaxBf16(const bf16* src, int64_t n, float* out, Stream stream);

// Proves one device usable end to end: allocates, launches a kernel that writes 1M counter-based
// values, copies them back and compares them with the host's formula (allowing one BF16 ulp for
// device/host libm differences). Also reports the bytes in use on the device before the test.
Status DeviceSmokeTest(int device, size_t* bytes_in_use);

// dst[r, :] = src[rows[r], :] for r < num_rows (BF16, width % 8 == 0): the output rows of a batch
// gathered before the LM head.
struct GatherRowsParams {
  const bf16* src = nullptr;     // [*, width]
  const int32_t* rows = nullptr; // [num_rows] device
  bf16* dst = nullptr;           // [num_rows, width]
  int num_rows = 0;
  int width = 0;
};
Status GatherRows(const GatherRowsParams& p, Stream stream);

// out[i] = bf16(a[i] + b[i]) for i < n: the residual update AddRmsNorm makes, for hidden-state taps.
Status AddBf16(const bf16* a, const bf16* b, bf16* out, int64_t n, Stream stream);

// dst[i] = float(src[i]) for logits copied back to the host.
Status Bf16ToF32(const bf16* src, float* dst, int64_t n, Stream stream);
// dst[i] = bf16(src[i]) (round to nearest even): host FP32 activations (the DFlash drafter's taps)
// into the kernels' BF16.
Status F32ToBf16(const float* src, bf16* dst, int64_t n, Stream stream);

}  // namespace dl::kernels
