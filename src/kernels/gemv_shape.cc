// The GEMV's input split, chosen from the shape alone (see GemvParams::k_split).
#include <cstdint>

#include "kernels/ops.h"

namespace dl::kernels {

int GemvKSplitFor(int out, int in) {
  // Split until ~16K warps share the rows (measured in a CUDA graph on an H200, o_proj 2048 x 8192:
  // 1 warp per row 15.1 us, 2: 11.8, 4: 11.2, 8: 10.2); fewer warps leave HBM idle between a warp's
  // dependent load batches. Each slice keeps at least 4 chunks of 16 bytes per lane.
  constexpr int kWantWarps = 16384;
  const int n8 = in / 8;
  int split = 1;
  while (split < 8 && static_cast<int64_t>(out) * split < kWantWarps && n8 % (split * 2) == 0 &&
         n8 / (split * 2) >= 32 * 4) {
    split *= 2;
  }
  return split;
}

int GemvFp8KSplitFor(int out, int in) {
  // The same rule counted in 16-byte chunks: an FP8 row of `in` codes has the chunks of a BF16 row
  // of in / 2 elements.
  return GemvKSplitFor(out, in / 2);
}

}  // namespace dl::kernels

namespace dl::kernels {

int MmaKSplitFor(int out, int in) {
  // Enough warps (one per 16-row tile and slice) to keep ~32 KB of weight loads in flight per SM on
  // 132 SMs; each slice keeps at least 8 chunks of 32 elements (two register batches).
  constexpr int kWantWarps = 1024, kMinChunks = 8;
  const int chunks = (in + 31) / 32, tiles = (out + 15) / 16;
  int split = 1;
  while (split < 8 && static_cast<int64_t>(tiles) * split < kWantWarps && chunks % (split * 2) == 0 &&
         chunks / (split * 2) >= kMinChunks) {
    split *= 2;
  }
  return split;
}

bool MmaFp8Supported(int block_rows, int block_cols, int in) {
  return in % 16 == 0 && block_rows >= 1 &&
         (block_cols >= in || (block_cols >= 32 && (block_cols & (block_cols - 1)) == 0));
}

bool MmaFp8Supported(const Fp8Weight& w, int in) {
  return w.on() && w.scales != nullptr && MmaFp8Supported(w.block_rows, w.block_cols, in);
}

bool MoeFp8MmaSupported(const MoeParams& p) {
  auto fits = [](bool on, int block_rows, int block_cols, int in) {
    return !on || MmaFp8Supported(block_rows, block_cols, in);
  };
  auto fits_routed = [&](const MoeParams::Fp8Experts& e, int in) { return fits(e.on(), e.block_rows, e.block_cols, in); };
  auto fits_shared = [&](const Fp8Weight& w, int in) { return fits(w.on(), w.block_rows, w.block_cols, in); };
  return fits_routed(p.gate_fp8, p.d) && fits_routed(p.up_fp8, p.d) && fits_routed(p.down_fp8, p.ffn) &&
         fits_shared(p.shared_gate_fp8, p.d) && fits_shared(p.shared_up_fp8, p.d) &&
         fits_shared(p.shared_down_fp8, p.shared_ffn);
}

}  // namespace dl::kernels

namespace dl::kernels {

bool LibraryGemmFits(const GemvParams& p) {
  const int64_t xs = p.x_stride == 0 ? p.in : p.x_stride, ys = p.y_stride == 0 ? p.out : p.y_stride;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.w != nullptr && !p.w_fp8.on() && p.out % 8 == 0 && p.in % 8 == 0 && xs % 8 == 0 && ys % 8 == 0 &&
         aligned(p.w) && aligned(p.x) && aligned(p.y);
}

}  // namespace dl::kernels
